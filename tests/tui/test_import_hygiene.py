"""textual is imported only under longspec_cli/tui/ and only when a Textual app runs."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

PURE_TUI = ("longspec_cli.tui", "longspec_cli.tui.alerts", "longspec_cli.tui.follow", "longspec_cli.tui.series",
            "longspec_cli.tui.views",
            "longspec_cli.tui.sysinfo", "longspec_cli.tui.wizard_checks")


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in ("textual", "textual_plotext", "plotext", "torch"))


def test_cli_core_and_pure_tui_modules_never_import_textual():
    import longspec.project
    import longspec.runs

    core = [f"{pkg.__name__}.{m.name}" for pkg in (longspec.project, longspec.runs) for m in pkgutil.iter_modules(pkg.__path__)]
    assert "longspec.runs.status" in core and len(core) > 5
    code = "\n".join(f"import {m}" for m in ["longspec_cli.app", *core, *PURE_TUI, "longspec_cli.commands.monitor"])
    assert _heavy(_modules_after(code)) == []


def test_monitor_once_runs_without_textual(tmp_path):
    from tests.tui import fixtures as F

    root = F.pipeline(tmp_path / "demo", done=("base",))
    code = (f"from longspec_cli.commands.monitor import summary\n"
            f"assert summary({str(root)!r})['stages'][0]['state'] == 'done'")
    assert _heavy(_modules_after(code)) == []


def test_the_apps_do_import_textual():
    mods = _modules_after("import longspec_cli.tui.monitor_app, longspec_cli.tui.wizard_app")
    assert "textual" in mods and "textual_plotext" in mods  # the probe itself can see an import


def test_textual_only_in_the_tui_package():
    offenders = []
    for path in (ROOT / "longspec_cli").rglob("*.py"):
        rel = path.relative_to(ROOT / "longspec_cli")
        if rel.parts[0] == "tui":
            continue
        text = path.read_text()
        if "import textual" in text or "from textual" in text:
            offenders.append(str(rel))
    assert offenders == []
