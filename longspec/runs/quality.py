"""The quality gate between stages: read a stage's eval.json, compare its tau with the previous stage's.

eval.json (written by `longspec eval`, docs/DESIGN.md run-folder contract):

    {"stage", "tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup", "gamma", "prompts",
     "max_new_tokens", "context_tokens", "lossless", "draft_sha256", "time",
     "method", "tree_shape", "temperature",                        # absent in older files: chain, greedy
     "methods": {"chain": {"tau", "speedup", ...}, "tree": {...}}, # every method measured on the prompts
     "lengths": [256, 512], "by_length": [{"length", "prompts", "prompt_tokens", "chain": {...},
                "tree": {...}, "baseline": {...}}],                # absent in older files
     "baseline": {"tau", "stage", "draft_sha256", ...},           # the input draft on the same prompts
     "per_prompt": [{"record", "kind", "prompt_tokens", "bucket", "new_tokens", "stopped", "tau", ...}]}

Only the stage's default measurement is eval.json; others (--prompts, --bench, other settings)
are eval-<what>.json next to it (result_files), which neither `status` nor the gate read.

The headline fields (tau, speed-up, lossless) are the first measured method's (the chain unless
only the tree was asked for). `lossless` is null for a sampled (temperature > 0) evaluation.

Rule: a stage fails the gate when its tau is more than `pct` percent below the previous
stage's tau (at the longest length bucket with prompts, see gate_stage), i.e. cur < prev * (1 - pct / 100). Equal or better always passes. Pure: no torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from longspec.runs import runfolder

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


def length_label(n: int) -> str:
    """1024 -> '1k', 512 -> '512' (how eval prints a context-length bucket)."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def length_rows(ev: dict, method: str | None = None) -> list[dict]:
    """eval.json `by_length` as [{length, label, prompts, tau, baseline_tau}] for one method (the
    headline one by default), buckets with prompts only; [] for an older file."""
    method = method or str(ev.get("method") or "chain")
    out = []
    for b in ev.get("by_length") or []:
        if not isinstance(b, dict) or not isinstance(b.get("length"), int) or not b.get("prompts"):
            continue
        fig, base = b.get(method), b.get("baseline")
        if not isinstance(fig, dict) or not _number(fig.get("tau")):
            continue
        out.append({"length": b["length"], "label": length_label(b["length"]), "prompts": b["prompts"],
                    "tau": float(fig["tau"]),
                    "baseline_tau": float(base["tau"]) if isinstance(base, dict) and _number(base.get("tau")) else None})
    return out


def longest_bucket(ev: dict) -> dict | None:
    """The longest length bucket of an eval.json that has prompts and the input draft's tau (what
    the gate compares: the long stages are judged at the length they were trained for)."""
    rows = [r for r in length_rows(ev) if r["baseline_tau"] is not None]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["length"])
    return {**row, "baseline": {"tau": row["baseline_tau"]}}


def result_files(output_dir: str | os.PathLike) -> list[str]:
    """The stage's other measurements (eval-<what>.json: --prompts, --bench, other settings), by name."""
    folder = Path(output_dir)
    try:
        return sorted(p.name for p in folder.glob("eval-*.json") if p.is_file())
    except OSError:
        return []


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


def gate_stage(cur_dir: str | os.PathLike, prev_dir: str | os.PathLike | None, pct: float, *,
               cur_sha256: str | None = None, prev_sha256: str | None = None) -> tuple[bool, str]:
    """The gate for a finished stage from its eval.json (and its draft_from stage's).

    The previous tau is, in order of preference: the input draft's tau on THIS stage's prompts
    (eval.json `baseline`: a like-for-like comparison), at the longest length bucket that has
    prompts (`by_length`; the whole measurement for an older file), else the upstream stage's own
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
        bucket = longest_bucket(cur)
        if bucket is not None:
            ok, msg = gate_check(float(bucket["baseline"]["tau"]), float(bucket["tau"]), pct)
            return ok, msg + f" (input draft on the same prompts, {bucket['label']}-token bucket: " \
                             f"{bucket['prompts']} prompts)"
        ok, msg = gate_check(float(base["tau"]), float(cur["tau"]), pct)
        return ok, msg + " (input draft on the same prompts)"
    prev_tau = None
    if prev is not None and (prev_sha256 is None or eval_is_current(prev, prev_sha256)):
        same = method_figures(prev, str(cur.get("method") or "chain"))   # a chain tau is not a tree tau
        prev_tau = float(same["tau"]) if same is not None else None
    ok, msg = gate_check(prev_tau, float(cur["tau"]), pct)
    return ok, msg + (" (upstream stage's own prompts)" if prev_tau is not None else "")


__all__ = ["EVAL_NAME", "EvalFileError", "read_eval", "method_taus", "method_figures", "length_rows", "longest_bucket", "result_files",
           "eval_is_current", "gate_check", "gate_stage"]
