"""One training process group: start, tee, progress line, interrupt, stop.

The launcher (DeepSpeed's runner) starts in a new session, so its process group holds every
rank and helper it spawns and nothing else. Its stdout and stderr go straight to
`<output_dir>/train.log` (so a closed terminal does not kill the run); this process follows
the file and echoes it, with a progress line from metrics.jsonl.

Ctrl-C (or SIGTERM to `longspec run`): SIGTERM to the training ranks only (never to DeepSpeed's
launchers, which would kill the ranks 30 s later): each rank finishes its optimizer step, saves a
checkpoint and exits 5 (longspec/training/preempt.py), and the launchers follow. A second Ctrl-C stops at
once: SIGINT to the group, then SIGTERM, then SIGKILL after timeouts, until no process of the
group is left (a further Ctrl-C skips to the next signal). Without a trainer rank in the group the
first Ctrl-C stops at once too.
`longspec stop` does the same from another terminal (launch/group.py, with the group's members
and signals). On several nodes the group is the leader (launch/fanout.py): Ctrl-C is SIGTERM to it
(every node saves), a second one SIGUSR2 (every rank ends now); its last line says what was checked
on each host (a leader that died without it: every host is checked from here).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from longspec.machine import liveness
from longspec.runs import runfolder, runrecord
from longspec.files.tail import LineTail, last_lines
from longspec.errors import RefusedError
from longspec_cli.launch.argv import INSTALL_HINT, LaunchCommand
from longspec_cli.launch.group import (GRACE_INT_S, GRACE_TERM_S, SAVE_TIMEOUT_S, is_node_launcher, request_save,
                                       terminate_group, trainer_ranks, utc_now, wait_group)

TRAIN_LOG = "train.log"
POLL_S = 0.2
_MISSING_MODULE = re.compile(r"No module named '(torch|deepspeed|transformers|hydra|omegaconf|safetensors)")


# ------------------------------------------------------------------------------- progress line

@dataclass
class Progress:
    """Formats `[stage] step 12/40 | loss 3.210 | 1,234 tok/s | ETA 0:45` from metrics records."""

    stage: str
    since: float = field(default_factory=time.time)  # records older than this launch are history
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    _first: tuple[int, float] | None = None
    _last_t: float | None = None

    def update(self, rec: dict) -> bool:
        if rec.get("event") in ("start", "resume") and isinstance(rec.get("total_steps"), int):
            self.total = rec["total_steps"]
        if not runfolder.is_step_record(rec):
            return False
        self.step = rec["step"]
        if isinstance(rec.get("total_steps"), int):
            self.total = rec["total_steps"]
        if isinstance(rec.get("loss"), (int, float)):
            self.loss = float(rec["loss"])
        if isinstance(rec.get("tokens_per_s"), (int, float)):
            self.tokens_per_s = float(rec["tokens_per_s"])
        t = rec.get("time")
        if isinstance(t, (int, float)) and t >= self.since - 1:
            if self._first is None:
                self._first = (self.step, float(t))
            self._last_t = float(t)
        return True

    def eta_s(self) -> float | None:
        if self._first is None or self.total is None or self.step is None or self._last_t is None:
            return None
        done = self.step - self._first[0]
        dt = self._last_t - self._first[1]
        if done <= 0 or dt <= 0:
            return None
        return max(0.0, (self.total - self.step) * dt / done)

    def line(self) -> str:
        if self.step is None:
            return f"[{self.stage}] starting..."
        parts = [f"[{self.stage}] step {self.step}/{self.total if self.total is not None else '?'}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {int(eta) // 3600}:{int(eta) % 3600 // 60:02d}:{int(eta) % 60:02d}")
        return " | ".join(parts)


class Echo:
    """Writes log lines to the terminal with a progress line kept at the bottom (TTY) or printed
    now and then (not a TTY)."""

    def __init__(self, stream: TextIO, quiet: bool = False, every_s: float = 30.0):
        self.stream = stream
        self.quiet = quiet  # no log echo: then a non-TTY gets a progress line every `every_s`
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.every_s = every_s
        self._shown = ""
        self._last_print = 0.0
        self._printed = ""  # last progress line written as a plain line (not a TTY)
        self.gone = False

    def write(self, text: str) -> None:
        """Write and flush; a terminal that went away (closed pipe) ends the echo, not the run."""
        if self.gone:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.gone = True

    def lines(self, text: str) -> None:
        if self.quiet or not text:
            return
        self.write(("\r\x1b[2K" if self.tty and self._shown else "") + text
                   + (self._shown if self.tty and self._shown else ""))

    def progress(self, line: str, *, final: bool = False) -> None:
        if self.tty:
            width = 200
            try:
                cols = os.get_terminal_size(self.stream.fileno()).columns
                width = cols - 1 if cols >= 20 else width  # a pty with no size set reports 0
            except (OSError, ValueError, AttributeError):
                pass
            self._shown = line[:width]
            self.write("\r\x1b[2K" + self._shown + ("\n" if final else ""))
            if final:
                self._shown = ""
        # Not a TTY: while the log is echoed the trainer's own step lines are there already, so
        # only the final line (and, with --quiet, one every `every_s`).
        elif (final or (self.quiet and time.monotonic() - self._last_print >= self.every_s)) \
                and line != self._printed:
            self._last_print, self._printed = time.monotonic(), line
            self.write(line + "\n")

    def clear(self) -> None:
        if self.tty and self._shown:
            self.write("\r\x1b[2K")
            self._shown = ""


# ------------------------------------------------------------------------------------ running

@dataclass
class RunResult:
    returncode: int
    interrupted: bool = False  # Ctrl-C / SIGTERM to `longspec run`
    stopped: bool = False  # `longspec stop` from another terminal
    wall_s: float = 0.0
    started_unix: float = 0.0
    log_tail: list[str] = field(default_factory=list)
    missing_module: str | None = None  # the launch could not import torch/deepspeed/...
    nodes: dict | None = None  # several nodes: the leader's report (launch/fanout.py), checked on every host


class _Interrupts:
    """SIGINT/SIGTERM handlers that only count; the wait loop acts on the count."""

    def __init__(self):
        self.count = 0
        self._seen = 0
        self._old: dict[int, object] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum, frame):
        self.count += 1

    def new(self) -> bool:
        if self.count > self._seen:
            self._seen = self.count
            return True
        return False

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def run_stage_process(cmd: LaunchCommand, output_dir: Path, stage: str, overrides: list[str], *,
                      stream: TextIO | None = None, quiet: bool = False,
                      grace_int: float = GRACE_INT_S, grace_term: float = GRACE_TERM_S,
                      extra_info: dict | None = None) -> RunResult:
    """Start the launch in its own process group, follow it to the end, return how it ended."""
    stream = stream or sys.stdout
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / TRAIN_LOG
    echo = Echo(stream, quiet=quiet)
    env = {**os.environ, **cmd.env}

    with open(log_path, "ab", buffering=0) as log:  # unbuffered: nothing left to fail at close
        try:
            log.write(f"\n===== longspec run {stage} {utc_now()} =====\n$ {cmd.shell()}\n".encode())
            log.flush()
        except OSError as e:
            _write_failed(log_path, output_dir, e)
        start_offset = log.tell()
        t0 = time.monotonic()
        with _Interrupts() as intr:
            try:
                proc = subprocess.Popen(cmd.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            except OSError as e:
                raise RefusedError(f"cannot start {cmd.argv[0]}: {e.strerror or e}", hint=INSTALL_HINT) from None
            info = {
                "kind": runrecord.LOCAL, "pid": proc.pid, "pgid": proc.pid, "host": socket.gethostname(), "argv": cmd.argv,
                "env": cmd.env, "started_at": utc_now(), "started_unix": time.time(),
                "proc_start": liveness.proc_start_time(proc.pid),
                "overrides": list(overrides), "stage": stage, "output_dir": str(output_dir),
                "world_size": cmd.world_size, "launcher_pid": os.getpid(), **(extra_info or {}),
            }
            if cmd.hosts:  # ranks on several nodes, started over ssh by this leader
                info.update(hosts=list(cmd.hosts), run_id=cmd.run_id, cpu=cmd.cpu)
            try:
                runrecord.write(output_dir, info)
            except OSError as e:
                terminate_group(proc.pid, grace_int=1.0, grace_term=1.0, reap=proc.poll)
                proc.wait()
                _write_failed(output_dir / runfolder.RUN_INFO, output_dir, e)
            result = _follow(proc, log_path, start_offset, output_dir, stage, echo, intr,
                             grace_int=grace_int, grace_term=grace_term, nodes=bool(cmd.hosts))
            ended_unix = time.time()
    result.wall_s = time.monotonic() - t0
    result.started_unix = info["started_unix"]
    result.log_tail = last_lines(log_path, 40, since=start_offset)
    for line in result.log_tail:
        m = _MISSING_MODULE.search(line)
        if m:
            result.missing_module = m.group(1)
    if cmd.hosts:
        result.nodes = _nodes_outcome(cmd, result, echo)
    final = runrecord.read(output_dir)
    final = final if final is not None and final.get("pid") == proc.pid else info
    result.stopped = bool(final.get("stop_requested_at"))
    try:
        runrecord.write(output_dir, {
            **final, "ended_at": utc_now(), "ended_unix": ended_unix, "returncode": result.returncode,
            "interrupted": result.interrupted or result.stopped,
        })
    except OSError as e:  # a full disk: the outcome is still reported; run.json keeps its start record
        result.log_tail.append(f"(run.json not updated: {e.strerror or e})")
    return result


def _write_failed(path: Path, output_dir: Path, e: OSError) -> None:
    """One of the launcher's own writes failed: say which, the free space and the resume point (exit 4)."""
    from longspec.runs import diskspace
    from longspec.errors import RunFailed

    raise RunFailed(diskspace.write_failure(path, output_dir, e),
                    hint="free some space (or point output_dir elsewhere) and run again") from None


def _nodes_outcome(cmd: LaunchCommand, result: RunResult, echo: Echo) -> dict:
    """The leader's report; when it has none (it was killed), every host is checked from here: the
    nodes' launchers saw their control channel close and their ranks save and exit."""
    from longspec_cli.launch import nodes

    outcome = nodes.read_outcome(result.log_tail)
    if outcome is not None and outcome.get("run_id") == cmd.run_id:
        return outcome
    echo.write(f"the launcher of the nodes ended without a report; checking {', '.join(cmd.hosts)}\n")
    env = dict(a.split("=", 1) for a in _flag_values(cmd.argv, "--env"))
    left, unasked = nodes.end_everywhere(list(cmd.hosts), cmd.run_id, python=_flag_values(cmd.argv, "--python")[0],
                                         cwd=_flag_values(cmd.argv, "--cwd")[0], env=env, wait=SAVE_TIMEOUT_S)
    return {"code": result.returncode, "fault": None, "hosts": list(cmd.hosts), "left": left, "unasked": unasked,
            "checked": True, "run_id": cmd.run_id}


def _flag_values(argv: list[str], flag: str) -> list[str]:
    stop = argv.index("--") if "--" in argv else len(argv)
    return [argv[i + 1] for i in range(stop - 1) if argv[i] == flag]


def _follow(proc: subprocess.Popen, log_path: Path, offset: int, output_dir: Path, stage: str,
            echo: Echo, intr: _Interrupts, *, grace_int: float, grace_term: float, nodes: bool = False) -> RunResult:
    progress = Progress(stage)
    tail = runfolder.MetricsTail(output_dir / runfolder.METRICS)
    read_log = _log_reader(log_path, offset)
    interrupted = False
    saving = False  # the ranks were asked to save and exit; the next Ctrl-C stops at once
    shown = ""

    def pump() -> None:
        nonlocal shown
        echo.lines(read_log())
        changed = False
        for rec in tail.poll().records:
            changed |= progress.update(rec)
        line = progress.line()
        if changed or (echo.tty and line != shown):
            shown = line
            echo.progress(line)

    while proc.poll() is None:
        if intr.new():
            interrupted = True
            echo.clear()
            if nodes:  # the leader passes a stop on to every node (launch/fanout.py)
                os.kill(proc.pid, signal.SIGUSR2 if saving else signal.SIGTERM)
                echo.write(f"\ninterrupt: {stage} stops now on every node, without saving\n" if saving else
                           f"\ninterrupt: every rank of {stage} on every node finishes its optimizer step, "
                           "saves a checkpoint and stops; Ctrl-C again to stop now without saving\n")
                saving = True
                continue
            if not saving and request_save(proc.pid):
                saving = True
                echo.write(f"\ninterrupt: {stage} finishes its optimizer step, saves a checkpoint and stops; "
                           "Ctrl-C again to stop now without saving\n")
                continue
            echo.write(f"\ninterrupt: stopping {stage} (process group {proc.pid}); Ctrl-C again to force\n")
            terminate_group(proc.pid, grace_int=grace_int, grace_term=grace_term,
                            reap=lambda: (proc.poll(), pump()), skip=intr.new,
                            say=lambda m: echo.write(m + "\n"))
            break
        pump()
        time.sleep(POLL_S)
    proc.wait()
    # The leader is gone; its ranks may still be unwinding, or saving a checkpoint: a SIGTERM to
    # the whole group (a scheduler, `kill -TERM -PGID`) ends DeepSpeed's runner at once, while the
    # ranks save, and DeepSpeed's per-node launcher would SIGKILL them 30 s into that save. So when
    # a signal ended the runner and ranks remain, end the per-node launcher (its one job left is
    # that kill), let the ranks finish, then nothing may outlive us.
    if trainer_ranks(proc.pid):
        if proc.returncode is not None and proc.returncode < 0:
            for pid in liveness.group_members(proc.pid):
                if is_node_launcher(liveness.cmdline(pid)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        wait_group(proc.pid, SAVE_TIMEOUT_S, reap=pump, skip=intr.new)
    if liveness.group_members(proc.pid):
        terminate_group(proc.pid, grace_int=grace_int if not interrupted else 0.5, grace_term=grace_term,
                        skip=intr.new)
    pump()
    echo.lines(read_log(final=True))
    if progress.step is not None:
        echo.progress(progress.line(), final=True)
    else:
        echo.clear()
    interrupted = interrupted or intr.count > 0
    return RunResult(returncode=proc.returncode, interrupted=interrupted)


def _log_reader(path: Path, offset: int) -> Callable[..., str]:
    """read(final=False): the complete lines of train.log written since the last read (from
    `offset`); final=True also returns a last line that has no newline."""
    tail = LineTail(path)
    tail.offset = offset

    def read(final: bool = False) -> str:
        lines = []
        while True:
            got = tail.poll()
            lines += got.lines
            if not (final and got.more):
                break
        text = "".join(line + "\n" for line in lines)
        rest = tail.rest() if final else ""
        return text + (rest + "\n" if rest and not rest.endswith("\n") else rest)

    return read
