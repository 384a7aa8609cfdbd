"""Simulated tau of the viewed stage against step (left axis), with the per-position acceptance
rates alpha_1..alpha_gamma (right axis): the figure `longspec eval` measures, estimated while the
stage trains (metrics.jsonl `simtau` records)."""

from __future__ import annotations

from textual_plotext import PlotextPlot

from longspec_cli.tui.views import StageView

RATE_COLORS = ("green", "yellow", "orange", "red", "magenta", "blue", "white", "gray")


class SimTauChart(PlotextPlot):
    def __init__(self, **kw):
        super().__init__(**kw)
        self._key: tuple | None = None
        self.plotted: list[str] = []  # the labels of the lines drawn last

    def show(self, stage: StageView) -> None:
        key = (stage.name, stage.simtau_version, len(stage.simtau))
        if key == self._key:
            return
        self._key = key
        plt = self.plt
        plt.clear_figure()
        points = stage.simtau
        self.plotted = []
        if not points:
            plt.title("simulated tau: none yet")
            self.refresh()
            return
        last = points[-1]
        best = max(points, key=lambda p: p.tau)
        plt.title(f"sim tau {last.tau:.2f}@{last.step} best {best.tau:.2f}@{best.step}")
        steps = [p.step for p in points]
        plt.plot(steps, [p.tau for p in points], color="cyan", marker="braille", label="tau")
        self.plotted.append("tau")
        for k in range(len(last.alpha)):
            rates = [p.alpha[k] if k < len(p.alpha) else None for p in points]
            pts = [(s, a) for s, a in zip(steps, rates) if a is not None]
            plt.plot([s for s, _ in pts], [a for _, a in pts], color=RATE_COLORS[k % len(RATE_COLORS)],
                     marker="dot", label=f"a{k + 1}", yside="right")
            self.plotted.append(f"a{k + 1}")
        plt.xlabel("step")
        self.refresh()
