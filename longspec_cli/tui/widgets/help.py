"""The monitor's keys."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEYS = (
    ("q", "quit (training goes on)"),
    ("n", "next-stage: point the next stage at this stage's final draft (shows the diff first)"),
    ("r", "run the next stage that needs a run (`longspec run DIR STAGE`)"),
    ("s", "stop the running stage (`longspec stop DIR`, asks first)"),
    ("← →", "view the previous / next stage"),
    ("?", "this help"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,enter", "close", "close")]

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for key, what in KEYS:
            table.add_row(key, what)
        with Vertical(id="dialog"):
            yield Label("longspec monitor: keys", id="dialog-title")
            yield Static(table)
            yield Label("Esc closes", classes="dim")

    def action_close(self) -> None:
        self.dismiss(None)
