"""The viewed stage: progress bar and the latest numbers."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, ProgressBar, Static

from longspec_cli.tui.views import StageView, fmt_duration
from longspec_cli.tui.widgets.stage_strip import MARK


def _f(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return format(value, spec)


class StagePanel(Vertical):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.title_label = Label(id="stage-title")
        self.bar = ProgressBar(total=1, show_eta=False, id="stage-progress")
        self.stats = Static(id="stage-stats")
        self._key: tuple | None = None

    def compose(self) -> ComposeResult:
        yield self.title_label
        yield self.bar
        yield self.stats

    def show(self, st: StageView, position: str) -> None:
        mark, style = MARK.get(st.state, ("?", ""))
        title = Text.assemble((f"{mark} ", style), (st.name, "bold"), (f"  {st.state}", style),
                              (f"  {st.output_dir}", "dim"), (f"  {position}", "dim"))
        total = st.total_steps or 0
        if total > 0:
            bar = (total, min(st.step or 0, total))
        else:  # unknown total: an empty bar, never the animated indeterminate one
            bar = (1, 1 if st.state == "done" else 0)
        rows = _rows(st)
        key = (title.plain, style, bar, rows)
        if key == self._key:
            return  # nothing shown changed (an alert or the log did): no repaint
        self._key = key
        self.title_label.update(title)
        self.bar.update(total=bar[0], progress=bar[1])
        grid = Table.grid(padding=(0, 2))
        for _ in range(4):
            grid.add_column()
        for row in rows:
            grid.add_row(*row)
        self.stats.update(grid)


def _rows(st: StageView) -> tuple[tuple, ...]:
    step = "-" if st.step is None else f"{st.step:,}" + (f" / {st.total_steps:,}" if st.total_steps else "")
    tok = "-" if st.tokens_per_s is None else f"{st.tokens_per_s:,.0f}"
    rows = [
        ("step", step, "elapsed", fmt_duration(st.elapsed_s)),
        ("loss", _f(st.loss, ".4f"), "ETA", fmt_duration(st.eta_s) if st.state == "running" else "-"),
        ("llm_loss", _f(st.llm_loss, ".4f"), "tokens/s", tok),
        ("lr", _f(st.lr, ".3e"), "next", st.next_action or "-"),
    ]
    if st.tau is not None or st.tree_tau is not None:
        rows.append(("tau", _f(st.tau, ".2f"), "tree tau", _f(st.tree_tau, ".2f")))
    if st.state in ("failed", "stale") and st.reasons:
        rows.append(("why", Text(st.reasons[0], "red"), "", ""))
    for why in st.reasons:  # the prepared training data (follow._note_prepared)
        if why.startswith("data "):
            rows.append(("data", Text(why[5:], "dim" if why.startswith("data ready") else "yellow"), "", ""))
    if st.skipped_lines:
        rows.append(("note", Text(f"{st.skipped_lines} malformed metrics line(s) skipped", "yellow"), "", ""))
    return tuple(rows)
