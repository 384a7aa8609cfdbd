"""What the monitor renders: immutable snapshots built by follow.py (pure: no textual)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from longspec_cli.tui.alerts import Alert
from longspec_cli.tui.series import ChartData


@dataclass(frozen=True)
class StageView:
    name: str
    state: str  # pending | running | done | failed | stale, or "checking" before the first status
    output_dir: str
    draft_from: str | None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    llm_loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    sha256: str | None = None  # this stage's final draft
    draft_sha256: str | None = None  # the draft it started from (stage_complete.json)
    next_action: str = ""
    reasons: tuple[str, ...] = ()
    tau: float | None = None  # chain tau from a current eval.json (longspec eval)
    tree_tau: float | None = None  # the token tree's tau on the same prompts
    # eval.json by_length: (length, label, chain tau, input draft's tau or None) per bucket with prompts
    tau_by_length: tuple[tuple[int, str, float, float | None], ...] = ()
    chart: ChartData = ChartData((), (), ())
    chart_version: int = 0
    simtau: tuple = ()  # simtau_series.SimTauPoint: simulated tau and per-position rates while training
    simtau_version: int = 0
    log: tuple[str, ...] = ()
    log_seq: int = 0  # see StageFollow.log_seq
    log_gen: int = 0
    alerts: tuple[Alert, ...] = ()
    notices: tuple[str, ...] = ()
    notice_count: int = 0
    skipped_lines: int = 0
    history_loaded: bool = True
    has_data: bool = False


@dataclass(frozen=True)
class ProjectView:
    name: str
    root: str
    stages: tuple[StageView, ...]
    current: int  # the stage being trained (or last trained)
    notice: str | None = None
    alerts: tuple[Alert, ...] = ()


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
