"""The kernel mode, what each kernel can run on, and the loss; the attention ladder itself is
longspec.model.attention.

- ``linear_cross_entropy``: next-token loss straight from hidden states and the lm_head weight,
  in fp32, without ever holding the full (N, V) logits. Liger's fused kernel on CUDA when
  installed (reading the lm_head in its own dtype), otherwise a chunked autograd Function.
- ``backend``: the rung of the attention ladder (flash_attn, torch_fused, sdpa) and the loss
  kernel a run will use, for the start line, the doctor and eval.json.

Which implementation runs is chosen once per process by ``set_mode``:
    auto       fused kernels where they can run (CUDA: flash-attn where installed, else torch's own
               fused attention; Liger where installed), the reference path elsewhere
    fused      fused kernels or an error: a GPU run never falls back silently
    reference  the torch reference path everywhere (slow on long sequences; for checks)
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
import torch.nn.functional as F

from longspec.machine.memory import DEFAULT_CE_CHUNK  # rows of logits per chunk (bench/bench_linear_ce.py)

MODES = ("auto", "fused", "reference")
_mode = {"value": "auto", "top_rung": "flash_attn"}
ATTENTION_RUNGS = ("flash_attn", "torch_fused", "sdpa")    # the ladder, top first (model/attention.py)


class KernelUnavailable(RuntimeError):
    """``kernels: fused`` was asked for, and a fused kernel cannot run here."""


def set_mode(mode: str) -> None:
    """auto | fused | reference (see the module docstring); the trainer sets it from `kernels`."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)} (got {mode!r})")
    _mode["value"] = mode


def mode() -> str:
    return _mode["value"]


def set_top_rung(rung: str) -> None:
    """Where the attention ladder starts (default flash_attn: all of it); bench/gpu_check.py's
    ``--attention`` measures each rung of a machine with this. The target follows: below
    flash_attn it runs on SDPA."""
    if rung not in ATTENTION_RUNGS:
        raise ValueError(f"attention rung must be one of {', '.join(ATTENTION_RUNGS)} (got {rung!r})")
    _mode["top_rung"] = rung


def top_rung() -> str:
    return _mode["top_rung"]


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
    predicate of the attention ladder (longspec.model.attention) and of the tree verify (tree_attn): flash-attn refuses fp32."""
    if _flash_attn_func() is None:
        return "flash-attn is not installed or does not import"
    if not fused_device(device):
        return "tensors are not on CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (flash-attn needs fp16 or bf16)"
    return None


@lru_cache(maxsize=None)
def _flex_attention_missing() -> str | None:
    """Why torch's FlexAttention does not import here (None: it does)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception as e:  # torch too old, or built without it
        return f"torch {torch.__version__} has no FlexAttention ({type(e).__name__})"
    return None


def torch_fused_unusable(device: torch.device | str, windowed: bool = True) -> str | None:
    """Why torch's own fused attention cannot run on tensors of ``device`` (None: it can).
    windowed: the call needs FlexAttention (a sliding window), not only SDPA's causal path."""
    if not fused_device(device):
        return "tensors are not on CUDA"
    return _flex_attention_missing() if windowed else None


def liger_unusable(device: torch.device | str) -> str | None:
    """Why Liger's fused loss cannot run on tensors of ``device`` (None: it can)."""
    if _liger_loss_cls() is None:
        return "liger-kernel is not installed or does not import"
    if not fused_device(device):
        return "tensors are not on CUDA"
    return None


def backend(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict[str, str]:
    """The rung of the attention ladder (``flash_attn``, ``torch_fused``, ``sdpa``) and the loss
    kernel (``liger``, ``chunked``) the draft's training calls take on ``device`` (default: cuda if
    present) under the current mode, for logs; ``dtype``, where known, is the attention's
    (flash-attn refuses fp32: torch_fused then). Raises KernelUnavailable in ``fused`` mode when no
    fused kernel can run (attention: flash-attn or torch's; loss: Liger)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    m = mode()
    top = ATTENTION_RUNGS.index(top_rung())
    flash_why = flash_unusable(device, dtype or torch.bfloat16) or (None if top < 1 else "below the top rung")
    torch_why = torch_fused_unusable(device) or (None if top < 2 else "below the top rung")
    liger_why = liger_unusable(device)
    if m == "reference":
        attention, liger = "sdpa", False
    else:
        attention = "flash_attn" if not flash_why else ("torch_fused" if not torch_why else "sdpa")
        liger = liger_why is None
    if m == "fused" and (attention == "sdpa" or not liger):
        if not fused_device(device):
            where = "no CUDA device"
        else:
            missing = ([f"fused attention ({torch_why})"] if attention == "sdpa" else []) + \
                      (["liger-kernel"] if not liger else [])
            where = f"{' and '.join(missing)} not importable"
        raise KernelUnavailable(
            f"kernels = fused but {where}; install the gpu extra (pip install 'longspec[gpu]') "
            "on a CUDA machine, or set kernels=auto (fused where possible) or kernels=reference")
    return {"attention": attention, "linear_cross_entropy": "liger" if liger else "chunked"}


def target_attn_implementation(dtype: torch.dtype | None = None) -> str:
    """The transformers attention of the frozen target: flash-attn's where transformers finds it
    on a CUDA machine, the mode allows fused kernels and ``dtype`` is fp16/bf16; else SDPA (its
    causal path, torch's fused kernels, when there is no padding)."""
    if (mode() == "reference" or top_rung() != "flash_attn" or not torch.cuda.is_available()
            or dtype not in (None, torch.float16, torch.bfloat16)):
        return "sdpa"
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        return "sdpa"
    return "flash_attention_2" if is_flash_attn_2_available() and _flash_attn_func() is not None else "sdpa"


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
        # The lm_head in its own dtype (no fp32 copy of a (V, H) weight per call); Liger upcasts
        # each logits chunk to fp32 for the softmax.
        loss_fn = _liger_loss_cls()(ignore_index=ignore_index, reduction="mean")
        return loss_fn(weight, hidden.to(weight.dtype), labels).float()

    grad_on = torch.is_grad_enabled()
    need_gh = grad_on and hidden.requires_grad
    need_gw = grad_on and weight.requires_grad
    chunk = int(chunk_size or DEFAULT_CE_CHUNK)
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1 (got {chunk_size})")
    return _ChunkedLinearCE.apply(hidden, weight, labels, valid, n_valid, chunk, need_gh, need_gw)


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b in fp32 from low-precision operands, with no fp32 copy of either (CUDA's
    ``torch.mm(..., out_dtype=torch.float32)``: fp32 accumulation and output); None where that
    does not run (the CPU, an older torch)."""
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE is False or not a.is_cuda:
        return None
    try:
        out = torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        _MM_OUT_DTYPE = False
        return None
    _MM_OUT_DTYPE = True
    return out


_MM_OUT_DTYPE: bool | None = None      # torch.mm's out_dtype: None until first tried


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and both gradients computed chunk by chunk in forward (as Liger does).

    Backward then only scales the stored gradients, so it never needs ``weight`` again; this is
    what lets the caller release a ZeRO-3 gathered lm_head right after the forward.

    The logits are fp32 (the softmax and its gradient too). A low-precision lm_head is read in its
    own dtype where torch can multiply it into fp32 (CUDA): no fp32 copy of the (V, H) weight,
    2.2 GB for a 7B target's. Elsewhere it is upcast once per call.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, valid, n_valid, chunk, need_gh, need_gw):
        lowp = weight.dtype in (torch.bfloat16, torch.float16)
        w = weight if lowp and _mm_fp32_out(weight[:1], weight[:1].T) is not None else weight.float()  # probe once
        rows = valid.nonzero().squeeze(1)                          # only labelled rows cost anything
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_gh else None     # (N, H)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_gw else None
        for s in range(0, rows.numel(), chunk):
            idx = rows[s : s + chunk]
            h = hidden.index_select(0, idx).to(w.dtype)            # (C, H)
            y = labels.index_select(0, idx)                        # (C,)
            logits = _mm_fp32_out(h, w.T) if w.dtype != torch.float32 else h @ w.T   # (C, V) fp32
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
                gh = dlogits @ w if w.dtype == torch.float32 else _mm_fp32_out(dlogits.to(w.dtype), w)
                grad_h.index_copy_(0, idx, gh.to(hidden.dtype))
            if need_gw:
                grad_w.addmm_(dlogits.T, h.float())
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
