"""tau against context length per evaluated stage (eval.json by_length), next to its input draft's."""

from __future__ import annotations

import math

from textual_plotext import PlotextPlot

from longspec_cli.tui.views import StageView
from longspec_cli.tui.widgets.charts import COLORS


class TauLengthChart(PlotextPlot):
    """One line per stage (its chain tau per length bucket, x on a log2 scale of prompt tokens) and
    a dotted one for its input draft on the same prompts; hidden until a stage has been evaluated."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._key: tuple | None = None

    def show(self, stages: tuple[StageView, ...]) -> None:
        key = tuple((s.name, s.tau_by_length) for s in stages)
        if key == self._key:
            return
        self._key = key
        plt = self.plt
        plt.clear_figure()
        measured = [s for s in stages if s.tau_by_length]
        self.display = bool(measured)            # shown once a stage has been evaluated
        plt.title("tau by context length")
        ticks: dict[float, str] = {}
        for n, st in enumerate(measured):
            color = COLORS[n % len(COLORS)]
            xs = [math.log2(length) for length, _, _, _ in st.tau_by_length]
            ticks.update({x: label for x, (_, label, _, _) in zip(xs, st.tau_by_length)})
            plt.plot(xs, [tau for _, _, tau, _ in st.tau_by_length], color=color, marker="braille", label=st.name)
            base = [(x, b) for x, (_, _, _, b) in zip(xs, st.tau_by_length) if b is not None]
            if base:
                plt.plot([x for x, _ in base], [b for _, b in base], color=color, marker="dot",
                         label=f"{st.draft_from or 'input'} draft")
        if ticks:
            plt.xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)])
        plt.xlabel("prompt tokens")
        self.refresh()
