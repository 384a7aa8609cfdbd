"""Loss or learning rate against step, every stage on one axis, stage boundaries marked."""

from __future__ import annotations

from textual_plotext import PlotextPlot

from longspec_cli.tui.views import StageView

COLORS = ("cyan", "orange", "magenta", "green", "yellow")


def layout(stages: tuple[StageView, ...]) -> list[tuple[StageView, float]]:
    """(stage, x offset) for stages with chart points: each stage starts where the previous ended."""
    out, offset = [], 0.0
    for st in stages:
        if not st.chart.steps:
            continue
        out.append((st, offset))
        offset += max(st.chart.steps[-1], float(st.total_steps or 0))
    return out


class MetricChart(PlotextPlot):
    def __init__(self, metric: str, title: str, **kw):
        super().__init__(**kw)
        self.metric = metric
        self.title = title
        self._key: tuple | None = None

    def show(self, stages: tuple[StageView, ...]) -> None:
        key = tuple((s.name, s.chart_version, s.total_steps) for s in stages)
        if key == self._key:
            return  # nothing new: no re-plot, no repaint
        self._key = key
        plt = self.plt
        plt.clear_figure()
        plt.title(self.title)
        placed = layout(stages)
        if not placed:
            plt.title(f"{self.title}: no records yet")
        for n, (st, off) in enumerate(placed):
            ys = getattr(st.chart, self.metric)
            pts = [(x + off, y) for x, y in zip(st.chart.steps, ys) if y is not None]
            if pts:
                plt.plot([p[0] for p in pts], [p[1] for p in pts], color=COLORS[n % len(COLORS)],
                         marker="braille", label=st.name)
            if n:
                plt.vline(off, "gray")
        plt.xlabel("step (stages back to back)")
        self.refresh()
