"""The init wizard's right side: live validation of the answers, and a preview of every file."""

from __future__ import annotations

from pathlib import Path

from rich.syntax import Syntax
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Select, Static

from longspec_cli.tui.wizard_checks import Plan

MANIFEST = "longspec.yaml"


def _rel(path: Path | str | None, root: Path) -> str:
    if path is None:
        return ""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


class PlanView(Vertical):
    def __init__(self, **kw):
        super().__init__(**kw)
        self._files: dict[str, str] = {}
        self.checks = Static(id="checks")
        self.picker = Select[str]([], prompt="file to preview", id="preview-file")
        self.preview = Static(id="preview")

    def compose(self) -> ComposeResult:
        yield Label("Checks", classes="side-title")
        yield self.checks
        yield Label("Files init will write (nothing is written before you confirm)", classes="side-title")
        yield self.picker
        with VerticalScroll(id="preview-box"):
            yield self.preview

    def show(self, plan: Plan, root: Path, notes: list[tuple[str, str]]) -> None:
        """`notes`: (severity, message) from the form's own checks (data files, existing files)."""
        self.checks.update(render_checks(plan, root, notes))
        files = {_rel(p, root): text for p, text in plan.files.items()}
        if list(files) != list(self._files):
            current = self.picker.value if self.picker.value in files else MANIFEST
            self.picker.set_options([(name, name) for name in files])
            if files:
                self.picker.value = current if current in files else next(iter(files))
        self._files = files
        self._show_file()

    @on(Select.Changed, "#preview-file")
    def _picked(self) -> None:
        self._show_file()

    def _show_file(self) -> None:
        name = self.picker.value
        text = self._files.get(name) if isinstance(name, str) else None
        self.preview.update(Syntax(text, "yaml", theme="ansi_dark") if text is not None else Text("(no files)", "dim"))


def render_checks(plan: Plan, root: Path, notes: list[tuple[str, str]]) -> Text:
    t = Text()
    if plan.error:
        t.append("✖ " + plan.error + "\n", "bold red")
    items = [(sev, msg) for sev, msg in notes]
    for p in plan.problems:
        where = _rel(p.file, root) + (f":{p.line}" if p.line else "")
        items.append((p.severity, f"{where} {p.message}" + (f"  (hint: {p.hint})" if p.hint else "")))
    errors = sum(sev == "error" for sev, _ in items) + bool(plan.error)
    warnings = sum(sev == "warning" for sev, _ in items)
    for sev, msg in sorted(items, key=lambda x: x[0] != "error"):
        t.append(("✖ " if sev == "error" else "▲ ") + msg + "\n", "red" if sev == "error" else "yellow")
    summary = f"{errors} error(s), {warnings} warning(s)" if items or plan.error else "no problems found"
    t.append(summary, "bold green" if not errors else "bold")
    return t
