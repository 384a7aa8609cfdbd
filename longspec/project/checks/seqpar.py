"""`sequence_parallel_size` before launch (no torch): what DeepSpeed's Ulysses needs.

    sp_problems(sp, world, heads, kv_heads, seq_len)   the reasons an SP size cannot run, as lines
    largest_sp(heads, kv_heads, world)                 the largest SP the head counts (and world) allow
    check_sequence_parallel(composed, dialect, ctx)    validate's check: world, the target's (and so
                                                       the draft's) head counts, max_seq_length

The draft copies the target's head counts (longspec.model.glide.DraftConfig), so one rule covers
both: the query heads divisible by SP, the K/V heads divisible by SP or dividing it (Ulysses then
replicates each K/V head, as for MQA); the sequence length divisible by SP (each rank one chunk).
"""

from __future__ import annotations

import json
from typing import Any

from longspec.project import schema as S
from longspec.project.checks.common import CHECKPOINT_RE, Context, abs_path, usable
from longspec.project.composed import Composed
from longspec.project.problem import Problem

KEY = "sequence_parallel_size"


def heads_fit(sp: int, heads: int, kv_heads: int) -> bool:
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def largest_sp(heads: int, kv_heads: int, world: int | None = None) -> int:
    """The largest SP the head counts allow (and that divides ``world`` when given)."""
    top = heads if world is None else min(heads, world)
    return max(sp for sp in range(1, top + 1)
               if heads_fit(sp, heads, kv_heads) and (world is None or world % sp == 0))


def sp_problems(sp: int, world: int | None, heads: int | None, kv_heads: int | None,
                seq_len: int | None) -> list[str]:
    """Every reason SP cannot run (empty: it can). None: that fact is unknown, not checked."""
    if sp <= 1:
        return []
    out = []
    if world is not None and world % sp:
        out.append(f"{KEY} = {sp} does not divide the {world} ranks (world = data-parallel x SP)")
    if heads and kv_heads and not heads_fit(sp, heads, kv_heads):
        best = largest_sp(heads, kv_heads, world)
        out.append(f"{KEY} = {sp} does not fit the target's (and draft's) {heads} query / {kv_heads} "
                   f"key-value heads: the query heads must be divisible by SP and the key-value heads "
                   f"divisible by SP or divide it; the largest SP that works is {best}")
    if seq_len is not None and seq_len % sp:
        out.append(f"max_seq_length = {seq_len} is not divisible by {KEY} = {sp} (each rank holds one "
                   f"equal chunk of every sequence)")
    return out


def target_heads(c: Composed, ctx: Context) -> tuple[int, int] | None:
    """(query heads, key-value heads) from the target's config.json, else the project's preset."""
    model = c.get("model_name_or_path")
    if not usable(model) or CHECKPOINT_RE.search(str(model)):
        return None
    try:
        data = json.loads((abs_path(ctx, model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = _preset_size(ctx)
    if not isinstance(data, dict):
        return None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    heads = text.get("num_attention_heads", text.get("heads"))
    kv = text.get("num_key_value_heads", text.get("kv_heads")) or heads
    if not (isinstance(heads, int) and isinstance(kv, int)) or heads < 1 or kv < 1:
        return None
    return heads, kv


def _preset_size(ctx: Context) -> dict | None:
    """The preset's `size:` table (heads, kv_heads) of a project whose target is not on disk yet."""
    from longspec.project import presets
    from longspec.errors import LongspecError

    name = getattr(ctx.manifest, "preset", None)
    try:
        return presets.get_preset(name).size if name else None
    except (LongspecError, OSError, TypeError):
        return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_sequence_parallel(c: Composed, d: str, ctx: Context) -> list[Problem]:
    sp = _int(c.get(KEY)) if d == S.LONGSPEC else None
    if not sp or sp <= 1:
        return []
    heads = target_heads(c, ctx)
    msl = _int(c.get(S.KEYS[d]["max_seq_length"]))
    lines = sp_problems(sp, ctx.world, *(heads or (None, None)), msl)
    hint = f"set {KEY} to a size that fits (world {ctx.world}, {ctx.world_from})"
    return [c.problem("error", KEY, line, hint) for line in lines]
