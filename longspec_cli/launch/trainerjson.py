"""Run a trainer-side module (`python -m longspec.<module> ...`) and read its JSON result.

The CLI never imports torch: it starts the module as a process, echoes its progress (stderr) when
asked, and reads the result from the last JSON line of its stdout. `run_module` is the one place
that does this; `run_trainer_json` adds the CLI's errors (the module's own error object, a crash).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from longspec.errors import LongspecError, RefusedError


@dataclass
class ModuleRun:
    code: int
    result: dict | None  # the last JSON object on stdout
    tail: list[str] = field(default_factory=list)  # the last stderr lines (for a crash message)
    timed_out: bool = False


def trainer_available() -> bool:
    """The trainer's packages are installed (so `python -m longspec...` can run)."""
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def trainer_root() -> Path:
    """The folder holding `longspec/`: the tree (or site-packages) this CLI runs from holds the trainer too."""
    return Path(__file__).resolve().parents[2]


def module_argv(module: str, *args: str) -> list[str]:
    """`python -m <module> <args>` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_module(argv: list[str], *, show_progress: bool = False, timeout: float | None = None) -> ModuleRun:
    """Run `argv` (a `module_argv`); stderr lines are echoed as they come when show_progress."""
    import subprocess
    import threading

    module = _module(argv)
    env = dict(os.environ)
    root = str(trainer_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    tail: deque[str] = deque(maxlen=12)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    except OSError as e:
        raise RefusedError(f"cannot start {module}: {e}") from None
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()  # stdout drains on its own: a big result never blocks the child
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), proc.kill())) if timeout else None
    if timer:
        timer.start()
    forward = _forward_sigterm(proc)
    try:
        for line in proc.stderr:
            line = line.rstrip("\n")
            tail.append(line)
            if show_progress and line and not _noise(line):
                print(f"  {line}", file=sys.stderr, flush=True)
        code = proc.wait()
        reader.join()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    finally:
        if timer:
            timer.cancel()
        forward()
    return ModuleRun(code, last_json("".join(chunks)), list(tail), expired.is_set())


def run_trainer_json(argv: list[str], *, show_progress: bool, allow_codes=()) -> dict:
    """Run `python -m longspec.<module> ... --json`; its last stdout line is the JSON result (or an
    error object). Exit codes in allow_codes still return the result."""
    module = _module(argv)
    if not trainer_available():
        raise RefusedError(f"`{module}` needs the trainer's packages (torch, transformers)",
                           hint="pip install 'longspec[train]'")
    run = run_module(argv if "--json" in argv else [*argv, "--json"], show_progress=show_progress)
    result, code = run.result, run.code
    if isinstance(result, dict) and "error" in result and code != 0:
        raise LongspecError(str(result["error"]), hint=result.get("hint"), exit_code=int(result.get("exit_code") or 1))
    if result is None or (code != 0 and code not in allow_codes):
        detail = "\n".join(line for line in run.tail if line.strip())
        raise LongspecError(f"{module} failed (exit {code})" + (f":\n{detail}" if detail else ""), exit_code=1)
    return result


def _forward_sigterm(proc):
    """While the module runs, a SIGTERM to this process goes to it (it stops its own way, writes
    what it has done and exits; this process then reads its result): no module is left running
    on its own. Returns the function that puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.poll() is None and proc.send_signal(signum))
    return lambda: signal.signal(signal.SIGTERM, previous)


def _module(argv: list[str]) -> str:
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else argv[0]


def _noise(line: str) -> bool:
    return "FutureWarning" in line or "return forward_call" in line or line.lstrip().startswith("warnings.warn")


def last_json(out: str) -> dict | None:
    """The last line of `out` that is a JSON object."""
    for line in reversed((out or "").strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None
