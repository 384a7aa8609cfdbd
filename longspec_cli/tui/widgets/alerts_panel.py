"""Active alerts (errors first), or a quiet line when there are none."""

from __future__ import annotations

from rich.text import Text

from longspec_cli.tui.alerts import ERROR, Alert
from longspec_cli.tui.widgets.text_panel import TextPanel


class AlertsPanel(TextPanel):
    def show(self, alerts: tuple[Alert, ...], notice: str | None, notes: tuple[str, ...] = ()) -> None:
        self.set_class(any(a.level == ERROR for a in alerts), "-error")
        self.set_text(render_alerts(alerts, notice, notes))


def render_alerts(alerts: tuple[Alert, ...], notice: str | None, notes: tuple[str, ...] = ()) -> Text:
    """`notice`: the project-wide line (no runs yet); `notes`: file events (truncated, deleted)."""
    t = Text()
    if notice:
        t.append(notice + "\n", "italic")
    for note in notes:
        t.append("• " + note + "\n", "dim yellow")
    if not alerts:
        t.append("no alerts", "dim green")
        return t
    for a in sorted(alerts, key=lambda a: a.level != ERROR):
        style = "bold red" if a.level == ERROR else "yellow"
        t.append("✖ " if a.level == ERROR else "▲ ", style)
        t.append(a.message + "\n", style if a.level == ERROR else "")
    return t
