"""Context-length buckets, figures per bucket and per task, and where a measurement is written.

Buckets: `--lengths 1k,4k,16k,32k`, by default the powers of two from 1k up to the stage's
max_seq_length and that length itself, halved from the bottom until there are at least two
(a 512-token stage: 256 and 512). A prompt of P tokens falls in the bucket of the smallest
length L >= P; a prompt longer than every length is left out (eval.json counts it).

Result files: the stage's default measurement (its held-out records, default settings) is
RUN/eval.json, which `status` and the quality gate read; a measurement with --prompts, --bench
or other settings is RUN/eval-<what>.json (result_name), listed by `status --json`.
"""
from __future__ import annotations

import re

# The buckets' rules live with the CLI's pre-launch memory check, which reads the same buckets.
from longspec.machine.evalmemory import MIN_BUCKETS, default_lengths, parse_lengths  # noqa: F401

EVAL_NAME = "eval.json"



def bucket_of(tokens: int, lengths: list[int]) -> int | None:
    """The smallest length >= tokens; None when the prompt is longer than every length."""
    return next((n for n in lengths if tokens <= n), None)


def label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def figures(rows: list[dict], methods: tuple[str, ...]) -> dict:
    """{method: {tau, speedup, ...}, "baseline": {...}} summed over per-prompt rows (measure's `_raw`)."""
    plain_tok = sum(r["_raw"]["plain"][0] for r in rows)
    plain_s = sum(r["_raw"]["plain"][1] for r in rows)
    plain_tps = plain_tok / plain_s if plain_s > 0 else 0.0
    out = {}
    for m in methods + ("baseline",):
        raw = [r["_raw"][m] for r in rows if m in r["_raw"]]
        if not raw:
            continue
        acc, steps = sum(x[2] for x in raw), sum(x[3] for x in raw)
        tok, secs = sum(x[0] for x in raw), sum(x[1] for x in raw)
        tps = tok / secs if secs > 0 else 0.0
        out[m] = {"tau": round(acc / steps, 4) if steps else 0.0, "target_forwards": int(steps),
                  "spec_tokens_per_s": round(tps, 2), "target_tokens_per_s": round(plain_tps, 2),
                  "speedup": round(tps / plain_tps, 4) if plain_tps > 0 else 0.0}
    return out


def by_length(rows: list[dict], lengths: list[int], methods: tuple[str, ...]) -> list[dict]:
    """[{length, prompts, prompt_tokens (mean), chain: {...}, tree: {...}, baseline: {...}}] for
    every length that holds prompts."""
    out = []
    for n in lengths:
        mine = [r for r in rows if r.get("bucket") == n]
        if mine:
            out.append({"length": n, "prompts": len(mine),
                        "prompt_tokens": round(sum(r["prompt_tokens"] for r in mine) / len(mine)),
                        **figures(mine, methods)})
    return out


def by_task(rows: list[dict], lengths: list[int], methods: tuple[str, ...]) -> list[dict]:
    """[{task, prompts, chain, tree, baseline, by_length}] for a benchmark's tasks."""
    tasks = list(dict.fromkeys(r["task"] for r in rows if r.get("task")))
    return [{"task": t, "prompts": sum(1 for r in rows if r.get("task") == t),
             **figures([r for r in rows if r.get("task") == t], methods),
             "by_length": by_length([r for r in rows if r.get("task") == t], lengths, methods)}
            for t in tasks]


def result_name(*, prompts: str | None, bench: str | None, nondefault: list[str]) -> str:
    """eval.json for the stage's default measurement, else eval-<what it measured>.json."""
    parts = []
    if bench:
        parts.append(bench.split(":", 1)[0])
    if prompts:
        parts.append("prompts-" + re.sub(r"\.(jsonl?|txt)$", "", prompts.rsplit("/", 1)[-1]))
    parts += nondefault
    if not parts:
        return EVAL_NAME
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-")[:80]
    return f"eval-{slug}.json"
