"""`longspec monitor DIR`: follow a project's stages live.

Threads: one polling worker owns the ProjectFollower (tails every run-folder file each
`poll_s`, merges history and status results, posts ViewUpdated when what is shown changed);
a history worker reads the metrics before the opening tail; a status worker runs runs.status
when a run folder changed shape. Keys start `longspec run` / `longspec stop` as subprocesses
and edit configs only through launch.chain, after a confirm dialog that shows the diff.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Header
from textual.worker import get_current_worker

from longspec.errors import LongspecError
from longspec_cli.tui.follow import History, ProjectFollower
from longspec_cli.tui.sysinfo import Sampler, SysSample
from longspec_cli.tui.views import ProjectView
from longspec_cli.tui.widgets.alerts_panel import AlertsPanel
from longspec_cli.tui.widgets.charts import MetricChart
from longspec_cli.tui.widgets.tau_chart import TauLengthChart
from longspec_cli.tui.widgets.simtau_chart import SimTauChart
from longspec_cli.tui.widgets.confirm import ConfirmScreen
from longspec_cli.tui.widgets.help import HelpScreen
from longspec_cli.tui.widgets.log_tail import LogTail
from longspec_cli.tui.widgets.stage_panel import StagePanel
from longspec_cli.tui.widgets.stage_strip import StageStrip
from longspec_cli.tui.widgets.system_panel import SystemPanel

SYS_EVERY_S = 2.0
TICK_S = 1.0  # re-evaluate time-based alerts (stall) this often even when no file changed
LAUNCH_WATCH_S = 5.0  # a `longspec run` that fails within this time has its error shown


class ViewUpdated(Message):
    def __init__(self, view: ProjectView) -> None:
        super().__init__()
        self.view = view


class SystemUpdated(Message):
    def __init__(self, sample: SysSample) -> None:
        super().__init__()
        self.sample = sample


class ChainPlanned(Message):
    def __init__(self, stage: str, from_stage: str, diff: str) -> None:
        super().__init__()
        self.stage, self.from_stage, self.diff = stage, from_stage, diff


class MonitorApp(App[None]):
    CSS_PATH = ["monitor.tcss", "dialog.tcss"]
    TITLE = "longspec monitor"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("n", "next_stage", "next-stage"),
        Binding("r", "run_next", "run"),
        Binding("s", "stop", "stop"),
        Binding("left", "view(-1)", "prev stage", priority=True),
        Binding("right", "view(1)", "next stage", priority=True),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, project: str | os.PathLike, *, poll_s: float = 0.5, sampler=None,
                 clock=time.time, cli: Sequence[str] | None = None, deep_check: bool | None = None):
        super().__init__()
        self.follower = ProjectFollower(project, clock=clock)  # manifest errors raise here, before any UI
        self.poll_s = poll_s
        self.sampler = sampler
        self.cli = list(cli) if cli else [sys.executable, "-m", "longspec_cli"]
        self.deep_check = deep_check
        self.view: ProjectView | None = None
        self.selected: int | None = None  # None: follow the current stage
        self.history_done = threading.Event()  # for tests and the benchmark
        self.status_done = threading.Event()
        self.first_paint_s: float | None = None  # wall and CPU seconds from __init__ to the first screen
        self.first_paint_cpu_s: float | None = None
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._status_inflight = False
        self._notices_seen: dict[str, int] = {}
        self.sub_title = self.follower.manifest.name

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="≡")
        yield StageStrip(id="strip")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield StagePanel(id="stage")
                with Horizontal(id="charts"):
                    yield MetricChart("loss", "loss", id="loss-chart")
                    yield MetricChart("lr", "learning rate", id="lr-chart")
                with Horizontal(id="tau-charts"):      # acceptance: while training, and by length after eval
                    yield SimTauChart(id="simtau-chart")
                    yield TauLengthChart(id="tau-chart")
            with Vertical(id="right"):
                yield SystemPanel(id="system")
                yield AlertsPanel(id="alerts")
        yield LogTail(id="log")
        yield Footer()

    def on_mount(self) -> None:
        # Widget references taken now: later queries would search a modal screen when one is up.
        self.strip = self.query_one(StageStrip)
        self.panel = self.query_one(StagePanel)
        self.charts = [*self.query(MetricChart), self.query_one(TauLengthChart)]
        self.simtau_chart = self.query_one(SimTauChart)
        self.log_tail = self.query_one(LogTail)
        self.alerts = self.query_one(AlertsPanel)
        self.system = self.query_one(SystemPanel)
        self.follower.open()  # tails only: fast enough for the first screen
        self._apply(self.follower.view())
        self.call_after_refresh(self._painted)

    def on_unmount(self) -> None:
        self.workers.cancel_group(self, "poll")
        self._wake.set()

    def _painted(self) -> None:
        """The first screen is up: only now start the threads (they would compete for the GIL)."""
        self.first_paint_s = time.perf_counter() - self._t0
        self.first_paint_cpu_s = time.process_time() - self._c0
        self.poll_loop()
        self.history_worker()

    # -- workers ---------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="poll")
    def poll_loop(self) -> None:
        worker = get_current_worker()
        f = self.follower
        sampler = self.sampler if self.sampler is not None else Sampler()
        last_view, last_sample = None, None
        next_tick = next_sys = 0.0
        while not worker.is_cancelled:
            changed = self._drain_inbox()
            changed = f.poll() or changed
            if f.status_due() and not self._status_inflight:
                self._status_inflight = True
                try:
                    self.call_from_thread(self.status_worker)
                except RuntimeError:  # the app is shutting down
                    break
            now = time.monotonic()
            if changed or now >= next_tick:
                next_tick = now + TICK_S
                view = f.view()
                if view != last_view:
                    last_view = view
                    self.post_message(ViewUpdated(view))
            if now >= next_sys:
                next_sys = now + SYS_EVERY_S
                sample = sampler.sample()
                if sample != last_sample:
                    last_sample = sample
                    self.post_message(SystemUpdated(sample))
            if self._wake.wait(self.poll_s):
                self._wake.clear()
        sampler.close()

    def _drain_inbox(self) -> bool:
        changed = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            if isinstance(item, History):
                changed = self.follower.merge_history(item) or changed
            elif item[0] == "status":
                self._status_inflight = False
                if item[1] is not None:
                    self.follower.set_status(item[1], item[2])
                    self.status_done.set()
                    changed = True
            elif item[0] == "invalidate":
                self.follower.invalidate_status()

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    @work(thread=True, group="history")
    def history_worker(self) -> None:
        f = self.follower
        jobs = sorted(f.history_jobs(), key=lambda i: i != (self.view.current if self.view else 0))
        for i in jobs:
            hist = f.load_history(i)
            if hist is not None:
                self._post(hist)
        self.history_done.set()

    @work(thread=True, exclusive=True, group="status")
    def status_worker(self) -> None:
        try:
            key, statuses = self.follower.refresh_status()
        except (LongspecError, OSError) as e:  # a config made unreadable, a stale NFS handle
            message = e.message if isinstance(e, LongspecError) else f"status: {e}"
            self.call_from_thread(self.notify, message, severity="error")
            self._post(("status", None, None))
            return
        self._post(("status", key, statuses))

    # -- messages --------------------------------------------------------------------------

    def on_view_updated(self, msg: ViewUpdated) -> None:
        self._apply(msg.view)

    def on_system_updated(self, msg: SystemUpdated) -> None:
        self.system.show(msg.sample)

    def _apply(self, view: ProjectView) -> None:
        self.view = view
        for st in view.stages:  # toast the notices not shown yet (a file truncated, a folder deleted)
            seen = self._notices_seen.get(st.name, 0)
            for text in st.notices[-(st.notice_count - seen):] if st.notice_count > seen else ():
                self.notify(text, severity="warning")
            self._notices_seen[st.name] = st.notice_count
        sel = self._selected()
        stage = view.stages[sel]
        self.strip.show(view, sel)
        where = f"stage {sel + 1}/{len(view.stages)}" + ("" if self.selected is None else "  (← → to move)")
        self.panel.show(stage, where)
        for chart in self.charts:
            chart.show(view.stages)
        self.simtau_chart.show(stage)
        self.log_tail.show(stage)
        self.alerts.show(view.alerts, view.notice, tuple(n for s in view.stages for n in s.notices))

    def _selected(self) -> int:
        assert self.view is not None
        if self.selected is None:
            return self.view.current
        return max(0, min(self.selected, len(self.view.stages) - 1))

    # -- keys ------------------------------------------------------------------------------

    def action_view(self, delta: int) -> None:
        if self.view is None:
            return
        self.selected = max(0, min(self._selected() + delta, len(self.view.stages) - 1))
        self._apply(self.view)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_next_stage(self) -> None:
        if self.view is None:
            return
        stage = self.view.stages[self._selected()]
        if stage.state != "done":
            self.notify(f"next-stage: {stage.name} is {stage.state}; it needs a done stage", severity="warning")
            return
        nxt = next((s for s in self.follower.manifest.stages if s.draft_from == stage.name), None)
        if nxt is None:
            self.notify(f"next-stage: no stage takes its draft from {stage.name}", severity="warning")
            return
        self.plan_chain(nxt.name)

    @work(thread=True, exclusive=True, group="chain")
    def plan_chain(self, stage: str) -> None:
        from longspec_cli.launch.chain import chain_project

        try:
            res = chain_project(self.follower.manifest, stage, dry_run=True, deep=False)
        except LongspecError as e:
            self.call_from_thread(self.notify, e.message, severity="error", title="next-stage")
            return
        if res is None or not res.changed:
            self.call_from_thread(self.notify, f"{stage} already starts from that draft; nothing to change")
            return
        self.post_message(ChainPlanned(stage, res.from_stage or "", res.diff))

    def on_chain_planned(self, msg: ChainPlanned) -> None:
        from rich.syntax import Syntax  # only when a dialog opens: it costs ~40 ms to import

        body = Syntax(msg.diff, "diff", theme="ansi_dark", word_wrap=True)
        title = f"next-stage: point {msg.stage} at the final draft of {msg.from_stage}?"

        def done(ok: bool | None) -> None:
            if ok:
                self.apply_chain(msg.stage)
            else:
                self.notify("next-stage cancelled: nothing written")

        self.push_screen(ConfirmScreen(title, body, yes="Write"), done)

    @work(thread=True, exclusive=True, group="chain")
    def apply_chain(self, stage: str) -> None:
        from longspec_cli.launch.chain import chain_project

        try:
            res = chain_project(self.follower.manifest, stage, dry_run=False, deep=self.deep_check)
        except LongspecError as e:
            self.call_from_thread(self.notify, e.message, severity="error", title="next-stage")
            return
        self._post(("invalidate",))
        if res is not None:
            self.call_from_thread(self.notify, f"{stage}: {res.key} -> {res.new}", title="next-stage written")

    def action_run_next(self) -> None:
        status = self.follower.status
        if status is None:
            self.notify("still reading the run folders; try again in a moment")
            return
        for st in status.values():
            if st.action == "wait":
                self.notify(f"{st.name} is running; wait for it, or stop it with s", severity="warning")
                return
            if st.action in ("start", "resume", "rerun"):
                self.launch([*self.cli, "run", str(self.follower.root), st.name], f"run {st.name}", echo=False)
                return
            if st.action == "blocked":
                self.notify(f"{st.name} waits for an earlier stage", severity="warning")
                return
        self.notify("every stage is done; nothing to run")

    def action_stop(self) -> None:
        running = [s for s in (self.view.stages if self.view else ()) if s.state in ("running", "queued", "requeued")]
        if not running:
            self.notify("nothing is running", severity="warning")
            return
        names = ", ".join(s.name for s in running)

        def done(ok: bool | None) -> None:
            if ok:
                self.launch([*self.cli, "stop", str(self.follower.root)], f"stop {names}")

        self.push_screen(ConfirmScreen(f"Stop {names}?", "Sends the run's process group SIGINT, then SIGTERM "
                                       "(`longspec stop`). A checkpoint on disk can be resumed with r.",
                                       yes="Stop"), done)

    @work(thread=True, group="launch")
    def launch(self, argv: list[str], what: str, echo: bool = True) -> None:
        """Start `longspec run|stop` detached (it outlives the monitor); report an early failure.

        `echo=False`: the command's stdout is dropped (`run` echoes the whole train.log, which
        the run folder keeps anyway); its stderr, where errors go, is kept in a temp file."""
        fd, out_path = tempfile.mkstemp(prefix="longspec-monitor-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                        stdout=out if echo else subprocess.DEVNULL, stderr=out,
                                        start_new_session=True, cwd=self.follower.root)
            except OSError as e:
                self.call_from_thread(self.notify, f"{what}: cannot start: {e}", severity="error")
                return
        self._post(("invalidate",))
        try:
            rc = proc.wait(LAUNCH_WATCH_S)
        except subprocess.TimeoutExpired:
            self.call_from_thread(self.notify, f"{what}: started (pid {proc.pid}); output in {out_path}")
            return
        log = Path(out_path)
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-4:])
        log.unlink(missing_ok=True)             # finished: its last lines are in the notification
        self._post(("invalidate",))
        if rc == 0:
            self.call_from_thread(self.notify, f"{what}: done" + (f"\n{tail}" if tail else ""))
        else:
            self.call_from_thread(self.notify, f"{what}: exit {rc}\n{tail}", severity="error", timeout=15)
