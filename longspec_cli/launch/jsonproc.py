"""Run a trainer-side module (`python -m longspec.evaluate|export ... --json`) from the CLI.

The CLI never imports torch: it starts the module as a process, echoes its progress (stderr) and
reads the JSON result from the last line of its stdout.
"""

from __future__ import annotations

import json
import sys
from collections import deque

from longspec_cli.errors import LongspecError, RefusedError


def run_trainer_json(cmd: list[str], *, show_progress: bool, allow_codes=()) -> dict:
    """Run `python -m longspec.<module> ... --json`; its last stdout line is the JSON result (or an error object).

    stderr lines (progress) are echoed as they come when show_progress; the last ones are kept for
    the error message of a crash. Exit codes in allow_codes still return the result."""
    import importlib.util
    import subprocess
    import threading

    module = cmd[2] if len(cmd) > 2 and cmd[1] == "-m" else cmd[0]
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise RefusedError(f"`{module}` needs the trainer's packages (torch, transformers)",
                           hint="pip install 'longspec[train]'")
    if "--json" not in cmd:
        cmd = [*cmd, "--json"]
    tail: deque[str] = deque(maxlen=12)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    except OSError as e:
        raise RefusedError(f"cannot start {module}: {e}") from None
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()                       # stdout drains on its own: a big result never blocks the child
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
    out = "".join(chunks)
    result = _last_json(out)
    if isinstance(result, dict) and "error" in result and code != 0:
        raise LongspecError(str(result["error"]), hint=result.get("hint"), exit_code=int(result.get("exit_code") or 1))
    if result is None or (code != 0 and code not in allow_codes):
        detail = "\n".join(l for l in tail if l.strip())
        raise LongspecError(f"{module} failed (exit {code})" + (f":\n{detail}" if detail else ""), exit_code=1)
    return result


def _noise(line: str) -> bool:
    return "FutureWarning" in line or "return forward_call" in line or line.lstrip().startswith("warnings.warn")


def _last_json(out: str):
    for line in reversed((out or "").strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
