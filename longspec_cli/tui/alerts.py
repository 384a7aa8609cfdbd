"""Alert rules over metrics records and train.log lines (pure: no textual, no I/O).

Rules:
  nonfinite_loss   a step record whose loss or llm_loss is NaN, +-inf, null or not a number
  run_error        an {"event": "error"} record in metrics.jsonl
  scale_collapse   DeepSpeed's fp16 loss scale hit its minimum ("Current loss scale already at
                   minimum", or an overflow that reduced the scale to <= MIN_SCALE)
  overflow_storm   at least STORM_COUNT of the last STORM_WINDOW log lines are overflow messages
                   ("Grad overflow ... reducing loss scale", "OVERFLOW! ... Skipping step")
  stalled          no new step record for STALL_FACTOR x the median interval between records
                   (and at least STALL_FLOOR_S, so a checkpoint save on a toy run is not a stall)
  process_gone     run.json names a process on this host that is gone, and there is no
                   stage_complete.json
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

ERROR = "error"
WARNING = "warning"

STORM_WINDOW = 50
STORM_COUNT = 8
MIN_SCALE = 1.0
STALL_FACTOR = 5.0
STALL_FLOOR_S = 10.0
STALL_MIN_INTERVALS = 3


@dataclass(frozen=True)
class Alert:
    level: str  # ERROR | WARNING
    kind: str
    stage: str
    message: str


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_record(record: Mapping[str, Any], stage: str) -> Alert | None:
    """The alert one metrics record raises by itself, if any."""
    if record.get("event") == "error":
        msg = str(record.get("message") or "the trainer reported an error")
        return Alert(ERROR, "run_error", stage, f"{stage}: trainer error at step {record.get('step', '?')}: {msg}")
    if "event" in record or "step" not in record:
        return None
    bad = [k for k in ("loss", "llm_loss") if k in record and not _finite(record[k])]
    if not bad:
        return None
    what = ", ".join(f"{k}={record[k]!r}" for k in bad)
    return Alert(ERROR, "nonfinite_loss", stage,
                 f"{stage}: non-finite loss at step {record.get('step')} ({what}); lower the learning "
                 "rate or use bf16, then resume from the last good checkpoint")


# DeepSpeed's fp16 loss scaler, across versions:
#   "Grad overflow on iteration 12", "... reducing loss scale to 32768.0"
#   "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
#   "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
#   "No Grad overflow for 1000 iterations", "Increasing dynamic loss scale from 1024 to 2048"
_OVERFLOW = re.compile(r"overflow!|grad overflow|overflow.*(skipping|reducing)", re.IGNORECASE)
_NO_OVERFLOW = re.compile(r"no grad overflow", re.IGNORECASE)
_AT_MINIMUM = re.compile(r"loss scale already at minimum", re.IGNORECASE)
_REDUCED_TO = re.compile(r"reducing (?:loss scale )?to:?\s*([0-9][0-9.eE+-]*)", re.IGNORECASE)
_INCREASED_TO = re.compile(r"increasing dynamic loss scale from \S+ to ([0-9][0-9.eE+-]*)", re.IGNORECASE)


def _number(text: str) -> float | None:
    try:
        return float(text.rstrip("."))
    except ValueError:
        return None


class LogWatch:
    """Follows train.log lines and keeps the fp16 loss-scale state."""

    def __init__(self, window: int = STORM_WINDOW, count: int = STORM_COUNT, min_scale: float = MIN_SCALE):
        self.window, self.count, self.min_scale = window, count, min_scale
        self.reset()

    def reset(self) -> None:
        """Forget everything (the log was truncated, rotated or deleted)."""
        self._recent: deque[bool] = deque(maxlen=self.window)
        self.scale: float | None = None
        self.at_minimum = False
        self.overflows = 0

    def feed(self, lines: Iterable[str]) -> None:
        for line in lines:
            if not line.strip():
                continue
            is_overflow = bool(_OVERFLOW.search(line)) and not _NO_OVERFLOW.search(line)
            self._recent.append(is_overflow)
            if is_overflow:
                self.overflows += 1
            if _AT_MINIMUM.search(line):
                self.at_minimum = True
            if m := _REDUCED_TO.search(line):
                self.scale = _number(m.group(1))
            elif m := _INCREASED_TO.search(line):
                self.scale = _number(m.group(1))
                self.at_minimum = False

    @property
    def recent_overflows(self) -> int:
        return sum(self._recent)

    def alerts(self, stage: str) -> list[Alert]:
        out = []
        if self.at_minimum or (self.scale is not None and self.scale <= self.min_scale):
            out.append(Alert(ERROR, "scale_collapse", stage,
                             f"{stage}: fp16 loss scale collapsed (now {self.scale if self.scale is not None else 'at minimum'});"
                             " the run is diverging: use bf16 or a lower learning rate"))
        n = self.recent_overflows
        if n >= self.count:
            out.append(Alert(WARNING, "overflow_storm", stage,
                             f"{stage}: overflow storm: {n} of the last {len(self._recent)} log lines are "
                             "fp16 gradient overflows (steps skipped)"))
        return out


class StepClock:
    """Intervals between step records, to tell a slow run from a stalled one."""

    def __init__(self, keep: int = 64):
        self._times: deque[float] = deque(maxlen=keep + 1)

    def add(self, t: float) -> None:
        if self._times and t < self._times[-1]:  # clock went back (resume on another node): restart
            self._times.clear()
        self._times.append(t)

    def median_interval(self) -> float | None:
        ts = list(self._times)
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        if len(gaps) < STALL_MIN_INTERVALS:
            return None
        return statistics.median(gaps)


def stall_alert(median_interval: float | None, idle_s: float, stage: str,
                factor: float = STALL_FACTOR, floor_s: float = STALL_FLOOR_S) -> Alert | None:
    """`idle_s`: seconds since the last new step record was seen."""
    if median_interval is None:
        return None
    limit = max(factor * median_interval, floor_s)
    if idle_s <= limit:
        return None
    return Alert(WARNING, "stalled", stage,
                 f"{stage}: no new metrics for over {_coarse(idle_s)} (the median between records is "
                 f"{median_interval:.1f}s); check train.log and the nodes")


_MARKS = (10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


def _coarse(seconds: float) -> str:
    """A duration rounded down to a few marks, so an alert's text changes rarely, not every second."""
    mark = max([m for m in _MARKS if m <= seconds], default=0)
    if seconds >= 7200:
        return f"{int(seconds // 3600)} h"
    if mark >= 3600:
        return "1 h"
    return f"{mark // 60} min" if mark >= 60 else f"{mark} s"


def process_gone(stage: str, run_info: Mapping[str, Any] | None, alive: bool | None,
                 complete: bool) -> Alert | None:
    """`alive`: None when the process runs on another host and cannot be checked from here."""
    if run_info is None or complete or alive is not False:
        return None
    what = (f"SLURM job {run_info.get('job_id')}" if run_info.get("kind") == "slurm"
            else f"training process {run_info.get('pid', '?')}")
    return Alert(ERROR, "process_gone", stage,
                 f"{stage}: {what} is gone and wrote no stage_complete.json; "
                 "read train.log, then `longspec run` resumes from the last checkpoint")
