"""The attention ladder: one entry (``attention``), a kernel chosen per call, three rungs.

    flash_attn   flash-attn's ``flash_attn_func`` where it imports (CUDA, fp16/bf16)
    torch_fused  torch's own fused kernels, on CUDA: an attention without a window (the draft's
                 lagged cross-attention) is SDPA's causal path on queries shifted back by the lag
                 (no mask, K/V heads repeated: torch's FlashAttention or cuDNN); a windowed one (the
                 draft's self-attention) is FlexAttention, compiled, with the window and the lag
                 stated once as a ``mask_mod`` and a band ``BlockMask`` built directly (no dense
                 mask) once per (length, window, lag, device) and cached
    sdpa         the reference, the CPU's path: torch SDPA with an explicit boolean mask, chunked
                 over queries into chunks of (nearly) one size, no host sync per chunk; a call whose
                 mask is plain causal (no window, no padding: the lagged cross-attention in
                 training) states it with SDPA's causal path instead, one call without chunks

Visibility rule shared by every rung (query index t, key index s, both from 0):
    s <= t - lag                      (causal, shifted back by ``lag``)
    s >= t - lag - window             (only when ``window`` is set: ``window + 1`` keys at most,
                                       the query's own position included)
The window is flash-attn's ``window_size=(window, -1)`` with causal=True, the reference GLIDE
draft's setting: ``window=512`` sees 513 keys. Queries with no visible key (t < lag, or everything
padded) return 0, never NaN. The fused rungs take right padding only (a real query never sees a
later, padded key; padded queries carry no label), anything else goes to the reference. A short
windowed call (up to FLEX_LENGTH_STEP queries, the window shorter than the sequence) takes the
reference too: one masked SDPA call, nothing to compile.

Which rung each call took is counted in ``CHOSEN`` (rung -> calls) and the first call of each
(rung, reason) is logged; ``longspec.model.kernels.backend`` names the rung a run will use.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from functools import lru_cache

import torch
import torch.nn.functional as F

from longspec.model import kernels
from longspec.machine.memory import SCORE_BUDGET, query_chunks  # the reference path's budget and chunks (the estimate's)
FLEX_BLOCK = 128                 # FlexAttention's default sparse block (queries and keys)
FLEX_LENGTH_STEP = 1024          # compiled FlexAttention sees lengths in these steps (one kernel each)
RUNGS = kernels.ATTENTION_RUNGS
CHOSEN: Counter = Counter()
_log = logging.getLogger(__name__)
_logged: set = set()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    lag: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str | None = None,
    q_chunk: int | None = None,
) -> torch.Tensor:
    """Attention with GQA. q (B, nh, T, hd); k, v (B, kvh, S, hd) -> (B, nh, T, hd).

    window: query t sees keys t - lag - window .. t - lag (``window + 1`` keys, flash-attn's
    ``window_size=(window, -1)``). lag: query t sees keys up to t - lag only. key_padding_mask
    (B, S) bool/int, True/1 = real token. impl: None (the ladder under the mode), or one rung
    ("flash_attn", "torch_fused", "sdpa"; forcing one that cannot compute this call raises).
    """
    B, nh, T, hd = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[-1] != hd:
        raise ValueError(f"attention: k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit q {tuple(q.shape)}")
    kvh = k.shape[1]
    if nh % kvh != 0:
        raise ValueError(f"attention: {nh} query heads is not a multiple of {kvh} key/value heads")
    if lag < 0 or (window is not None and window < 0):
        raise ValueError(f"attention: lag must be >= 0 and window >= 0 (got lag={lag}, window={window})")
    if not causal and (lag or window is not None):
        raise ValueError("attention: window and lag need causal=True")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
        if key_padding_mask.all():        # one host sync per call (not per chunk)
            key_padding_mask = None
    scale = scale if scale is not None else 1.0 / math.sqrt(hd)
    if k.dtype != q.dtype:  # e.g. an fp32 draft attending to bf16 target K/V
        k, v = k.to(q.dtype), v.to(q.dtype)

    rung = choose(q, k, causal, window, key_padding_mask, impl)
    if rung == "flash_attn":
        return _flash_attention(q, k, v, causal, window, lag, scale)
    if rung == "torch_fused":
        return _torch_fused_attention(q, k, v, window, lag, scale)
    return _sdpa_attention(q, k, v, causal, window, lag, key_padding_mask, scale, q_chunk)


def choose(q, k, causal, window, key_padding_mask, impl=None) -> str:
    """The rung for this call (counted in CHOSEN, logged once per rung and reason)."""
    m = kernels.mode()
    shape_why = _shape_blocker(q, k, causal, key_padding_mask)      # one padding check (a host sync) per call
    flash_why = flash_blocker(q, k, causal, key_padding_mask, shape_why)
    fused_why = torch_fused_blocker(q, k, causal, window, key_padding_mask, shape_why)
    if impl is not None:
        if impl not in RUNGS:
            raise ValueError(f"attention: impl must be one of {', '.join(RUNGS)} (got {impl!r})")
        why = {"flash_attn": flash_why, "torch_fused": fused_why, "sdpa": None}[impl]
        if why:
            raise kernels.KernelUnavailable(f"attention: {impl} requested but not usable here ({why})")
        rung, reason = impl, "asked for"
    elif m == "reference":
        rung, reason = "sdpa", "kernels = reference"
    elif not flash_why:
        rung, reason = "flash_attn", "installed"
    elif not fused_why and window is not None and FLEX_LENGTH_STEP >= q.shape[2] > window + 1:
        # short and windowed: the reference's one masked SDPA call, no FlexAttention compilation
        rung, reason = "sdpa", f"{q.shape[2]} queries: one masked call (FlexAttention from {FLEX_LENGTH_STEP + 1})"
    elif not fused_why:
        rung, reason = "torch_fused", f"flash-attn: {flash_why}"
    else:
        if m == "fused" and kernels.fused_device(q.device):
            raise kernels.KernelUnavailable(
                f"attention: kernels = fused but no fused kernel computes this call exactly "
                f"(flash-attn: {flash_why}; torch: {fused_why})")
        rung, reason = "sdpa", f"torch: {fused_why}"
    CHOSEN[rung] += 1
    if (rung, reason) not in _logged:
        _logged.add((rung, reason))
        _log.info("attention on %s (%s)", rung, reason)
    return rung


_UNCHECKED = object()


def flash_blocker(q, k, causal, key_padding_mask, shape_why=_UNCHECKED) -> str | None:
    """Why flash-attn cannot compute this call exactly (None: it can); ``shape_why``: the shape
    check's answer when the caller has it already."""
    why = kernels.flash_unusable(q.device, q.dtype) or _below_top("flash_attn")
    if why:
        return why
    return _shape_blocker(q, k, causal, key_padding_mask) if shape_why is _UNCHECKED else shape_why


def torch_fused_blocker(q, k, causal, window, key_padding_mask, shape_why=_UNCHECKED) -> str | None:
    """Why the torch_fused rung cannot compute this call exactly (None: it can)."""
    why = kernels.torch_fused_unusable(q.device, windowed=window is not None) or _below_top("torch_fused")
    if why:
        return why
    if not causal:
        return "not causal (one SDPA call already)"
    if window is not None and q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        return "FlexAttention has no backward on the CPU"
    return _shape_blocker(q, k, causal, key_padding_mask) if shape_why is _UNCHECKED else shape_why


def _below_top(rung: str) -> str | None:
    top = kernels.top_rung()
    return f"the ladder starts at {top}" if RUNGS.index(rung) < RUNGS.index(top) else None


def _shape_blocker(q, k, causal, key_padding_mask) -> str | None:
    if causal and k.shape[2] != q.shape[2]:
        return "causal attention with keys and queries of different lengths"
    if key_padding_mask is not None and not (causal and _right_padded(key_padding_mask)):
        return "padding that is not right padding"
    return None


def _right_padded(key_padding_mask: torch.Tensor) -> bool:
    """(B, S) bool: every row is real tokens followed by padding only (one host sync)."""
    m = key_padding_mask.to(torch.int8)
    return bool((m[:, 1:] <= m[:, :-1]).all())


# ----------------------------------------------------------------------------- flash_attn

def _flash_attention(q, k, v, causal, window, lag, scale):
    flash_attn_func = kernels._flash_attn_func()
    B, nh, T, hd = q.shape
    if lag >= T:
        return torch.zeros_like(q)
    qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))          # (B, T, heads, hd)
    if lag:  # shifting queries back by `lag` turns "t sees <= t - lag" into a plain causal mask
        qf, kf, vf = qf[:, lag:], kf[:, : T - lag], vf[:, : T - lag]
    win = (window, 0) if window is not None else (-1, -1)
    out = flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal, window_size=win)  # (B, T-lag, nh, hd)
    if lag:
        out = torch.cat([out.new_zeros(B, lag, nh, hd), out], dim=1)
    return out.transpose(1, 2)                                     # (B, nh, T, hd)


# ----------------------------------------------------------------------------- torch_fused

def _torch_fused_attention(q, k, v, window, lag, scale):
    """Causal, T == S, right padding ignored (see the module docstring)."""
    B, nh, T, hd = q.shape
    if lag >= T:
        return torch.zeros_like(q)
    if window is not None and window >= T - 1 - lag:
        window = None    # the window holds every key a query could see: plain causal
    if window is None:
        return _shifted_causal(q, k, v, lag, scale)
    if q.device.type != "cuda":
        return _eager_flex()(q, k, v, block_mask=band_block_mask(T, window, lag, q.device), scale=scale,
                             enable_gqa=True)
    # Lengths rounded up to a multiple of FLEX_LENGTH_STEP, zeros appended: a padded key lies after
    # every real query (causal: never seen) and padded queries are cut off, so the result is exact,
    # and the compiled kernel and its BlockMask are one per bucket, not one per length.
    Tp = -(-T // FLEX_LENGTH_STEP) * FLEX_LENGTH_STEP
    if Tp != T:
        q, k, v = (F.pad(x, (0, 0, 0, Tp - T)) for x in (q, k, v))
    out = _compiled_flex()(q, k, v, block_mask=band_block_mask(Tp, window, lag, q.device), scale=scale,
                           enable_gqa=True)
    return out[:, :, :T] if Tp != T else out


def _shifted_causal(q, k, v, lag, scale):
    """Causal attention shifted back by ``lag`` without a mask (T == S, no padding): query t >= lag
    against keys 0 .. T - lag - 1 through SDPA's causal path, one call, no T x T scores (torch's
    FlashAttention or cuDNN on CUDA, its flash kernel on the CPU); queries before ``lag`` get 0."""
    B, nh, T, hd = q.shape
    if lag >= T:
        return torch.zeros_like(q)
    # K/V heads repeated to the query heads (T x kvh x hd each: small): every fused SDPA backend
    # takes that, where `enable_gqa` is refused by some (then SDPA falls to its O(T^2) math path)
    g = nh // k.shape[1]
    kk, vv = ((x[:, :, : T - lag].repeat_interleave(g, dim=1) if g > 1 else x[:, :, : T - lag]) for x in (k, v))
    out = F.scaled_dot_product_attention(q[:, :, lag:], kk, vv, is_causal=True, scale=scale)
    if lag:
        out = torch.cat([out.new_zeros(B, nh, lag, hd), out], dim=2)
    return out                                                     # (B, nh, T, hd)


@lru_cache(maxsize=None)
def window_mask_mod(window: int | None, lag: int):
    """The visibility rule as a FlexAttention mask_mod; one function object per (window, lag), so
    the compiled kernel is reused (a new closure each call would be a new guard)."""
    def mask_mod(b, h, q_idx, kv_idx):
        rel = q_idx - lag - kv_idx
        if window is None:
            return rel >= 0
        return (rel >= 0) & (rel <= window)
    mask_mod.__name__ = f"glide_window{window}_lag{lag}"
    return mask_mod


@lru_cache(maxsize=32)
def band_block_mask(T: int, window: int | None, lag: int, device: torch.device, block: int = FLEX_BLOCK):
    """The BlockMask of ``window_mask_mod(window, lag)`` over T queries and T keys, built from the
    band's block structure directly ((T / block)^2 small integers, never a dense T x T mask)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = -(-T // block)
    lo = torch.arange(n, device=device) * block                    # first position of each block
    hi = torch.clamp(lo + block, max=T) - 1                        # last one
    tmin, tmax = lo[:, None], hi[:, None]                          # query blocks (rows)
    smin, smax = lo[None, :], hi[None, :]                          # key blocks (columns)
    wide = window if window is not None else 2 * T + lag           # no window: no lower bound
    some = (smin <= tmax - lag) & (smax >= tmin - lag - wide)      # (n, n) any key visible
    whole = lo + block <= T                                        # blocks not cut by the end
    full = (smax <= tmin - lag) & (smin >= tmax - lag - wide)      # every key visible ...
    full &= whole[:, None] & whole[None, :]                        # ... and no position past T (as torch)
    partial = some & ~full

    def packed(sel):                                               # counts, indices (first = selected)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return sel.sum(-1).to(torch.int32)[None, None], order[None, None]

    kv_num, kv_idx = packed(partial)
    full_num, full_idx = packed(full)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                        mask_mod=window_mask_mod(window, lag), seq_lengths=(T, T))
    except TypeError:              # an older signature: torch builds it from the mask_mod itself
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(window_mask_mod(window, lag), None, None, T, T, device=device, BLOCK_SIZE=block)


@lru_cache(maxsize=None)
def _compiled_flex():
    """FlexAttention compiled once per process: the fused Triton kernel, forward and backward;
    static shapes, one compilation per length bucket (FLEX_LENGTH_STEP), with room for 64 buckets
    before dynamo would fall back to the unfused (dense) implementation."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit"):          # renamed in newer torch
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < 64:
            setattr(torch._dynamo.config, name, 64)
    return torch.compile(flex_attention, dynamic=False)


def _eager_flex():
    """FlexAttention uncompiled: its reference (dense) implementation, forward only on the CPU.
    What the CPU tests run against the reference path."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    def run(*args, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                       # "without torch.compile" warning
            return flex_attention(*args, **kw)
    return run


# ----------------------------------------------------------------------------- sdpa (reference)

def visible_mask(t_idx: torch.Tensor, s_idx: torch.Tensor, window: int | None, lag: int) -> torch.Tensor:
    """(Tq, Sk) bool: which keys s each query t may see (see module docstring)."""
    rel = t_idx[:, None] - lag - s_idx[None, :]    # >= 0 means key at or before t - lag
    mask = rel >= 0
    if window is not None:
        mask &= rel <= window
    return mask


def chunk_plan(rows: int, B: int, nh: int, keys: int, device, q_chunk: int | None = None,
               window: int | None = None) -> list[int]:
    """Query-chunk sizes covering ``rows`` rows against ``keys`` keys within the device's score
    budget (the sizing rule: longspec.machine.memory.query_chunks, which the estimate reads too)."""
    budget = SCORE_BUDGET["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return query_chunks(rows, B, nh, keys, budget, q_chunk, window)


def _sdpa_attention(q, k, v, causal, window, lag, key_padding_mask, scale, q_chunk):
    B, nh, T, hd = q.shape
    kvh, S = k.shape[1], k.shape[2]
    g = nh // kvh
    if not causal:
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        qg = q.reshape(B, kvh, g * T, hd)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, nh, T, hd)

    if window is None and key_padding_mask is None and S == T and q_chunk is None:
        # the mask is plain causal shifted by the lag: SDPA's own causal path states it exactly,
        # one call of one shape at any length, no scores held (on the CPU as on CUDA)
        return _shifted_causal(q, k, v, lag, scale)
    first = min(lag, T)              # queries before `lag` see nothing: output 0
    sizes = chunk_plan(T - first, B, nh, S, q.device, q_chunk, window)
    # Split once (one cat in backward), not a slice of the whole q per chunk (a q-sized zero
    # tensor per chunk in backward).
    parts = q.split([first] + sizes, dim=2) if first else q.split(sizes, dim=2)
    pieces = [q.new_zeros(B, nh, first, hd)] if first else []
    qparts = parts[1:] if first else parts
    # one chunk: its scores fit the budget, kept for backward as they are; several: checkpointed
    call = _chunk_call if len(sizes) > 1 else _sdpa_chunk
    t0 = first
    for qc in qparts:
        t1 = t0 + qc.shape[2]
        lo, hi = _key_range(t0, t1, S, window, lag, sizes[0])
        pieces.append(call(qc, k, v, t0, t1, lo, hi, window, lag, key_padding_mask, scale))
        t0 = t1
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _key_range(t0, t1, S, window, lag, size):
    """Keys [lo, hi) a query chunk t0 .. t1 - 1 reads (``size``: the plan's chunk size). Windowed:
    ``size + window`` keys for every chunk (the span slides, clamped into 0 .. S), so the shapes
    repeat; unwindowed: 0 .. t1 - lag."""
    if window is None:
        return 0, max(0, min(S, t1 - lag))
    span = min(S, size + window)
    lo = min(max(0, t0 - lag - window), S - span)
    return lo, lo + span


def _chunk_call(qc, k, v, *args):
    """One query chunk among several, under autograd through activation checkpointing: SDPA keeps
    the chunk's mask and (on the CPU) its weights for backward, which over all chunks covers
    g x T x keys; checkpointed, a call keeps only its inputs (held anyway) and rebuilds one chunk
    at a time in backward: the same values, one more forward per chunk."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (qc, k, v)):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_sdpa_chunk, qc, k, v, *args, use_reentrant=False)
    return _sdpa_chunk(qc, k, v, *args)


def attention_rows(q, k, v, start: int, *, window: int | None = None, lag: int = 0,
                   key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the queries at positions start .. start + Tq - 1 alone (q (B, nh, Tq,
    hd); k, v (B, kvh, S, hd) from position 0): those rows of attention(..., causal=True), on the
    reference path, without the queries before ``start``."""
    B, nh, Tq, hd = q.shape
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
        if key_padding_mask.all():
            key_padding_mask = None
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    S, scale = k.shape[2], 1.0 / math.sqrt(hd)
    sizes = chunk_plan(Tq, B, nh, S, q.device, window=window)
    CHOSEN["sdpa"] += 1
    pieces, t0 = [], start
    for qc in q.split(sizes, dim=2):
        t1 = t0 + qc.shape[2]
        lo, hi = _key_range(t0, t1, S, window, lag, sizes[0])
        pieces.append(_sdpa_chunk(qc, k, v, t0, t1, lo, hi, window, lag, key_padding_mask, scale))
        t0 = t1
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _sdpa_chunk(qc, k, v, t0, t1, lo, hi, window, lag, key_padding_mask, scale):
    """qc (B, nh, t1 - t0, hd): the queries t0 .. t1 - 1 against keys lo .. hi - 1."""
    B, nh, Tc, hd = qc.shape
    kvh = k.shape[1]
    g = nh // kvh
    if hi <= lo:   # no key in range (keys shorter than queries): nothing visible
        return qc.new_zeros(B, nh, Tc, hd)
    dev = qc.device
    mask = visible_mask(torch.arange(t0, t1, device=dev), torch.arange(lo, hi, device=dev), window, lag)
    mask = mask.repeat(g, 1)[None, None]                         # (1, 1, g*Tc, Sc): rows ordered (group, t)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, lo:hi]      # (B, 1, g*Tc, Sc)
    # A row t >= lag sees key t - lag unless padding hides it or it lies past the keys (S < T,
    # windowed): only then can a row be empty, known without a host sync. Such rows get one key
    # so softmax stays finite, and are zeroed after.
    row_ok = None
    if key_padding_mask is not None or (window is not None and t1 - 1 - lag - window > hi - 1):
        row_ok = mask.any(-1, keepdim=True)                       # (., 1, g*Tc, 1)
        mask = mask | (~row_ok & (torch.arange(hi - lo, device=dev) == 0))
    # Fold the query heads of each KV group into the sequence axis: no K/V copy per head.
    qg = qc.reshape(B, kvh, g * Tc, hd)                           # (B, kvh, g*Tc, hd)
    out = F.scaled_dot_product_attention(qg, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=scale)
    if row_ok is not None:
        out = out * row_ok.to(out.dtype)
    return out.reshape(B, nh, Tc, hd)


__all__ = ["attention", "attention_rows", "choose", "visible_mask", "band_block_mask", "window_mask_mod",
           "chunk_plan", "CHOSEN", "RUNGS"]
