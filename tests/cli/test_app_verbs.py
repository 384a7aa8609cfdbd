"""The root command builds a verb only when it is named, and says exactly what typer would say
with every verb registered up front: the eager build (the pre-lazy way, typer's own conversion)
is the judge for the verb list, each verb's help and the unknown-verb error."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from longspec_cli import app as app_module

ARGVS = [["--help"], [], *([verb, "--help"] for verb in app_module.VERBS), ["valdate"], ["--version"]]


def eager_app() -> typer.Typer:
    """The same root, with every verb registered before the first call."""
    root = typer.Typer(name="longspec", help=app_module.app.info.help, no_args_is_help=True,
                       pretty_exceptions_show_locals=False, rich_markup_mode=app_module.MARKUP,
                       context_settings={"help_option_names": ["-h", "--help"]},
                       epilog=app_module.app.info.epilog, suggest_commands=False)
    root.callback()(app_module._root)
    for module in app_module.VERBS.values():
        importlib.import_module(f"longspec_cli.commands.{module}").register(root)
    return root


@pytest.mark.parametrize("argv", ARGVS, ids=lambda a: " ".join(a) or "(none)")
def test_same_as_eager(argv):
    runner = CliRunner()
    lazy = runner.invoke(app_module.app, argv, prog_name="longspec", terminal_width=100)
    eager = runner.invoke(eager_app(), argv, prog_name="longspec", terminal_width=100)
    assert (lazy.exit_code, lazy.output) == (eager.exit_code, eager.output)
    assert lazy.output.strip()


def test_unknown_verb_suggests_once():
    out = CliRunner().invoke(app_module.app, ["valdate"], prog_name="longspec").output
    assert out.count("Did you mean 'validate'?") == 1, out


PROBE = r"""
import json, sys
from longspec_cli.app import main
sys.argv = ["longspec", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("longspec_cli.commands.", "markdown_it",
      "pygments", "rich.markdown", "rich.traceback")))), file=sys.stderr)
"""


def probe(*argv: str, real_renderer: bool = False) -> subprocess.CompletedProcess:
    code = ("import typer.rich_utils\n" if real_renderer else "") + PROBE
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "100", "TERM": "dumb"})


def loaded(*argv: str) -> list[str]:
    return json.loads(probe(*argv).stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"]])
def test_help_renderer_stand_ins_change_nothing(argv):
    """Help drawn with the stand-ins for rich.markdown/rich.traceback is byte for byte the help
    drawn by typer's renderer imported whole."""
    light, whole = probe(*argv), probe(*argv, real_renderer=True)
    assert light.stdout == whole.stdout and "Usage" in light.stdout


def test_help_loads_no_markdown_or_pygments():
    mods = loaded("--help")
    assert not [m for m in mods if not m.startswith("longspec_cli.commands.")], mods


def test_a_verb_imports_its_own_module_only(tmp_path):
    assert loaded("status", str(tmp_path / "nowhere")) == ["longspec_cli.commands.status"]
    assert loaded("validate", "--help") == ["longspec_cli.commands.validate"]
