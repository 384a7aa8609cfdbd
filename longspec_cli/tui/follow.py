"""Follow a project's run folders live (pure: no textual; `monitor --once` uses it too).

ProjectFollower
  open()            read the tail of every file: enough for the first screen, in milliseconds
  load_history(i)   read stage i's metrics.jsonl before that tail (slow; call it in a worker)
  poll()            read what was appended since the last poll (one stat or open per file)
  status_due()      True when a run folder changed shape: recompute runs.status in a worker
  view()            an immutable ProjectView to render

Only the thread that calls poll() mutates a StageFollow; load_history() and refresh_status()
return values that that thread merges (merge_history, set_status).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from longspec.runs import runfolder, runrecord
from longspec.project.manifest import Manifest, StageSpec, load_manifest
from longspec_cli.tui import alerts as A
from longspec_cli.tui.series import ChartData, Series, finite_or_nan
from longspec_cli.tui.simtau_series import SimTauSeries, falling_alert
from longspec.files.tail import LineTail, read_range_chunks
from longspec_cli.tui.views import ProjectView, StageView

TAIL_RECORDS = 2000  # step records read at open, before history arrives
LOG_KEEP = 300  # train.log lines kept per stage
NONFINITE_WINDOW = 20  # a non-finite loss among the last N step records raises the alert
LIVENESS_EVERY_S = 2.0
LOG_NAME = "train.log"


@dataclass
class History:
    stage: int
    generation: int
    series: Series
    skipped: int = 0
    simtau: SimTauSeries | None = None
    total_steps: int | None = None


def _stat_sig(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class StageFollow:
    def __init__(self, spec: StageSpec, clock: Callable[[], float]):
        self.spec = spec
        self.name = spec.name
        self.run = runfolder.RunDir(spec.output_dir)
        self.clock = clock
        self.notices: deque[str] = deque(maxlen=3)
        self.notice_count = 0  # notices ever raised: a UI shows the ones it has not shown yet
        self.structure = 0  # bumped when stage_complete.json / run.json / liveness / lifecycle change
        self._generation = 0  # bumped on every reset: a History of an older generation is dropped
        self._clear_metrics()
        self.log_lines: deque[str] = deque(maxlen=LOG_KEEP)
        self.log_seq = 0  # lines ever appended to log_lines since the last reset ...
        self.log_gen = 0  # ... and resets so far: a view appends only the lines it has not shown
        self.log_watch = A.LogWatch()
        self.complete: dict | None = None
        self.run_info: dict | None = None
        self.alive: bool | None = None
        self._sigs: tuple = ()
        self._liveness_at = 0.0
        self._folder_seen = False
        self._chart: tuple[Series, int, ChartData] | None = None  # the chart of (series, version)

    def _clear_metrics(self) -> None:
        self.series, self.simtau = Series(), SimTauSeries()
        self.recent: deque[dict] = deque(maxlen=64)
        self.step_clock = A.StepClock()
        self.last: dict | None = None
        self.total_steps: int | None = None
        self.error_event: dict | None = None
        self.skipped = 0
        self.last_seen: float | None = None
        self.history_end = 0
        self._generation += 1

    # -- open --------------------------------------------------------------------------------

    def open(self) -> None:
        mpath = self.run.metrics_path
        head = LineTail(mpath)
        for line in head.start_at_end(TAIL_RECORDS, max_bytes=TAIL_RECORDS * 400):
            self._ingest_line(line)
        self.history_end = head.history_end
        self.metrics = runfolder.MetricsTail(mpath)
        self.metrics.offset = head.offset
        sig = _stat_sig(mpath)
        self.last_seen = min(self.clock(), sig[2] / 1e9) if sig else None
        self.log = LineTail(self.run.path / LOG_NAME)
        lines = self.log.start_at_end(LOG_KEEP, max_bytes=256 * 1024)
        self.log_lines.extend(lines)
        self.log_seq += len(lines)
        self.log_watch.feed(lines)
        self._folder_seen = self.run.exists()
        self._check_files(force=True)

    def load_history(self) -> History | None:
        """Stage records before the opening tail. Thread-safe: reads files only."""
        gen, end = self._generation, self.history_end
        if end <= 0:
            return None
        hist = History(stage=-1, generation=gen, series=Series(), simtau=SimTauSeries())
        try:
            for lines in read_range_chunks(self.run.metrics_path, end):
                records, bad = runfolder.parse_metrics_lines(lines)
                hist.skipped += bad
                rows = []
                for rec in records:
                    step = rec.get("step")
                    if "event" in rec:
                        if rec["event"] == "start" and type(rec.get("total_steps")) is int:
                            hist.total_steps = rec["total_steps"]
                    elif runfolder.is_simtau_record(rec):
                        hist.simtau.add(rec)
                    elif runfolder.is_step_record(rec):
                        rows.append((step, finite_or_nan(rec.get("loss")), finite_or_nan(rec.get("lr"))))
                    else:
                        hist.skipped += 1
                if records and type(records[-1].get("total_steps")) is int:
                    hist.total_steps = records[-1]["total_steps"]
                hist.series.add_many(rows)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return None
        return hist

    def merge_history(self, hist: History) -> bool:
        if hist.generation != self._generation or self.history_end <= 0:
            return False
        hist.series.extend(self.series)
        self.series = hist.series
        self.simtau.extend_before(hist.simtau)
        self.skipped += hist.skipped
        if self.total_steps is None:
            self.total_steps = hist.total_steps
        self.history_end = 0
        return True

    @property
    def history_loaded(self) -> bool:
        return self.history_end <= 0

    # -- poll --------------------------------------------------------------------------------

    def poll(self) -> bool:
        changed = False
        batch = self.metrics.poll()
        had = self.last is not None or len(self.series) > 0
        if batch.reset or (batch.missing and had):
            self._clear_metrics()
            self._notice(f"{self.name}: metrics.jsonl was "
                         + ("removed" if batch.missing else "truncated or replaced; reading it again"))
            changed = True
        for rec in batch.records:
            self._ingest(rec, live=True)
            changed = True
        if self.metrics.skipped:
            self.skipped += self.metrics.skipped
            self.metrics.skipped = 0
            changed = True
        read = self.log.poll()
        if read.reset:
            self.log_lines.clear()
            self.log_seq, self.log_gen = 0, self.log_gen + 1
            self.log_watch.reset()
            self._notice(f"{self.name}: train.log was {read.reset}"
                         + ("" if read.reset == "deleted" else "; following the new file"))
            changed = True
        if read.lines:
            self.log_lines.extend(read.lines)
            self.log_seq += len(read.lines)
            self.log_watch.feed(read.lines)
            changed = True
        return self._check_files() or changed

    def io_error(self, err: OSError) -> bool:
        """Note a read error once (the next poll tries again); True when it is a new one."""
        text = f"{self.name}: cannot read the run folder ({err.strerror or err})"
        if self.notices and self.notices[-1] == text:
            return False
        self._notice(text)
        return True

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        self.notice_count += 1

    def _check_files(self, force: bool = False) -> bool:
        exists = self.run.exists()
        if self._folder_seen and not exists:
            self._notice(f"{self.name}: run folder {self.spec.output_dir} was deleted")
        self._folder_seen = exists
        sigs = (exists, _stat_sig(self.run.path / runfolder.STAGE_COMPLETE), _stat_sig(self.run.path / runfolder.RUN_INFO))
        if force or sigs != self._sigs:
            self._sigs = sigs
            self.complete = self.run.stage_complete()
            self.run_info = self.run.run_info()
            self._liveness_at = 0.0
            self.structure += 1
            force = True
        now = time.monotonic()
        if now - self._liveness_at >= LIVENESS_EVERY_S:
            self._liveness_at = now
            alive = self._alive()
            if alive != self.alive:
                self.alive = alive
                self.structure += 1
                force = True
        return force

    def _alive(self) -> bool | None:
        """A live run owns the folder (True), none does (False), or it cannot be told from here (None):
        a process group, or a SLURM job queued, running or requeued (longspec/runs/runrecord.py)."""
        own = runrecord.owner(self.run_info)
        return None if own.state == "unknown" else own.live

    # -- records -----------------------------------------------------------------------------

    def _ingest_line(self, line: str) -> None:
        if not line.strip():
            return
        rec = runfolder.parse_jsonl_line(line)
        if rec is None:
            self.skipped += 1
        else:
            self._ingest(rec, live=False)

    def _ingest(self, rec: dict, live: bool) -> None:
        event = rec.get("event")
        if event is not None:
            if event in ("start", "resume"):
                self.error_event = None
                if isinstance(rec.get("total_steps"), int):
                    self.total_steps = rec["total_steps"]
            elif event == "error":
                self.error_event = rec
            if event in runfolder.LIFECYCLE_EVENTS:  # the stage's state may have changed
                self.structure += 1
            return
        if runfolder.is_simtau_record(rec):
            self.simtau.add(rec)
            return
        if not runfolder.is_step_record(rec):
            self.skipped += 1
            return
        self.series.add(rec["step"], rec.get("loss"), rec.get("lr"))
        self.recent.append(rec)
        self.last = rec
        if isinstance(rec.get("total_steps"), int):
            self.total_steps = rec["total_steps"]
        t = _num(rec.get("time"))
        if t is not None:
            self.step_clock.add(t)
        if live:
            self.last_seen = self.clock()

    # -- view --------------------------------------------------------------------------------

    def rate(self) -> float | None:
        """Steps per second over the recent records (writer's clock), or None."""
        timed = [(r["step"], _num(r.get("time"))) for r in self.recent if _num(r.get("time")) is not None]
        if len(timed) >= 2:
            (s0, t0), (s1, t1) = timed[0], timed[-1]
            if t1 > t0 and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        last = self.last or {}
        el, step = _num(last.get("elapsed_s")), last.get("step")
        if el and step:
            return step / el
        return None

    def stage_alerts(self, state: str) -> list[A.Alert]:
        if state in ("done", "stale", "pending"):
            return []
        out: list[A.Alert] = []
        if self.error_event is not None and (a := A.check_record(self.error_event, self.name)):
            out.append(a)
        for rec in reversed(list(self.recent)[-NONFINITE_WINDOW:]):
            if a := A.check_record(rec, self.name):
                out.append(a)
                break
        out.extend(self.log_watch.alerts(self.name))
        if a := falling_alert(self.simtau.points, self.series.steps, self.series.loss, self.name):
            out.append(a)
        if state == "running" and self.last_seen is not None:
            idle = max(0.0, self.clock() - self.last_seen)
            if a := A.stall_alert(self.step_clock.median_interval(), idle, self.name):
                out.append(a)
        if a := A.process_gone(self.name, self.run_info, self.alive, self.complete is not None):
            out.append(a)
        return out

    def view(self, status: Any | None, root: Path) -> StageView:
        state = status.state if status is not None else "checking"
        last = self.last or {}
        step = last.get("step")
        total = self.total_steps
        if status is not None and step is None:
            step, total = status.steps, status.total_steps if total is None else total
        rate = self.rate()
        eta = None
        if state == "running" and rate and step is not None and total:
            eta = max(0.0, (total - step) / rate)
        complete = self.complete or {}
        loss = _num(last.get("loss"))
        if loss is None and complete:
            loss = _num(complete.get("final_loss"))
        cached = self._chart
        if cached is None or cached[0] is not self.series or cached[1] != self.series.version:
            cached = self._chart = (self.series, self.series.version, self.series.chart())
        chart = cached[2]
        return StageView(
            name=self.name, state=state, output_dir=_rel(self.spec.output_dir, root),
            draft_from=self.spec.draft_from, step=step, total_steps=total, loss=loss,
            llm_loss=_num(last.get("llm_loss")), lr=_num(last.get("lr")),
            tokens_per_s=_num(last.get("tokens_per_s")), elapsed_s=_num(last.get("elapsed_s")), eta_s=eta,
            sha256=(getattr(status, "sha256", None) or complete.get("sha256")),
            draft_sha256=complete.get("draft_sha256"),
            next_action=getattr(status, "next_action", ""), reasons=tuple(getattr(status, "reasons", ()) or ()),
            tau=getattr(status, "tau", None), tree_tau=getattr(status, "tree_tau", None),
            tau_by_length=tuple((r["length"], r["label"], r["tau"], r["baseline_tau"])
                                for r in getattr(status, "tau_by_length", None) or ()),
            chart=chart, chart_version=self.series.version,
            simtau=tuple(self.simtau.points), simtau_version=self.simtau.version,
            log=tuple(self.log_lines), log_seq=self.log_seq, log_gen=self.log_gen,
            alerts=tuple(self.stage_alerts(state)), notices=tuple(self.notices), notice_count=self.notice_count,
            skipped_lines=self.skipped, history_loaded=self.history_loaded,
            has_data=bool(self.last or self.complete or self.run_info or self.log_lines),
        )


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


class ProjectFollower:
    def __init__(self, project: str | os.PathLike | Manifest, clock: Callable[[], float] = time.time):
        self.manifest = project if isinstance(project, Manifest) else load_manifest(project)
        self.root = self.manifest.root
        self.clock = clock
        self.stages = [StageFollow(s, clock) for s in self.manifest.stages]
        self.status: dict[str, Any] | None = None
        self._status_for: tuple | None = None

    def open(self) -> "ProjectFollower":
        for st in self.stages:
            try:
                st.open()
            except OSError as e:
                st.io_error(e)
        return self

    def poll(self) -> bool:
        changed = False
        for st in self.stages:
            try:
                changed = st.poll() or changed
            except OSError as e:  # EIO, ESTALE on a shared file system, a permission change
                changed = st.io_error(e) or changed
        return changed

    def history_jobs(self) -> list[int]:
        return [i for i, st in enumerate(self.stages) if not st.history_loaded]

    def load_history(self, index: int) -> History | None:
        hist = self.stages[index].load_history()
        if hist is not None:
            hist.stage = index
        return hist

    def merge_history(self, hist: History) -> bool:
        return self.stages[hist.stage].merge_history(hist)

    def structure_key(self) -> tuple:
        return tuple(st.structure for st in self.stages)

    def status_due(self) -> bool:
        return self._status_for != self.structure_key()

    def refresh_status(self) -> tuple[tuple, list]:
        """(structure key, core statuses). Slow on a fresh multi-GB draft (hashing): use a worker."""
        from longspec.runs.status import project_status

        key = self.structure_key()
        statuses = project_status(self.manifest)
        _note_prepared(self.manifest, statuses)
        return key, statuses

    def invalidate_status(self) -> None:
        """Something outside the run folders changed (a config edited by next-stage): recompute."""
        self._status_for = None

    def set_status(self, key: tuple, statuses: list) -> None:
        self.status = {s.name: s for s in statuses}
        self._status_for = key

    def view(self) -> ProjectView:
        status = self.status or {}
        stages = tuple(st.view(status.get(st.name), self.root) for st in self.stages)
        current = _current(stages)
        notice = None
        if not any(s.has_data for s in stages):
            notice = f"no runs yet: press r (or use `longspec run`) to start {stages[0].name}"
        all_alerts = tuple(a for s in stages for a in s.alerts)
        return ProjectView(name=self.manifest.name, root=str(self.root), stages=stages, current=current,
                           notice=notice, alerts=all_alerts)


def _note_prepared(manifest, statuses: list) -> None:
    """A reason line per stage whose data is prepared (tokens, epochs covered), stale or corrupt."""
    from longspec.formats.prepared import project_prepared

    prepared = project_prepared(manifest)
    for st in statuses:
        p = prepared.get(st.name)
        if p is not None and p.state in ("ready", "stale", "corrupt"):
            st.reasons.append(f"data {p.line()}")


def _current(stages: tuple[StageView, ...]) -> int:
    for i, s in enumerate(stages):
        if s.state == "running":
            return i
    with_data = [i for i, s in enumerate(stages) if s.has_data]
    return with_data[-1] if with_data else 0
