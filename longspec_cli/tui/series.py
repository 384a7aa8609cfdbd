"""Loss and learning-rate series of one stage, with a bounded view for charts (pure).

Every step record is kept in flat arrays (24 bytes a record: 200,000 records are under 5 MB),
and a decimated view is updated as records arrive: at most `2 * max_points` buckets, each the
mean of 2**k consecutive records; when the view fills up, neighbouring buckets merge. A chart
therefore never plots more than a few hundred points, whatever the length of the run, and
adding a record costs O(1) amortised.

A step that is not larger than the last one means the trainer resumed from an earlier
checkpoint: the records from that step on are dropped (they were rolled back).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Iterable

NAN = float("nan")


@dataclass(frozen=True)
class ChartData:
    steps: tuple[float, ...]
    loss: tuple[float | None, ...]  # None: no finite value in that bucket
    lr: tuple[float | None, ...]


def finite_or_nan(v: Any) -> float:
    if type(v) is float:
        return v if v - v == 0.0 else NAN  # inf - inf and nan - nan are nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return NAN
    v = float(v)
    return v if math.isfinite(v) else NAN


class Series:
    def __init__(self, max_points: int = 300):
        self.max_points = max_points
        self.steps = array("d")
        self.loss = array("d")
        self.lr = array("d")
        self.version = 0
        self._reset_view()

    def __len__(self) -> int:
        return len(self.steps)

    def _reset_view(self) -> None:
        self._per_bucket = 1
        # one bucket: [count, sum_step, sum_loss, n_loss, sum_lr, n_lr]
        self._buckets: list[list[float]] = []
        self.version += 1

    def add(self, step: float, loss: Any, lr: Any) -> None:
        self.add_many(((step, finite_or_nan(loss), finite_or_nan(lr)),))

    def add_many(self, rows: Iterable[tuple[float, float, float]]) -> None:
        """Append (step, loss, lr) rows; loss/lr already finite or NaN (finite_or_nan)."""
        steps, loss, lr = self.steps, self.loss, self.lr
        limit = 2 * self.max_points
        buckets, per = self._buckets, self._per_bucket
        last = steps[-1] if steps else -math.inf
        b = buckets[-1] if buckets else None
        for s, l, r in rows:
            if s <= last:
                self._rollback(s)
                buckets, per = self._buckets, self._per_bucket
                b = buckets[-1] if buckets else None
            last = s
            steps.append(s)
            loss.append(l)
            lr.append(r)
            if b is None or b[0] >= per:
                b = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
                buckets.append(b)
                if len(buckets) > limit:
                    self._merge_pairs()
                    buckets, per = self._buckets, self._per_bucket
                    b = buckets[-1]
            b[0] += 1
            b[1] += s
            if l == l:
                b[2] += l
                b[3] += 1
            if r == r:
                b[4] += r
                b[5] += 1
        self.version += 1

    def extend(self, other: "Series") -> None:
        self.add_many(zip(other.steps, other.loss, other.lr))

    def _rollback(self, step: float) -> None:
        keep = bisect_left(self.steps, step)
        rows = list(zip(self.steps[:keep], self.loss[:keep], self.lr[:keep]))
        del self.steps[:], self.loss[:], self.lr[:]
        self._reset_view()
        self.add_many(rows)

    def _merge_pairs(self) -> None:
        old = self._buckets
        self._buckets = [[a + b for a, b in zip(*old[i:i + 2])] if i + 1 < len(old) else old[i]
                         for i in range(0, len(old), 2)]
        self._per_bucket *= 2

    def chart(self) -> ChartData:
        steps, loss, lr = [], [], []
        for n, ss, sl, nl, sr, nr in self._buckets:
            steps.append(ss / n)
            loss.append(sl / nl if nl else None)
            lr.append(sr / nr if nr else None)
        return ChartData(tuple(steps), tuple(loss), tuple(lr))
