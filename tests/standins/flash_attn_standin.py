"""A strict CPU stand-in for ``flash_attn.flash_attn_func`` (flash-attn 2.x), for tests only.

Written from the library's own source, at the minimum version longspec pins (flash-attn>=2.6:
tag v2.6.0, commit da11d1b8) and at its current release (tag v2.8.3.post1, commit a8aa52b1; main at
0251105a has the same checks and rules a few lines further down; PyPI's 2.8.3.post2 was not read). Paths are in the Dao-AILab/flash-attention repository;
"interface" is flash_attn/flash_attn_interface.py, "api" csrc/flash_attn/flash_api.cpp; line numbers
are given as v2.6.0 / v2.8.3.post1.

- Signature ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False)``: interface :818 / :1135.
- Layout q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim); with
  fewer KV heads (GQA/MQA), query head h reads KV head h // (nheads // nheads_k): interface
  docstring :833 and :854 / :1150 and :1171; api CHECK_SHAPE :409-411 / :416-418.
- Refused like the kernel (same messages): any dtype but fp16/bf16 (api :365 / :374, "FlashAttention
  only support fp16 and bf16 data type"); k or v of another dtype than q (:369-370 / :375-376); a
  head dim over 256 (:387 / :393); nheads not a multiple of nheads_k (:388 / :395); k/v shapes that
  do not fit (CHECK_SHAPE). A non-contiguous last dimension is not refused: the Python wrapper
  copies it first (maybe_contiguous, interface :49 / :19); nor is a head dim that is not a multiple
  of 8 (padded: api :414 / FlashAttnFunc.forward, interface :807-857).
- ``softmax_scale=None`` means headdim ** -0.5 (interface :544 / :828).
- Visibility: key j is visible to query i iff
      i + seqlen_k - seqlen_q - left  <=  j  <=  i + seqlen_k - seqlen_q + right
  (csrc/flash_attn/src/mask.h :52-53 / :53-54), left or right = -1 meaning no bound on that side
  (api set_params_fprop :136-137 / :141-142); a bound >= seqlen_k is no bound (api :392-393 /
  :399-400); ``causal=True`` sets right = 0 (api :397 / :404), so the causal mask is aligned to the
  bottom-right corner when seqlen_q != seqlen_k (interface docstring :837 / :1154); one query turns
  causal off (api :396 / :403), which changes nothing in this rule.
- A query with no visible key outputs 0 (docstring :847 / :1164) and its lse is +inf (csrc/flash_attn/
  src/softmax.h :179 / :180).
- ``return_attn_probs=True`` returns (out, softmax_lse, S_dmask) (interface :565 / :857);
  softmax_lse is fp32 (batch, nheads, seqlen_q) (api :451 / :441), in natural log:
  ``row_max * softmax_scale + __logf(sum)`` (softmax.h :179 / :180). S_dmask is only filled with
  dropout (the wrapper passes ``return_softmax and dropout_p > 0``): here an empty tensor.
- The output has q's dtype; the kernel accumulates in fp32, and so does this stand-in.

Not modelled (longspec does not use them, so they are refused): dropout, softcap, ALiBi. The one
check lifted is the kernel's CUDA-only device check (api CHECK_DEVICE :16 / :20): the tests run it on
CPU tensors. Every call records which longspec function made it (``CALLERS``).
"""
from __future__ import annotations

import torch

from tests.standins import record_caller

CALLERS: list[tuple[str, str]] = []
__version__ = "2.8.3"


def visible(seqlen_q: int, seqlen_k: int, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: the kernel's mask rule (module docstring)."""
    left, right = (int(w) for w in window_size)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if seqlen_q == 1:
        causal = False
    if causal:
        right = 0
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    diag = i + seqlen_k - seqlen_q                 # the key aligned with query i (bottom-right)
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def _check(q, k, v):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError("q, k, v must be 4-D (batch_size, seqlen, nheads, headdim)")
    batch, _, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if batch <= 0:
        raise RuntimeError("batch size must be positive")
    if headdim > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if nheads % nheads_k != 0:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    want = (batch, seqlen_k, nheads_k, headdim)
    if tuple(k.shape) != want:
        raise RuntimeError("k must have shape (batch_size, seqlen_k, num_heads_k, head_size)")
    if tuple(v.shape) != want:
        raise RuntimeError("v must have shape (batch_size, seqlen_k, num_heads_k, head_size)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func's semantics in plain torch (see the module docstring); differentiable."""
    record_caller(CALLERS)
    _check(q, k, v)
    if dropout_p or softcap or alibi_slopes is not None:
        raise NotImplementedError("the stand-in models no dropout, softcap or ALiBi (longspec uses none)")
    batch, sq, nheads, headdim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    qf = q.float().permute(0, 2, 1, 3)                                        # (B, nh, sq, hd)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)       # (B, nh, sk, hd)
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    ok = visible(sq, sk, causal, window_size).to(q.device)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    empty = ~ok.any(-1)                                                       # (sq,) rows that see nothing
    scores = scores.masked_fill(~ok, float("-inf")).masked_fill(empty[:, None], 0.0)  # finite grads there
    lse = torch.logsumexp(scores, dim=-1)                                     # (B, nh, sq), natural log
    probs = torch.exp(scores - lse[..., None]).masked_fill(empty[:, None], 0.0)
    out = (probs @ vf).permute(0, 2, 1, 3).to(q.dtype)                       # (B, sq, nh, hd)
    if not return_attn_probs:
        return out
    lse = lse.detach().masked_fill(empty, float("inf"))
    return out, lse, torch.empty(0, dtype=q.dtype, device=q.device)
