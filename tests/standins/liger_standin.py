"""A strict CPU stand-in for ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss``, for
tests only.

Written from the library's own source, at the minimum version longspec pins (liger-kernel>=0.5:
tag v0.5.0, commit 37ffbe9d) and at the newest release whose source was at hand (tag v0.8.2, commit
000be609; main at ead96b61 leaves these files unchanged; PyPI's newest, 0.8.5, was not read). Paths are in the linkedin/Liger-Kernel repository, under
src/liger_kernel/; line numbers as v0.5.0 / v0.8.2.

- ``forward(self, lin_weight, _input, target, bias=None)``: the lm_head weight (V, H) FIRST, then
  the hidden states (BT, H), then the labels (BT,): transformers/fused_linear_cross_entropy.py
  :37 / :46; the Function receives (_input, lin_weight, ...) in the other order (:38-40 / :47-49).
- Logits ``_input @ weight.t()`` "in the original precision" (ops/fused_linear_cross_entropy.py
  :65 / :114): hidden and weight of different dtypes fail in that matmul; the loss itself is
  accumulated in fp32 (``loss_1d`` fp32, :54 / :86).
- ``ignore_index=-100`` by default (transformers :13 / :13); ``reduction="mean"`` (:16 / :16)
  divides by the number of labels != ignore_index over the whole batch (ops :57 with the per-chunk
  ``alpha`` :108-113 / ops :92-93 passed as ``n_non_ignore`` to ops/cross_entropy.py :226-227).
- The constructor's positional order changed between the two versions (v0.8.2 puts ``ce_weight``
  first, :12): this stand-in takes keywords only, so a positional call (which would mean one thing
  in 0.5 and another now) is refused here.

Not modelled (longspec does not use them, so they are refused): bias, ce_weight, label smoothing,
z-loss, softcap, other reductions' extras. The lifted check is CUDA (Triton kernels): the tests run
it on CPU tensors. Every construction and call records which longspec function made it (``CALLERS``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.standins import record_caller

CALLERS: list[tuple[str, str]] = []
__version__ = "0.8.2"


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    def __init__(self, *, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap=None, ce_weight=None):
        super().__init__()
        assert reduction in {"mean", "sum", "none"}, f"reduction must be one of 'mean', 'sum', or 'none'. Got: {reduction}"
        if lse_square_scale or label_smoothing or softcap is not None or ce_weight is not None:
            raise NotImplementedError("the stand-in models plain cross entropy only (what longspec uses)")
        self.ignore_index = ignore_index
        self.reduction = reduction
        record_caller(CALLERS)

    def forward(self, lin_weight, _input, target, bias=None):
        record_caller(CALLERS)
        if bias is not None:
            raise NotImplementedError("the stand-in models no bias (longspec's lm_head has none)")
        if _input.dim() != 2 or lin_weight.dim() != 2:
            raise ValueError(f"_input (BT, H) and lin_weight (V, H) must be 2-D, got {tuple(_input.shape)} "
                             f"and {tuple(lin_weight.shape)}")
        if _input.shape[1] != lin_weight.shape[1]:
            raise ValueError(f"_input {tuple(_input.shape)} @ lin_weight.t() {tuple(lin_weight.t().shape)}: "
                             "inner dimensions differ (is the argument order (lin_weight, _input, target)?)")
        if target.dim() != 1 or target.shape[0] != _input.shape[0] or target.is_floating_point():
            raise ValueError(f"target must be integer labels (BT,) = ({_input.shape[0]},), got "
                             f"{target.dtype} {tuple(target.shape)}")
        logits = _input @ lin_weight.t()                       # the input's precision, like the kernel
        valid = target != self.ignore_index
        bad = valid & ((target < 0) | (target >= lin_weight.shape[0]))
        if bad.any():
            raise IndexError(f"label {int(target[bad][0])} outside the vocabulary ({lin_weight.shape[0]})")
        per_row = F.cross_entropy(logits.float(), target.long(), ignore_index=self.ignore_index, reduction="none")
        if self.reduction == "none":
            return per_row
        total = per_row.sum()
        return total / valid.sum() if self.reduction == "mean" else total
