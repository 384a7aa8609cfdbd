"""The `longspec` command: one small module per verb under longspec_cli/commands/.

Importing this module must stay cheap (no torch, deepspeed, transformers or textual): the
verbs import what they need when they run.
"""

from __future__ import annotations

import importlib
from typing import Optional

import typer

from longspec_cli import __version__

app = typer.Typer(
    name="longspec",
    help="Train long-context GLIDE speculative-decoding drafts (LongSpec) in three chained stages.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=(
        "Quick start: [bold]longspec init my-proj --preset tiny --no-input[/] then "
        "[bold]longspec validate my-proj[/] and [bold]longspec run my-proj --all[/]. "
        "Exit codes: 0 ok, 1 problems/refused, 2 usage, 3 unreadable input, 4 run failed, 5 preempted "
        "(checkpoint saved), 130 interrupted."
    ),
)

# Verb modules, in the order `--help` lists them. Each defines register(app).
COMMANDS = (
    "init",
    "validate",
    "config",
    "status",
    "next_stage",
    "prepare",
    "run",
    "stop",
    "demo",
    "monitor",
    "eval",
    "export",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"longspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train long-context GLIDE speculative-decoding drafts (LongSpec) in three chained stages."""


for _name in COMMANDS:
    try:
        _mod = importlib.import_module(f"longspec_cli.commands.{_name}")
    except ModuleNotFoundError as _e:  # a verb still being written in this checkout
        if _e.name != f"longspec_cli.commands.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
