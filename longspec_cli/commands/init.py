"""`longspec init DIR`: scaffold a three-stage project from the templates."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import UsageError

EPILOG = """Examples:

  longspec init demo --preset tiny --no-input

  longspec init qwq --preset qwq-32b-preview --data base=/data/slim.jsonl --data long=/data/long.jsonl --data longcot=/data/cot.jsonl

  longspec init llama --target /models/Llama-3-8B-262k --variant standard --gpus 8 --nodes 2 --hostfile hosts

  longspec init q3 --target /models/Qwen3-8B --data base=/data/slim.jsonl

A local --target folder is read (config.json, tokenizer files; nothing is loaded): its family
(qwen2, llama, qwen3, mistral), position limit (stage lengths are capped to it), precision
(torch_dtype) and chat template fill the stage files.

Stages are sized to the target and this machine: the recipe's sizes (LongSpec's, a 32B target on
8 GPUs) where the GPUs here fit them by the memory estimate, fitted batches and lengths where they
do not, and short CPU stages (about an hour each, from a measured matrix-multiply rate) for a
small target on a machine without a GPU. init prints what it chose, why, and the rough cost: the
tokens of a step, and its time on a GPU whose data sheet it lists (H100, H200, A100, ...) or on this
CPU; --full-size writes the recipe's sizes anyway, --gpus N sizes for N GPUs.

Nothing is overwritten without --force. With no flags on a terminal, a full-screen form asks."""


def init(
    project_dir: Optional[Path] = typer.Argument(None, help="Folder to create the project in."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Target preset: qwq-32b-preview, qwen3-8b, qwen3-32b, llama3.1-8b-instruct, llama3-8b-262k, vicuna-7b-16k, longchat-7b-32k, tiny."),
    variant: str = typer.Option("sinkpi-slicing", "--variant", help="LongSpec's training family: sinkpi-slicing or standard (trained alike: anchor-offset positions + noisy cross-attention lag; the stage files name the reference config each mirrors)."),
    target: Optional[str] = typer.Option(None, "--target", help="Path of the target model (overrides the preset's); a local folder's config.json sets family, stage lengths and precision."),
    data: List[str] = typer.Option([], "--data", help="STAGE=PATH training data for a stage (repeatable)."),
    stages: str = typer.Option("base,long,longcot", "--stages", help="Comma-separated stages, in order."),
    output_root: Optional[str] = typer.Option(None, "--output-root", help="Where the stages' run folders go (default DIR/runs)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs per node (default 8; tiny: 1)."),
    nodes: int = typer.Option(1, "--nodes", help="Number of nodes."),
    hostfile: Optional[str] = typer.Option(None, "--hostfile", help="DeepSpeed hostfile for several nodes."),
    precision: Optional[str] = typer.Option(None, "--precision", help="bf16, fp16 or fp32 (default: the target's torch_dtype, else the preset's)."),
    full_size: bool = typer.Option(False, "--full-size", help="Write the recipe's stage sizes (LongSpec's, for 8 GPUs) whatever this machine and target."),
    no_input: bool = typer.Option(False, "--no-input", help="Never ask; missing answers become '???' for validate to flag."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the files that would be written; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Scaffold a project: longspec.yaml plus a conf/ tree with the three stage configs."""

    def body() -> None:
        from longspec_cli.launch.scaffold import InitAnswers

        interactive = not no_input and sys.stdin.isatty() and sys.stdout.isatty()
        no_flags = project_dir is None and preset is None and target is None and not data
        if interactive and no_flags:
            answers = _wizard()
            if answers is None:
                typer.echo("cancelled: nothing written")
                raise typer.Exit(0)
        else:
            if project_dir is None:
                raise UsageError("missing project folder", hint="longspec init DIR [--preset NAME]")
            answers = InitAnswers(
                project_dir=project_dir,
                preset=preset,
                target=target,
                variant=variant,
                data=_parse_data(data),
                stages=tuple(s.strip() for s in stages.split(",") if s.strip()),
                output_root=output_root,
                gpus=gpus,
                nodes=nodes,
                hostfile=hostfile,
                precision=precision,
                full_size=full_size,
            )
            if interactive:
                _ask_missing(answers)
        _scaffold(answers, force=force, dry_run=dry_run, as_json=as_json)

    run_cli(body)


def _parse_data(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        stage, sep, path = item.partition("=")
        if not sep or not stage or not path:
            raise UsageError(f"--data {item!r} is not STAGE=PATH", hint="e.g. --data base=/data/slim.jsonl")
        out[stage.strip()] = str(Path(path).expanduser().resolve())
    return out


def _ask_missing(a) -> None:
    from longspec.project import presets as P

    if a.preset is None and a.target is None:
        choice = typer.prompt(f"Preset ({', '.join(P.preset_names())}) or a target model path")
        if choice in P.preset_names():
            a.preset = choice
        else:
            a.target = choice
    preset = P.get_preset(a.preset) if a.preset else None
    if preset is not None and preset.local:
        return
    for stage in a.stages:
        if stage not in a.data:
            hint = P.stage_defaults(stage)["data_hint"]
            path = typer.prompt(f"Training data for stage {stage} ({hint}); empty to fill in later",
                                default="", show_default=False)
            if path.strip():
                a.data[stage] = str(Path(path.strip()).expanduser().resolve())


def _wizard():
    try:
        from longspec_cli.tui.wizard_app import run_wizard
    except ImportError:
        raise UsageError("the init form is not available in this install",
                         hint="pass the answers as flags: longspec init DIR --preset NAME") from None
    return run_wizard(None)


def _scaffold(answers, *, force: bool, dry_run: bool, as_json: bool) -> None:
    import json

    from longspec.project import presets as P
    from longspec_cli.launch.scaffold import build_local_assets, plan_with_notes, write_project

    files, notes = plan_with_notes(answers)
    root = answers.project_dir.resolve()
    if dry_run:
        _report(root, list(files), as_json, wrote=False, notes=notes)
        return
    written = write_project(files, force=force)
    preset = P.get_preset(answers.preset) if answers.preset else None
    if preset is not None and preset.local and not answers.target:
        if not as_json:
            typer.echo("building the tiny target, tokenizer and data (cached after the first time) ...")
        build_local_assets(root)
    _report(root, written, as_json, wrote=True, notes=notes)


def _report(root: Path, files: list[Path], as_json: bool, *, wrote: bool, notes: list[str] = ()) -> None:
    import json
    import shlex

    if as_json:
        typer.echo(json.dumps({"project": str(root), "written": wrote, "files": [str(p) for p in files],
                               "notes": list(notes)}))
        return
    verb = "wrote" if wrote else "would write"
    typer.echo(f"{verb} {len(files)} files in {root}:")
    for p in files:
        typer.echo(f"  {p.relative_to(root) if p.is_relative_to(root) else p}")
    for note in notes:
        typer.echo(f"note: {note}")
    if wrote:
        q = shlex.quote(str(root))
        typer.echo(f"next: longspec validate {q}   then   longspec run {q} --all")


def register(app: typer.Typer) -> None:
    app.command("init", epilog=EPILOG)(init)
