"""`longspec export DIR --stage S --format hf|safetensors|vllm`: a stage's draft for use outside longspec.

The work runs in `python -m longspec.export` (this process never imports torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import UsageError

EPILOG = """Examples:

  longspec export demo --stage longcot --format hf

  longspec export demo --stage base --format safetensors --out drafts/base.safetensors

  longspec export demo --stage longcot --format vllm

hf: a folder like the released LongSpec drafts (config.json + model.safetensors, the reference's
unprefixed key layout). safetensors: one file, same keys, the config in its metadata. vllm: the hf
folder as vLLM loads it as a speculative draft with longspec's plugin (`longspec serve` runs it).
All are written atomically and read back before the command reports success.
Default --out: the stage's run folder, export/<stage>-hf, export/<stage>-vllm or
export/<stage>.safetensors.

Exit codes: 0 ok, 1 refused (stage not finished, destination exists without --force),
2 usage, 3 unreadable input (corrupt draft, draft that does not fit the target)."""


def export_cmd(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stage: Optional[str] = typer.Option(None, "--stage", "-s", help="Stage to export (default: the last finished one)."),
    fmt: str = typer.Option(..., "--format", "-f", help="hf (a model folder), safetensors (one file) or vllm (a folder vLLM serves)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Destination folder (hf) or .safetensors file."),
    force: bool = typer.Option(False, "--force", help="Replace an existing destination."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Export a stage's draft as an HF-style folder, a plain .safetensors file or a vLLM draft folder."""

    def body() -> None:
        from longspec.project.manifest import load_manifest
        from longspec.runs.stagedraft import stage_draft
        from longspec_cli.launch.trainer import export_argv, run_trainer_json

        if fmt not in ("hf", "safetensors", "vllm"):
            raise UsageError(f"--format {fmt!r}: choose hf, safetensors or vllm")
        if out is not None and fmt == "safetensors" and out.suffix.lower() != ".safetensors":
            raise UsageError(f"--out {out}: a safetensors export is one file ending in .safetensors")
        st = stage_draft(load_manifest(project_dir), stage, shown=str(project_dir))
        res = run_trainer_json(export_argv(st.output_dir, st.name, fmt, out, force), show_progress=False)
        if as_json:
            typer.echo(json.dumps(res, indent=2))
            return
        typer.echo(f"exported stage {res['stage']} as {res['format']} ({res['architecture']}, {res['tensors']} tensors, "
                   f"{res['parameters']:,} parameters, {res['dtype']})")
        typer.echo(f"  {res['out']}" + (f"/  [{', '.join(res['files'])}]" if res["format"] != "safetensors" else ""))
        typer.echo("  read back with load_draft_state: identical tensors")

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("export", help="Export a stage's draft as an HF folder, a .safetensors file or a vLLM draft.",
                epilog=EPILOG)(export_cmd)
