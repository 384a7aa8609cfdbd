"""`longspec config DIR|FILE [STAGE] [key=value ...]`: the config the trainer will see, and where each key came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import RefusedError, UsageError

EPILOG = """Examples:

  longspec config my-proj long

  longspec config my-proj long max_steps=40 --json

  longspec config my-proj/conf/exp/base.yaml

Hydra composes the stage exactly as `python -m longspec.train --config-dir DIR/conf +exp=STAGE` with the
overrides does (the trainer's defaults in longspec/conf/config.yaml included; for a stage of a project,
`output_dir` is the manifest's, as `longspec run` passes it) and resolves every ${...}: what `--cfg job --resolve` prints.
Each key shows where it was set: file:line, trainer default, or override.
--json prints {"config": {...}, "origins": {"dotted.key": "file:line" | "trainer default (...)" | "override"},
"problems": [...]}.

Exit codes: 0 composed, 1 the stage does not compose or resolve (the problems say where), 2 usage, 3 unreadable manifest."""


def config(
    path: Path = typer.Argument(..., help="Project folder (or its longspec.yaml), or a stage YAML.", show_default=False),
    args: Optional[List[str]] = typer.Argument(None, help="[STAGE] then Hydra overrides key=value.",
                                               show_default=False, metavar="[STAGE] [KEY=VALUE]..."),
    as_json: bool = typer.Option(False, "--json", help='Print {"config", "origins", "problems"}.'),
) -> None:
    """Print the composed, resolved config of a stage, with where each key was set."""

    def body() -> None:
        from longspec_cli.commands.run import split_args
        from longspec.project import hydracompose as H

        stage, overrides = split_args(list(args or []))
        stage_file, out_dir = _stage_file(path, stage)
        if stage is not None and not (path.is_dir() or path.name == "longspec.yaml"):  # a stage file
            raise UsageError(f"{stage!r} is not key=value", hint="with a stage file, give only overrides")
        c = H.compose_stage(stage_file, H.stage_overrides(out_dir, overrides))
        errors = [p for p in c.problems if p.severity == "error"]  # composing and resolving, as the trainer
        if as_json:
            import json

            typer.echo(json.dumps({"config": c.data if c.ok else None, "origins": H.leaf_origins(c) if c.ok else {},
                                   "problems": [p.to_json() for p in errors]}, indent=2, default=str))
        elif c.ok:
            typer.echo(render(c.data, H.leaf_origins(c)), nl=False)
        if errors:
            first = errors[0]
            more = f" (+{len(errors) - 1} more: `longspec validate` lists them)" if len(errors) > 1 else ""
            raise RefusedError(f"{first.where()}: {first.message}{more}", hint=first.hint)

    run_cli(body)


def _stage_file(path: Path, stage: Optional[str]) -> tuple[Path, Optional[Path]]:
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder", hint="give a project folder or a stage YAML")
    from longspec.project.manifest import load_manifest

    if path.is_file() and path.name != "longspec.yaml":
        return path, _listed_output_dir(path)

    m = load_manifest(path if path.is_dir() else path.parent)
    spec = m.stage(stage) if stage is not None else m.stages[0]
    if not spec.config.is_file():
        raise UsageError(f"stage {spec.name}: config {spec.config} does not exist", hint="fix `config` in longspec.yaml")
    return spec.config, spec.output_dir


def _listed_output_dir(stage_file: Path) -> Optional[Path]:
    """The manifest's output_dir when the stage file belongs to a project (as `run` would pass it)."""
    from longspec.project.manifest import load_manifest
    from longspec.project.validate import _project_of
    from longspec.errors import LongspecError

    root = _project_of(stage_file)
    if root is None:
        return None
    try:
        m = load_manifest(root)
    except LongspecError:
        return None
    return next((s.output_dir for s in m.stages if s.config.resolve() == stage_file.resolve()), None)


def render(data: dict[str, Any], origins: dict[str, str], indent: int = 0, prefix: str = "") -> str:
    """YAML of the resolved config, each leaf followed by `# where it was set`."""
    import json

    out = []
    pad = "  " * indent
    for k, v in data.items():
        dotted = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.append(f"{pad}{k}:\n" + render(v, origins, indent + 1, dotted))
            continue
        text = "null" if v is None else "true" if v is True else "false" if v is False else (
            json.dumps(v) if isinstance(v, (list, dict, str)) else repr(v))
        out.append(f"{pad}{k}: {text}  # {origins.get(dotted, '')}\n")
    return "".join(out)


def register(app: typer.Typer) -> None:
    app.command("config", epilog=EPILOG, no_args_is_help=True)(config)
