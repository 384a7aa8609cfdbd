"""A widget showing one Rich Text that repaints only when the text changes.

Static.update() always asks for a new layout; a monitor that refreshes numbers every second
would then re-render its neighbours too. Here a change that keeps every line's length (digits
ticking) repaints this widget alone; only a change of shape asks for a layout.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget


class TextPanel(Widget):
    DEFAULT_CSS = """
    TextPanel {
        height: auto;
    }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self._text = Text()

    def render(self) -> Text:
        return self._text

    def set_text(self, text: Text) -> None:
        old = self._text
        if text.plain == old.plain and text.spans == old.spans and text.style == old.style:
            return
        same_shape = [len(x) for x in text.plain.split("\n")] == [len(x) for x in old.plain.split("\n")]
        self._text = text
        self.refresh(layout=not same_shape)
