"""The quality gate between stages: read a stage's eval.json, compare its tau with the previous stage's.

eval.json (written by `longspec eval`, docs/DESIGN.md run-folder contract):

    {"stage", "tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup", "gamma", "prompts",
     "max_new_tokens", "context_tokens", "lossless", "draft_sha256", "time",
     "method", "tree_shape", "temperature",                        # absent in older files: chain, greedy
     "methods": {"chain": {"tau", "speedup", ...}, "tree": {...}}} # every method measured on the prompts

The headline fields (tau, speed-up, lossless) are the first measured method's (the chain unless
only the tree was asked for). `lossless` is null for a sampled (temperature > 0) evaluation.

Rule: a stage fails the gate when its tau is more than `pct` percent below the previous
stage's tau, i.e. cur < prev * (1 - pct / 100). Equal or better always passes. Pure: no torch.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from longspec_cli.core import runfolder

EVAL_NAME = "eval.json"
REQUIRED = ("stage", "tau", "gamma", "lossless")


class EvalFileError(ValueError):
    """eval.json exists but cannot be used (malformed JSON, missing or wrongly typed fields)."""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_eval(output_dir: str | os.PathLike) -> dict | None:
    """The stage's eval.json as a dict, None when there is none; EvalFileError when it is unusable."""
    path = Path(output_dir) / EVAL_NAME
    obj, why = runfolder.read_json(path)
    if why:
        raise EvalFileError(why)
    if obj is None:
        return None
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise EvalFileError(f"{path}: missing {', '.join(missing)}")
    if not _number(obj["tau"]) or obj["tau"] < 0:
        raise EvalFileError(f"{path}: `tau` must be a number >= 0 (got {obj['tau']!r})")
    if obj["lossless"] is not None and not isinstance(obj["lossless"], bool):
        raise EvalFileError(f"{path}: `lossless` must be true, false or null (got {obj['lossless']!r})")
    return obj


def method_taus(ev: dict) -> dict[str, float]:
    """{"chain": tau, "tree": tau} of an eval.json (an older file without `methods`: its chain tau)."""
    methods = ev.get("methods")
    if not isinstance(methods, dict):
        return {str(ev.get("method") or "chain"): float(ev["tau"])}
    return {str(name): float(m["tau"]) for name, m in methods.items()
            if isinstance(m, dict) and _number(m.get("tau"))}


def method_figures(ev: dict, name: str) -> dict | None:
    """One method's figures (tau, speedup, ...) from an eval.json, old files included (chain)."""
    methods = ev.get("methods")
    if isinstance(methods, dict):
        m = methods.get(name)
        return m if isinstance(m, dict) and _number(m.get("tau")) else None
    if name == str(ev.get("method") or "chain"):
        return {"tau": ev["tau"], "speedup": ev.get("speedup"), "gamma": ev.get("gamma")}
    return None


def eval_is_current(ev: dict, draft_sha256: str | None) -> bool:
    """True when eval.json was measured on the draft whose sha256 is given (the stage's final draft)."""
    return draft_sha256 is not None and ev.get("draft_sha256") == draft_sha256


def gate_check(prev_tau: float | None, cur_tau: float, pct: float) -> tuple[bool, str]:
    """(ok, message). Fails when cur_tau < prev_tau * (1 - pct/100). No previous stage -> ok."""
    if not _number(pct) or pct < 0 or pct > 100:
        raise ValueError(f"gate percentage must be a number in 0..100 (got {pct!r})")
    if not _number(cur_tau) or cur_tau < 0:
        raise ValueError(f"tau must be a number >= 0 (got {cur_tau!r})")
    if prev_tau is None:
        return True, f"tau {cur_tau:.3f} (no previous stage to compare with)"
    if not _number(prev_tau) or prev_tau < 0:
        raise ValueError(f"previous tau must be a number >= 0 (got {prev_tau!r})")
    floor = prev_tau * (1.0 - pct / 100.0)
    change = 0.0 if prev_tau == 0 else (cur_tau - prev_tau) / prev_tau * 100.0
    desc = f"tau {cur_tau:.3f} vs previous {prev_tau:.3f} ({change:+.1f}%)"
    if cur_tau < floor:
        return False, f"{desc}: more than {pct:g}% below the previous stage (floor {floor:.3f})"
    return True, f"{desc}: within {pct:g}%"


def baseline_draft(upstream, *, planned: bool = False) -> tuple[Path | None, str | None]:
    """(draft, stage name) that a stage's measurement decodes as its baseline: the draft_from stage's
    final draft, when that stage finished (stage_complete.json names the file and its sha256 still
    matches); else, for a planned run (`run` chains the stages), where that stage will write it;
    else (None, None). `upstream` is the draft_from StageSpec, or None."""
    if upstream is None:
        return None, None
    rd = runfolder.RunDir(upstream.output_dir)
    if planned and rd.stage_complete() is None:
        return rd.final_weights, upstream.name
    weights = rd.finished_draft()
    return (weights, upstream.name) if weights is not None else (None, None)


def eval_command(output_dir: str | os.PathLike, stage: str, *, gamma: int = 4, max_new_tokens: int = 64,
                 num_prompts: int | None = None, prompts: str | os.PathLike | None = None, device: str = "auto",
                 baseline_draft: str | os.PathLike | None = None, baseline_stage: str | None = None,
                 python: str | None = None, methods: tuple[str, ...] = ("chain",),
                 tree_shape: tuple[int, ...] | None = None, temperature: float = 0.0) -> list[str]:
    """argv of the measuring process (`python -m longspec.evaluate RUN ... --json`): it writes
    RUN/eval.json and prints the same object as its last stdout line; exit 0 ok, 1 not lossless
    or no finished draft, 2 usage, 3 unreadable input. ``baseline_draft``: the upstream stage's
    final draft, decoded on the same prompts (eval.json `baseline.tau`, what gate_stage compares)."""
    argv = [python or sys.executable, "-m", "longspec.evaluate", str(output_dir), "--stage", stage,
            "--gamma", str(gamma), "--max-new-tokens", str(max_new_tokens), "--device", device, "--json"]
    for m in methods:
        argv += ["--method", m]
    if tree_shape:
        argv += ["--tree-shape", *map(str, tree_shape)]
    if temperature:
        argv += ["--temperature", repr(float(temperature))]
    if num_prompts is not None:  # else the evaluator picks by prompt length (8 to 32)
        argv += ["--num-prompts", str(num_prompts)]
    if prompts is not None:
        argv += ["--prompts", str(prompts)]
    if baseline_draft is not None:
        argv += ["--baseline-draft", str(baseline_draft)]
        if baseline_stage:
            argv += ["--baseline-stage", baseline_stage]
    return argv


def gate_stage(cur_dir: str | os.PathLike, prev_dir: str | os.PathLike | None, pct: float, *,
               cur_sha256: str | None = None, prev_sha256: str | None = None) -> tuple[bool, str]:
    """The gate for a finished stage from its eval.json (and its draft_from stage's).

    The previous tau is, in order of preference: eval.json `baseline.tau` (the upstream draft
    decoded on THIS stage's prompts: a like-for-like comparison), else the upstream stage's own
    eval.json tau (measured on its own prompts, which may be shorter or easier). Fails when the
    stage has no (current) eval.json, when it is not lossless, or by gate_check. A sha256 given
    means: that eval.json (or the baseline in it) must have been measured on that draft."""
    try:
        cur = read_eval(cur_dir)
        prev = read_eval(prev_dir) if prev_dir is not None else None
    except EvalFileError as e:
        return False, str(e)
    if cur is None:
        return False, f"no {EVAL_NAME} in {cur_dir}: evaluate the stage first"
    if cur_sha256 is not None and not eval_is_current(cur, cur_sha256):
        return False, f"{Path(cur_dir) / EVAL_NAME} was measured on another draft: evaluate the stage again"
    if cur["lossless"] is None:
        return False, f"stage {cur['stage']}: eval.json was measured with sampling; the gate needs a greedy evaluation"
    if not cur["lossless"]:
        return False, f"stage {cur['stage']}: speculative output differs from greedy output (not lossless)"
    base = cur.get("baseline")
    if isinstance(base, dict) and _number(base.get("tau")) and \
            (prev_sha256 is None or base.get("draft_sha256") == prev_sha256):
        ok, msg = gate_check(float(base["tau"]), float(cur["tau"]), pct)
        return ok, msg + " (upstream draft on the same prompts)"
    prev_tau = None
    if prev is not None and (prev_sha256 is None or eval_is_current(prev, prev_sha256)):
        same = method_figures(prev, str(cur.get("method") or "chain"))   # a chain tau is not a tree tau
        prev_tau = float(same["tau"]) if same is not None else None
    ok, msg = gate_check(prev_tau, float(cur["tau"]), pct)
    return ok, msg + (" (upstream stage's own prompts)" if prev_tau is not None else "")


__all__ = ["EVAL_NAME", "EvalFileError", "read_eval", "method_taus", "method_figures", "eval_is_current", "gate_check", "eval_command", "gate_stage"]
