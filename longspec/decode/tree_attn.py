"""Tree attention for speculative decoding: the masks, a reference, and a hybrid prefix + tree path.

A verify forward feeds T tree tokens (node 0 = the last verified token, then the draft's nodes
level by level) after a cached prefix of P tokens. Query i (a node) may see:

    every prefix key               (columns 0 .. P-1: all verified, all before it)
    tree key j iff j is i or one of its ancestors          (columns P .. P+T-1)

Reference: one masked attention over the P + T keys (``masked_attention``, SDPA with a boolean
mask). Hybrid (what the paper's inference does on GPU): attend to the prefix with no mask at all
(flash-attn on CUDA, or torch) and to the T tree keys with the small (T, T) mask, each with its
log-sum-exp, then combine the two partial softmaxes exactly:

    out = (e^{lse_p} out_p + e^{lse_t} out_t) / (e^{lse_p} + e^{lse_t})

A test checks the hybrid (torch prefix) against the reference on CPU, and the flash-attn prefix
against it on CUDA. ``install(model)`` routes a transformers model's attention through
``tree_verify_attention`` while a tree is being verified (``verifying``), and through the model's
own SDPA path otherwise; the target wrapper's API is untouched, so every family works.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F

IMPL_NAME = "longspec_tree"
# The tree mask (T, T) bool and the path ("hybrid" / "flash") of the verify forward in progress.
_ACTIVE: contextvars.ContextVar[tuple[torch.Tensor, str] | None] = contextvars.ContextVar("tree", default=None)


def verify_mask(prefix_len: int, tree_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, T, P + T) for a transformers forward: 0 where visible, dtype-min elsewhere
    (transformers uses a 4D mask as given, for eager and SDPA alike)."""
    T = tree_mask.shape[0]
    visible = torch.ones(T, prefix_len + T, dtype=torch.bool, device=tree_mask.device)
    visible[:, prefix_len:] = tree_mask
    mask = torch.zeros(visible.shape, dtype=dtype, device=tree_mask.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def _expand_kv(k: torch.Tensor, nh: int) -> torch.Tensor:
    return k if k.shape[1] == nh else k.repeat_interleave(nh // k.shape[1], dim=1)


def masked_attention(q, k, v, visible: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Reference: q (B, nh, T, hd), k/v (B, kvh, S, hd), visible (T, S) bool -> (B, nh, T, hd).
    A query row with no visible key returns 0."""
    nh = q.shape[1]
    k, v = _expand_kv(k, nh).to(q.dtype), _expand_kv(v, nh).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(q.device), scale=scale)
    return out.masked_fill(~visible.any(-1)[None, None, :, None], 0.0)


def _part(q, k, v, visible, scale):
    """(out, lse) of one block of keys in fp32; lse (B, nh, T), -inf for rows with nothing visible."""
    nh = q.shape[1]
    s = torch.matmul(q.float(), _expand_kv(k, nh).float().transpose(-1, -2)) * scale      # (B, nh, T, S)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                      # (B, nh, T)
    w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(w, _expand_kv(v, nh).float()), lse


def _flash_prefix(q, k, v, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                  causal=False, return_attn_probs=True)                   # (B, T, nh, hd), (B, nh, T)
    return out.transpose(1, 2).float(), lse.float()


def tree_verify_attention(q, k, v, tree_mask: torch.Tensor, scale: float | None = None,
                          impl: str = "hybrid") -> torch.Tensor:
    """q (B, nh, T, hd) tree queries; k/v (B, kvh, P + T, hd) prefix then tree keys; tree_mask (T, T)
    bool -> (B, nh, T, hd). impl: "reference" (one masked attention), "hybrid" (torch prefix part),
    "flash" (flash-attn prefix part, CUDA fp16/bf16; KernelUnavailable elsewhere, never an fp32 call)."""
    T, S = q.shape[2], k.shape[2]
    P = S - T
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if impl == "reference":
        visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
        visible[:, P:] = tree_mask
        return masked_attention(q, k, v, visible, scale)
    out_t, lse_t = _part(q, k[:, :, P:], v[:, :, P:], tree_mask.to(q.device), scale)
    if P == 0:
        return out_t.to(q.dtype)
    if impl == "flash":
        from longspec.model import kernels

        why_not = kernels.flash_unusable(q.device, q.dtype)
        if why_not:
            raise kernels.KernelUnavailable(f"tree attention: flash-attn prefix requested but not usable ({why_not})")
        out_p, lse_p = _flash_prefix(q, k[:, :, :P], v[:, :, :P], scale)
    else:
        out_p, lse_p = _part(q, k[:, :, :P], v[:, :, :P], None, scale)
    lse = torch.logaddexp(lse_p, lse_t)
    out = out_p * torch.exp(lse_p - lse)[..., None] + out_t * torch.exp(lse_t - lse)[..., None]
    return out.to(q.dtype)


def fused_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash-attn can compute the prefix part here: CUDA, installed, fp16/bf16 (it refuses
    fp32). The same predicate as attention.attention's (kernels.flash_unusable)."""
    from longspec.model import kernels

    return kernels.flash_unusable(device, dtype) is None


def setup_verify(model, device: torch.device, dtype: torch.dtype) -> str:
    """Route ``model``'s tree verify through the hybrid path where flash-attn can compute the prefix
    part; the verify backend for eval.json: "flash_attn" (flash prefix merged with the exact tree
    part) or "exact" (the model's own attention with the tree mask: fp32, CPU, no flash-attn)."""
    if fused_available(device, dtype):
        install(model)
        return "flash_attn"
    return "exact"


def verify_impl(device: torch.device, dtype: torch.dtype) -> str:
    """The tree_verify_attention impl an installed model uses: "flash" or "hybrid" (torch prefix)."""
    return "flash" if fused_available(device, dtype) else "hybrid"


# ----------------------------------------------------------------------------- transformers hook

def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: the hybrid tree path inside ``verifying``, SDPA elsewhere."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    active = _ACTIVE.get()
    if active is None or query.shape[2] != active[0].shape[0]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    tree_mask, impl = active
    out = tree_verify_attention(query, key, value, tree_mask, scaling, impl)               # (B, nh, T, hd)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> None:
    """Route ``model``'s attention through the tree path (SDPA outside ``verifying``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(IMPL_NAME, _hf_attention)
    AttentionMaskInterface.register(IMPL_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(IMPL_NAME)


def installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == IMPL_NAME


@contextlib.contextmanager
def verifying(tree_mask: torch.Tensor, impl: str):
    token = _ACTIVE.set((tree_mask, impl))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


__all__ = ["verify_mask", "masked_attention", "tree_verify_attention", "fused_available", "setup_verify",
           "verify_impl", "install", "installed", "verifying"]
