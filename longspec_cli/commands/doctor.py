"""`longspec doctor`: what this machine can run of a stage, in seconds, without loading a model.

The probing runs in `python -m longspec.doctor` (this process never imports torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec doctor

  longspec doctor --dir /scratch/runs --json

Checks: the GPUs and their free memory; torch, CUDA, cuDNN, NCCL; DeepSpeed, its accelerator,
whether its op builders parse TORCH_CUDA_ARCH_LIST, nvcc for the ops it compiles; flash-attn,
Liger and the kernel each op will use; the disk under --dir, /dev/shm, RAM. Each line is ok,
warn (runs, with a caveat), fail (a stage cannot run here) or info, with its fix.

Exit codes: 0 nothing failed, 1 a check failed, 2 usage."""

MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]fail[/]", "info": "[dim]info[/]"}


def doctor_cmd(
    where: Optional[Path] = typer.Option(None, "--dir", help="Where runs will write (for the disk check; default: here)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check what this machine can run: GPUs, CUDA, NCCL, DeepSpeed ops, kernels, disk."""

    def body() -> None:
        from rich.console import Console
        from rich.table import Table

        from longspec_cli.launch.trainer import doctor_argv, run_trainer_json

        res = run_trainer_json(doctor_argv(where), show_progress=False, allow_codes=(1,))
        if as_json:
            typer.echo(json.dumps(res, indent=2))
        else:
            table = Table(show_header=False, box=None, pad_edge=False)
            for c in res["checks"]:
                table.add_row(MARK.get(c["status"], c["status"]), c["name"],
                              c["detail"] + (f"\n[dim]fix:[/] {c['fix']}" if c.get("fix") else ""))
            Console().print(table)
            if res["failed"]:
                Console(stderr=True).print(f"[red]failed:[/] {', '.join(res['failed'])}")
        if res["failed"]:
            raise typer.Exit(1)

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("doctor", help="Check what this machine can run: GPUs, CUDA, NCCL, DeepSpeed, kernels.",
                epilog=EPILOG)(doctor_cmd)
