"""Every stage with its state, and the chain between them with the draft's sha256 prefix."""

from __future__ import annotations

from rich.text import Text

from longspec_cli.tui.views import ProjectView, StageView
from longspec_cli.tui.widgets.text_panel import TextPanel

MARK = {
    "done": ("✔", "bold green"),
    "running": ("●", "bold yellow"),
    "queued": ("◷", "bold cyan"),
    "requeued": ("↻", "bold yellow"),
    "failed": ("✖", "bold red"),
    "stale": ("◌", "bold magenta"),
    "preempted": ("⏸", "bold yellow"),
    "pending": ("○", "dim"),
    "checking": ("…", "dim"),
}


class StageStrip(TextPanel):
    """base ✔ done ──3f2a9c1b──▶ long ● running 120/400 ──────▶ longcot ○ pending"""

    def show(self, view: ProjectView, selected: int) -> None:
        self.set_text(render_strip(view.stages, selected))


def render_strip(stages: tuple[StageView, ...], selected: int) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    by_name = {s.name: s for s in stages}
    for i, st in enumerate(stages):
        if i:
            text.append_text(_link(st, by_name, stages[i - 1]))
        mark, style = MARK.get(st.state, ("?", ""))
        box = Text()
        box.append(f" {mark} ", style)
        box.append(st.name, "bold")
        box.append(f" {st.state}", style)
        if st.state in ("running", "requeued", "failed") and st.step is not None:
            box.append(f" {st.step}/{st.total_steps or '?'}")
        if i == selected:
            box.stylize("reverse")
        box.append(" ")
        text.append_text(box)
    return text


def _link(st: StageView, by_name: dict[str, StageView], prev: StageView) -> Text:
    if not st.draft_from:
        return Text("  │  ", "dim")
    up = by_name.get(st.draft_from)
    sha = up.sha256 if up is not None else None
    label = sha[:8] if sha else "········"
    style = "green" if sha else "dim"
    if st.draft_sha256 and sha and st.draft_sha256 != sha:
        label, style = f"≠{st.draft_sha256[:8]}", "bold red"
    via = "" if up is prev else f"{st.draft_from}:"
    return Text.assemble((" ──", "dim"), (via + label, style), ("──▶", "dim"))
