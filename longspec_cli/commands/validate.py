"""`longspec validate PATH...`: check projects and stage files before a launch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec validate my-proj

  longspec validate my-proj --json --strict

  longspec validate conf/exp/long.yaml --world-size 16

  longspec validate ../LongSpec/longspec/train/conf/exp/qwq_glide_8gpu_slim6b.yaml

Every problem is listed (file:line, key, message, hint). Exit 0: no errors (warnings allowed),
1: errors (with --strict, warnings too), 2: usage (a PATH that does not exist, a bad flag)."""

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def validate(
    paths: List[Path] = typer.Argument(..., help="Project folders (longspec.yaml + conf/) or stage YAML files."),
    as_json: bool = typer.Option(False, "--json", help="Print {ok, errors, warnings, problems, info, files} as JSON."),
    strict: bool = typer.Option(False, "--strict", help="Treat warnings as errors."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1,
                                             help="GPUs in total for the batch arithmetic (default: the manifest's "
                                                  "launch.gpus x nodes, else 8)."),
) -> None:
    """Check stage configs and the stage chain; list every problem with file, line and hint."""

    def body() -> None:
        import json

        from longspec.project.validate import validate_paths

        report = validate_paths([str(p) for p in paths], world_size=world_size)
        if not report.count("error"):  # a separate check: the projects' checkpoints vs free disk space
            from longspec_cli.launch.preflight import project_disk_problems

            for p in paths:
                report.add(project_disk_problems(p))
        if strict:
            report = report.strict()
        if as_json:
            typer.echo(json.dumps(report.to_json(), indent=2))
        else:
            _render(report, [p if p.is_dir() else p.parent for p in paths])
        if report.count("error"):
            raise typer.Exit(1)

    run_cli(body)


def _shown(file: str | None, bases: list[Path] = ()) -> str:
    """A short name for the table: relative to the folder that was checked, else to the cwd."""
    if not file:
        return ""
    for base in bases:
        try:
            return str(Path(file).resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    try:
        rel = os.path.relpath(file)
    except ValueError:
        return file
    return rel if not rel.startswith("../..") else file


def _render(report, bases: list[Path]) -> None:
    if report.problems:
        _table(report.problems, bases)
    # Info lines and the summary go through click's styling: a clean project never imports rich.
    for p in report.info:
        where = _shown(p.file, bases) + (f":{p.line}" if p.line else "")
        typer.secho(f"info  {where}  {p.message}", dim=True)
    errors, warnings = report.count("error"), report.count("warning")
    files = len(report.files)
    typer.echo(f"{files} stage file{'s' if files != 1 else ''} checked: ", nl=False)
    typer.secho(f"{errors} error{'s' if errors != 1 else ''}", fg="red" if errors else "green", bold=bool(errors),
                nl=False)
    typer.echo(", ", nl=False)
    typer.secho(f"{warnings} warning{'s' if warnings != 1 else ''}", fg="yellow" if warnings else "green", nl=False)
    typer.echo(" - " + ("not ready to run" if errors else "ok"))


def _table(problems, bases: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=False, header_style="bold", expand=False)
    table.add_column("", no_wrap=True)
    table.add_column("where", overflow="fold", max_width=48)
    table.add_column("problem", overflow="fold", ratio=1)
    for p in sorted(problems, key=lambda p: (p.severity != "error", p.file or "", p.line or 0)):
        msg = Text()
        if p.key and not p.message.startswith(p.key):
            msg.append(p.key, style="bold")
            msg.append("\n")
        msg.append(p.message)
        if p.hint:
            msg.append("\nhint: " + p.hint, style="dim")
        where = _shown(p.file, bases) + (f":{p.line}" if p.line else "")
        table.add_row(Text(p.severity, style=_STYLE[p.severity]), where, msg)
    Console(soft_wrap=False).print(table)


def register(app: typer.Typer) -> None:
    app.command("validate", epilog=EPILOG, no_args_is_help=True)(validate)
