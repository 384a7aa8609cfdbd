"""The one dispatch point for the two heavy ops of GLIDE training.

- ``attention``: causal attention with an optional sliding window (draft self-attention) and an
  optional lag (draft cross-attention onto the target's K/V). flash-attn on CUDA when installed,
  otherwise torch SDPA with an explicit boolean mask, chunked over queries (on the CPU in
  training, when a sequence spans several chunks, each is checkpointed: its mask and weights are
  rebuilt in backward, not kept).
- ``linear_cross_entropy``: next-token loss straight from hidden states and the lm_head weight,
  in fp32, without ever holding the full (N, V) logits. Liger's fused kernel on CUDA when
  installed, otherwise a chunked autograd Function.

Visibility rule shared by both attention paths (query index t, key index s, both from 0):
    s <= t - lag                      (causal, shifted back by ``lag``)
    s >= t - lag - window             (only when ``window`` is set: ``window + 1`` keys at most,
                                       the query's own position included)
The window is flash-attn's ``window_size=(window, -1)`` with causal=True, the reference GLIDE
draft's setting: ``window=512`` sees 513 keys. Queries with no visible key (t < lag, or everything
padded) return 0, never NaN.

Which implementation runs is chosen once per process by ``set_mode``:
    auto       fused kernels where they can run (CUDA, installed), the reference path elsewhere
    fused      fused kernels or an error: a GPU run never falls back silently
    reference  the torch reference path everywhere (slow on long sequences; for checks)
"""
from __future__ import annotations

import importlib.util
import math
from functools import lru_cache

import torch
import torch.nn.functional as F

# Score elements (B * nh * Tq * Sk) per SDPA call on the reference path: bounds memory at long T.
_SDPA_SCORE_BUDGET = 1 << 24
# Rows of logits per chunk on the reference cross-entropy path (see bench/bench_linear_ce.py).
DEFAULT_CE_CHUNK = 1024
MODES = ("auto", "fused", "reference")
_mode = {"value": "auto"}


class KernelUnavailable(RuntimeError):
    """``kernels: fused`` was asked for, and a fused kernel cannot run here."""


def set_mode(mode: str) -> None:
    """auto | fused | reference (see the module docstring); the trainer sets it from `kernels`."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)} (got {mode!r})")
    _mode["value"] = mode


def mode() -> str:
    return _mode["value"]


# ----------------------------------------------------------------------------- availability

@lru_cache(maxsize=None)
def _flash_attn_func():
    """flash_attn_func or None (not installed, or installed but unusable here)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_func
    except Exception:  # a wheel built against another torch/CUDA fails at import
        return None
    return flash_attn_func


@lru_cache(maxsize=None)
def _liger_loss_cls():
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:
        return None
    return LigerFusedLinearCrossEntropyLoss


def fused_device(device: torch.device | str) -> bool:
    """Whether the fused kernels can run on tensors of ``device`` (CUDA). Every fused-or-reference
    choice in longspec asks this one function (attention, linear_cross_entropy, backend, tree_attn),
    so that the CPU stand-in tests (tests/standins) can lift it for their own run and nothing else."""
    return torch.device(device).type == "cuda"


def flash_unusable(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run on tensors of ``device`` and ``dtype`` (None: it can). The one
    predicate of kernels.attention and of the tree verify (tree_attn): flash-attn refuses fp32."""
    if _flash_attn_func() is None:
        return "flash-attn is not installed or does not import"
    if not fused_device(device):
        return "tensors are not on CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (flash-attn needs fp16 or bf16)"
    return None


def backend(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict[str, str]:
    """Which implementation each op uses on ``device`` (default: cuda if present) under the
    current mode, for logs; ``dtype``, where known, is the attention's (flash-attn refuses fp32:
    "sdpa" then). Raises KernelUnavailable in ``fused`` mode when one cannot run."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = fused_device(device)
    m = mode()
    flash = on_cuda and m != "reference" and _flash_attn_func() is not None
    liger = on_cuda and m != "reference" and _liger_loss_cls() is not None
    if m == "fused" and not (flash and liger):
        missing = [name for name, ok in (("flash-attn", flash), ("liger-kernel", liger)) if not ok]
        where = "no CUDA device" if not on_cuda else f"{' and '.join(missing)} not importable"
        raise KernelUnavailable(
            f"kernels = fused but {where}; install the gpu extra (pip install 'longspec[gpu]') "
            "on a CUDA machine, or set kernels=auto (fused where possible) or kernels=reference")
    flash = flash and (dtype is None or flash_unusable(device, dtype) is None)
    return {
        "attention": "flash_attn" if flash else "sdpa",
        "linear_cross_entropy": "liger" if liger else "chunked",
    }


# ----------------------------------------------------------------------------- attention

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
    (B, S) bool/int, True/1 = real token. impl: None (from the mode), "flash" or "sdpa" (forcing
    flash where it cannot run raises).
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
        if key_padding_mask.all():
            key_padding_mask = None
    scale = scale if scale is not None else 1.0 / math.sqrt(hd)
    if k.dtype != q.dtype:  # e.g. an fp32 draft attending to bf16 target K/V
        k, v = k.to(q.dtype), v.to(q.dtype)

    if impl is None:
        impl = "sdpa" if mode() == "reference" else ("flash" if mode() == "fused" and fused_device(q.device) else None)
    why_not = _flash_blocker(q, k, causal, key_padding_mask)
    if impl == "flash" and why_not:
        raise KernelUnavailable(f"attention: flash-attn requested but not usable here ({why_not})")
    if impl == "sdpa" or why_not:
        return _sdpa_attention(q, k, v, causal, window, lag, key_padding_mask, scale, q_chunk)
    return _flash_attention(q, k, v, causal, window, lag, scale)


def _flash_blocker(q, k, causal, key_padding_mask) -> str | None:
    """Why flash-attn cannot compute this call exactly (None: it can).

    Right padding is fine: with causal attention a real query never sees a later (padded) key,
    and padded queries carry no label. Any other padding pattern needs the reference path.
    """
    why = flash_unusable(q.device, q.dtype)
    if why:
        return why
    if causal and k.shape[2] != q.shape[2]:
        return "causal attention with keys and queries of different lengths"
    if key_padding_mask is not None and not (causal and _right_padded(key_padding_mask)):
        return "padding that is not right padding"
    return None


def _right_padded(key_padding_mask: torch.Tensor) -> bool:
    """(B, S) bool: every row is real tokens followed by padding only."""
    m = key_padding_mask.to(torch.int8)
    return bool((m[:, 1:] <= m[:, :-1]).all())


def _flash_attention(q, k, v, causal, window, lag, scale):
    flash_attn_func = _flash_attn_func()
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


def visible_mask(t_idx: torch.Tensor, s_idx: torch.Tensor, window: int | None, lag: int) -> torch.Tensor:
    """(Tq, Sk) bool: which keys s each query t may see (see module docstring)."""
    rel = t_idx[:, None] - lag - s_idx[None, :]    # >= 0 means key at or before t - lag
    mask = rel >= 0
    if window is not None:
        mask &= rel <= window
    return mask


def _sdpa_attention(q, k, v, causal, window, lag, key_padding_mask, scale, q_chunk):
    B, nh, T, hd = q.shape
    kvh, S = k.shape[1], k.shape[2]
    g = nh // kvh
    if not causal:
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        qg = q.reshape(B, kvh, g * T, hd)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, nh, T, hd)

    first = min(lag, T)              # queries before `lag` see nothing: output 0
    keys_per_query = S if window is None else min(S, window + 1)
    if q_chunk is None:
        q_chunk = _SDPA_SCORE_BUDGET // max(1, B * nh * 2 * keys_per_query)
    q_chunk = max(16, int(q_chunk))
    pieces = [q.new_zeros(B, nh, first, hd)] if first else []
    # one chunk: its scores fit the budget, kept for backward as they are; several: checkpointed
    call = _chunk_call if T - first > q_chunk else _sdpa_chunk
    for t0 in range(first, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        lo = 0 if window is None else max(0, t0 - lag - window)       # first key any query here sees
        hi = min(S, t1 - lag)                                          # one past the last one
        pieces.append(call(q, k, v, t0, t1, lo, hi, window, lag, key_padding_mask, scale))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _chunk_call(q, k, v, *args):
    """One query chunk. On the CPU under autograd through activation checkpointing: SDPA keeps the
    chunk's mask (as floats) and its attention weights for backward, which over all chunks covers
    g x T x keys whatever the heads (so sequence parallelism cut nothing there); checkpointed, a
    call keeps only q, k, v (held anyway) and rebuilds one chunk at a time in backward: the same
    values, one more forward per chunk."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_sdpa_chunk, q, k, v, *args, use_reentrant=False)
    return _sdpa_chunk(q, k, v, *args)


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
    keys = S if window is None else min(S, window + 1)
    step = max(16, _SDPA_SCORE_BUDGET // max(1, B * nh * 2 * keys))
    pieces = []
    for t0 in range(start, start + Tq, step):
        t1 = min(start + Tq, t0 + step)
        lo = 0 if window is None else max(0, t0 - lag - window)
        pieces.append(_sdpa_chunk(q, k, v, t0, t1, lo, max(0, min(S, t1 - lag)), window, lag, key_padding_mask,
                                  scale, q_at=start))
    return torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]


def _sdpa_chunk(q, k, v, t0, t1, lo, hi, window, lag, key_padding_mask, scale, q_at: int = 0):
    B, nh, _, hd = q.shape
    kvh = k.shape[1]
    g, Tc = nh // kvh, t1 - t0
    if hi <= lo:   # no key in range (keys shorter than queries): nothing visible
        return q.new_zeros(B, nh, Tc, hd)
    dev = q.device
    mask = visible_mask(torch.arange(t0, t1, device=dev), torch.arange(lo, hi, device=dev), window, lag)
    mask = mask.repeat(g, 1)[None, None]                         # (1, 1, g*Tc, Sc): rows ordered (group, t)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, lo:hi]      # (B, 1, g*Tc, Sc)
    row_ok = mask.any(-1, keepdim=True)                           # (., 1, g*Tc, 1)
    all_ok = bool(row_ok.all())
    if not all_ok:  # give empty rows one key so softmax stays finite, then zero them below
        mask = mask | (~row_ok & (torch.arange(hi - lo, device=dev) == 0))
    # Fold the query heads of each KV group into the sequence axis: no K/V copy per head.
    qc = q[:, :, t0 - q_at:t1 - q_at].reshape(B, kvh, g * Tc, hd)  # (B, kvh, g*Tc, hd); q starts at q_at
    kc, vc = k[:, :, lo:hi], v[:, :, lo:hi]                       # (B, kvh, Sc, hd)
    out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
    if not all_ok:
        out = out * row_ok.to(out.dtype)
    return out.reshape(B, nh, Tc, hd)


# ----------------------------------------------------------------------------- linear cross entropy

def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """mean_i CE(hidden_i @ weight.T, labels_i) over labels != ignore_index, in fp32.

    hidden (N, H), weight (V, H), labels (N,) -> scalar fp32. 0 (zero grads) when every label
    is ignored. impl: None (automatic), "liger" or "chunked".
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} for hidden {tuple(hidden.shape)}")
    labels = labels.to(device=hidden.device, dtype=torch.long)
    valid = labels != ignore_index
    n_valid = int(valid.sum())
    if n_valid == 0:  # zero loss still wired to the inputs so backward() works and gives zero grads
        return hidden[:0].float().sum() + weight[:0].float().sum()
    vocab = weight.shape[0]
    bad = valid & ((labels < 0) | (labels >= vocab))
    if bad.any():
        raise ValueError(f"linear_cross_entropy: label {int(labels[bad][0])} outside the vocabulary (size {vocab})")

    on_fused = fused_device(hidden.device)
    use_liger = _liger_loss_cls() is not None and on_fused and mode() != "reference"
    if impl is None and mode() == "fused" and on_fused:
        impl = "liger"
    if impl == "liger" and not use_liger:
        raise KernelUnavailable("linear_cross_entropy: liger requested but not usable (needs CUDA and liger-kernel)")
    if impl != "chunked" and use_liger:
        loss_fn = _liger_loss_cls()(ignore_index=ignore_index, reduction="mean")
        return loss_fn(weight.float(), hidden.float(), labels).float()

    grad_on = torch.is_grad_enabled()
    need_gh = grad_on and hidden.requires_grad
    need_gw = grad_on and weight.requires_grad
    chunk = int(chunk_size or DEFAULT_CE_CHUNK)
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1 (got {chunk_size})")
    return _ChunkedLinearCE.apply(hidden, weight, labels, valid, n_valid, chunk, need_gh, need_gw)


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and both gradients computed chunk by chunk in forward (as Liger does).

    Backward then only scales the stored gradients, so it never needs ``weight`` again; this is
    what lets the caller release a ZeRO-3 gathered lm_head right after the forward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, valid, n_valid, chunk, need_gh, need_gw):
        w = weight.float()                                         # (V, H) fp32
        rows = valid.nonzero().squeeze(1)                          # only labelled rows cost anything
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_gh else None     # (N, H)
        grad_w = torch.zeros_like(w) if need_gw else None          # (V, H) fp32
        for s in range(0, rows.numel(), chunk):
            idx = rows[s : s + chunk]
            h = hidden.index_select(0, idx).float()                # (C, H)
            y = labels.index_select(0, idx)                        # (C,)
            logits = h @ w.T                                       # (C, V): the one big buffer
            target = logits.gather(1, y[:, None])                  # (C, 1)
            peak = logits.amax(dim=-1, keepdim=True)               # (C, 1)
            probs = logits.sub_(peak).exp_()                       # in place, no (C, V) temporaries
            total = probs.sum(dim=-1, keepdim=True)                # (C, 1)
            loss += (total.log() + peak - target).sum()            # logsumexp - target logit
            if not (need_gh or need_gw):
                del logits, probs
                continue
            dlogits = probs.mul_(1.0 / (total * n_valid))          # softmax / n_valid
            dlogits[torch.arange(idx.numel(), device=idx.device), y] -= 1.0 / n_valid
            if need_gh:
                grad_h.index_copy_(0, idx, (dlogits @ w).to(hidden.dtype))
            if need_gw:
                grad_w.addmm_(dlogits.T, h)
            del logits, probs, dlogits     # free this chunk's (C, V) before the next one is allocated
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.flags = (need_gh, need_gw, weight.dtype)
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        need_gh, need_gw, w_dtype = ctx.flags
        saved = list(ctx.saved_tensors)
        gh = gw = None
        if need_gh:
            gh = saved.pop(0)
            gh = gh * grad_out.to(gh.dtype)
        if need_gw:
            gw = (saved.pop(0) * grad_out).to(w_dtype)
        return gh, gw, None, None, None, None, None, None
