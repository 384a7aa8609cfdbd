"""`longspec serve DIR [STAGE]`: vLLM's OpenAI-compatible server for the stage's target, with the
stage's GLIDE draft speculating (longspec's vLLM plugin, in the vLLM environment's own Python).

This process never imports torch or vLLM: it finds the vLLM environment and asks it what it holds
(longspec/machine/vllmenv.py), exports the draft in the vLLM format when the stage has no current
export (`python -m longspec.export`), builds the command (launch/vllmcmd.py) and runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli

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
        from longspec_cli.launch.trainer import run_trainer_json

        def plan() -> vllmcmd.ServePlan:
            return vllmcmd.plan_serve(project_dir, stage, python=vllm_python, gamma=gamma, host=host, port=port,
                                      extra=list(ctx.args))

        p = plan()
        if p.export and dry_run:
            typer.echo(f"# the draft is exported first:\n$ {vllmcmd.shell_line(p.export)}")
        elif p.export:
            run_trainer_json(p.export, show_progress=False)
            typer.echo(f"exported stage {p.stage}'s draft for vLLM: {p.draft}")
            p = plan()
        typer.echo(f"$ {vllmcmd.shell_line(p.argv)}")
        if dry_run:
            typer.echo(f"# would serve {p.target} with stage {p.stage}'s draft at {p.url} (model: {p.target})")
            return
        typer.echo(f"serving {p.target} with stage {p.stage}'s draft (gamma {gamma}): OpenAI API at {p.url} "
                   f"(model: {p.target}) once vLLM says it is ready; Ctrl-C stops it")
        try:
            code = vllmcmd.run_server(p.argv)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        if code:
            raise typer.Exit(code)

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a stage's target with its GLIDE draft in vLLM (OpenAI-compatible API).",
                epilog=EPILOG, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve_cmd)
