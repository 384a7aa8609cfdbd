"""The `longspec` command: one small module per verb under longspec_cli/commands/.

Importing this module must stay cheap (no torch, deepspeed, transformers or textual): the
verbs import what they need when they run. A verb's module is imported, and its options built,
only when that verb is named (`longspec status` builds one verb, not twelve); `longspec --help`
lists the verbs from their names and help texts alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Optional

import click
import typer
from typer.core import TyperGroup

from longspec_cli import __version__

# Verb -> its module under longspec_cli/commands/ (which defines register(app)), in the order
# `--help` lists them.
VERBS = {
    "init": "init",
    "validate": "validate",
    "config": "config",
    "status": "status",
    "next-stage": "next_stage",
    "prepare": "prepare",
    "regenerate": "regenerate",
    "run": "run",
    "stop": "stop",
    "demo": "demo",
    "monitor": "monitor",
    "eval": "eval",
    "export": "export",
    "serve": "serve",
    "doctor": "doctor",
}
MARKUP = "rich"
PRETTY_EXCEPTIONS_SHORT = True


class _Verbs(Mapping):
    """Verb name -> click command, each built on first use from its module's registration.

    While the group renders its own help (`listing`), a verb is a bare click.Command carrying
    what the verb list shows (name, help, short help, panel, hidden, deprecated), so the list
    does not pay for twelve verbs' options.
    """

    def __init__(self) -> None:
        self.listing = False
        self._infos: dict[str, typer.models.CommandInfo] = {}
        self._built: dict[str, click.Command] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(VERBS)

    def __len__(self) -> int:
        return len(VERBS)

    def _info(self, name: str) -> typer.models.CommandInfo:
        if name not in self._infos:
            scratch = typer.Typer(add_completion=False)
            importlib.import_module(f"longspec_cli.commands.{VERBS[name]}").register(scratch)
            (info,) = scratch.registered_commands
            if info.cls is typer.core.TyperCommand:  # typer's default: help through _import_help_renderer
                info.cls = VerbCommand
            self._infos[name] = info
        return self._infos[name]

    def __getitem__(self, name: str) -> click.Command:
        info = self._info(name)  # KeyError for a name that is not a verb
        if name in self._built:
            return self._built[name]
        if self.listing:
            return _listed(name, info)
        self._built[name] = typer.main.get_command_from_info(
            info, pretty_exceptions_short=PRETTY_EXCEPTIONS_SHORT, rich_markup_mode=MARKUP)
        return self._built[name]


def _listed(name: str, info: typer.models.CommandInfo) -> click.Command:
    """What the verb list needs of a verb, derived as typer.main.get_command_from_info does."""
    import inspect

    help_text = inspect.getdoc(info.callback) if info.help is None else inspect.cleandoc(info.help)
    command = click.Command(name, help=help_text, short_help=info.short_help, hidden=info.hidden,
                            deprecated=info.deprecated)
    command.rich_help_panel = info.rich_help_panel
    return command


class _Deferred(type):
    """A stand-in class for `module.name`: calling it, or reading an attribute, imports the real one."""

    def _real(cls):
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def __call__(cls, *args, **kwargs):
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(cls._real(), attr)


# What typer.rich_utils imports but help in "rich" markup mode never uses: Markdown (markdown_it)
# is for "markdown" mode, Traceback (pygments) draws a crash. Together ~45 ms of every `--help`.
_UNUSED_BY_HELP = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}


def _import_help_renderer() -> None:
    """Import typer.rich_utils with stand-ins for what help does not use; the real modules stay
    importable (nothing is left in sys.modules) and the stand-ins load them on first use."""
    import sys
    import types

    if "typer.rich_utils" in sys.modules or any(m in sys.modules for m in _UNUSED_BY_HELP):
        return
    for module, name in _UNUSED_BY_HELP.items():
        stub = types.ModuleType(module)
        setattr(stub, name, _Deferred(name, (), {"_module": module}))
        sys.modules[module] = stub
    try:
        importlib.import_module("typer.rich_utils")
    finally:
        for module in _UNUSED_BY_HELP:
            sys.modules.pop(module, None)


class VerbCommand(typer.core.TyperCommand):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _import_help_renderer()
        super().format_help(ctx, formatter)


class VerbGroup(TyperGroup):
    """The root group: its verbs come from `_Verbs`, not from commands registered up front."""

    def __init__(self, *, commands=None, **attrs) -> None:
        # click already says "Did you mean ...?" for an unknown verb; typer's own would repeat it.
        super().__init__(commands=_Verbs(), **{**attrs, "suggest_commands": False})

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _import_help_renderer()
        self.commands.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.commands.listing = False


app = typer.Typer(
    name="longspec",
    cls=VerbGroup,
    help="Train long-context GLIDE speculative-decoding drafts (LongSpec) in three chained stages.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    pretty_exceptions_short=PRETTY_EXCEPTIONS_SHORT,
    rich_markup_mode=MARKUP,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=(
        "Quick start: [bold]longspec init my-proj --preset tiny --no-input[/] then "
        "[bold]longspec validate my-proj[/] and [bold]longspec run my-proj --all[/]. "
        "Exit codes: 0 ok, 1 problems/refused, 2 usage, 3 unreadable input, 4 run failed, 5 preempted "
        "(checkpoint saved), 130 interrupted."
    ),
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
