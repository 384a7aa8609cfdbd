"""Where vLLM is installed for serving (its own environment, its own torch), and what it holds.

`find_python`: the Python of that environment, from (first match) the --vllm-python a command was
given, $LONGSPEC_VLLM_PYTHON, or the `python` beside the `vllm` command on PATH. `probe` runs
`PYTHON -m longspec.serve.probe --json` there (package metadata only: seconds, no vLLM import):
vLLM's version, longspec's plugin entry point, the refusal sentence of an unsupported version.
`longspec serve` and `doctor` read both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ENV = "LONGSPEC_VLLM_PYTHON"
PROBE_TIMEOUT_S = 60


def find_python(explicit: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """(the vLLM environment's Python or None, where it came from)."""
    if explicit:
        return Path(explicit).expanduser(), "--vllm-python"
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser(), f"${ENV}"
    vllm = shutil.which("vllm")
    if vllm:
        beside = Path(vllm).resolve().parent / "python"
        if beside.exists():
            return beside, "beside `vllm` on PATH"
    return None, "no --vllm-python, no $LONGSPEC_VLLM_PYTHON, no `vllm` on PATH"


def probe(python: Path) -> dict:
    """What `python -m longspec.serve.probe --json` reports; {"problem": why} when it cannot run."""
    if not python.exists():
        return {"python": str(python), "vllm": None, "plugin": None, "problem": f"{python} does not exist"}
    try:
        done = subprocess.run([str(python), "-m", "longspec.serve.probe", "--json"], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"python": str(python), "vllm": None, "plugin": None, "problem": f"{python} did not run: {e}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        why = "longspec is not installed there" if "No module named" in done.stderr else (done.stderr.strip()[-300:] or "no answer")
        return {"python": str(python), "vllm": None, "plugin": None, "problem": why}
    try:
        found = json.loads(lines[-1])
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return {"python": str(python), "vllm": None, "plugin": None, "problem": "its probe printed no readable answer"}
    return found
