"""Simulated-tau points of one stage (metrics.jsonl `simtau` records) and the alert that watches
them against the loss (pure: no textual).

Rule simtau_falling: the simulated tau fell at SIMTAU_FALLS evaluations in a row while the loss
still fell over the same steps (mean loss of the step records just before the first and the last
of those evaluations): the draft is fitting tokens the target would not emit.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from longspec_cli.tui.alerts import WARNING, Alert

SIMTAU_FALLS = 3
LOSS_WINDOW = 8  # step records averaged for "the loss at an evaluation"


@dataclass(frozen=True)
class SimTauPoint:
    step: int
    tau: float
    alpha: tuple[float, ...]


class SimTauSeries:
    def __init__(self) -> None:
        self.points: list[SimTauPoint] = []
        self.version = 0

    def add(self, rec: dict) -> None:
        """A record that runfolder.is_simtau_record accepted; a step not after the last one is a
        resume from an earlier checkpoint: the later points are dropped."""
        step = rec["step"]
        while self.points and self.points[-1].step >= step:
            self.points.pop()
        self.points.append(SimTauPoint(step, float(rec["tau"]), tuple(float(a) for a in rec["alpha"])))
        self.version += 1

    def extend_before(self, older: "SimTauSeries") -> None:
        """Put the points read from the history (before the opening tail) in front."""
        first = self.points[0].step if self.points else math.inf
        self.points = [p for p in older.points if p.step < first] + self.points
        self.version += 1


def loss_before(steps, losses, step: int, window: int = LOSS_WINDOW) -> float | None:
    """Mean finite loss of the last `window` step records at or before `step` (steps ascending)."""
    end = bisect_right(steps, step)
    vals = [v for v in losses[max(0, end - window):end] if v == v]
    return sum(vals) / len(vals) if vals else None


def falling_alert(points: list[SimTauPoint], steps, losses, stage: str, falls: int = SIMTAU_FALLS) -> Alert | None:
    if len(points) < falls + 1:
        return None
    tail = points[-(falls + 1):]
    if not all(b.tau < a.tau for a, b in zip(tail, tail[1:])):
        return None
    first, last = loss_before(steps, losses, tail[0].step), loss_before(steps, losses, tail[-1].step)
    if first is None or last is None or not last < first:
        return None
    return Alert(WARNING, "simtau_falling", stage,
                 f"{stage}: simulated tau fell {falls} evaluations in a row ({tail[0].tau:.2f} at step "
                 f"{tail[0].step} -> {tail[-1].tau:.2f} at step {tail[-1].step}) while the loss fell "
                 f"({first:.3f} -> {last:.3f}); best/ keeps the draft of step "
                 f"{max(points, key=lambda p: p.tau).step}")
