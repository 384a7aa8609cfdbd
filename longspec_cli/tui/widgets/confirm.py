"""A yes/no dialog: y/Enter confirms, n/Esc cancels. Dismisses with True or False."""

from __future__ import annotations

from rich.console import RenderableType
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, title: str, body: RenderableType, yes: str = "Yes", no: str = "Cancel"):
        super().__init__()
        self.title_text, self.body, self._yes, self._no = title, body, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, id="dialog-title")
            with VerticalScroll(id="dialog-body"):
                yield Static(self.body)
            with Horizontal(id="dialog-buttons"):
                yield Button(f"{self._yes} (y)", variant="primary", id="yes")
                yield Button(f"{self._no} (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed, "#yes")
    def _yes_pressed(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no_pressed(self) -> None:
        self.dismiss(False)

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)
