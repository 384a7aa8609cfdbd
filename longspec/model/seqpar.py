"""Sequence parallelism (DeepSpeed Ulysses, `sequence_parallel_size` > 1) for GLIDE training.

A group of SP ranks shares one batch of sequences; each rank holds one contiguous chunk of every
sequence (T/SP tokens). Shapes: B batch, T global tokens, Tl = T / SP local tokens.

    full batch (B, T), the same on every rank of the group
      -> prepare: labels shifted BEFORE sharding (the boundary targets stay), T padded to a multiple
         of SP (pad tokens carry no label, positions continue)
      -> local chunk (B, Tl): input ids, position ids (stage 1's anchor offsets too), shifted labels
    target forward: HF attention under DeepSpeed's UlyssesSPAttentionHF hook (register_target)
    draft self- and cross-attention: DeepSpeed's UlyssesSPAttentionHF around longspec.model.kernels'
      attention (attention()): q/k/v all-to-all (B, nh, Tl, hd) -> (B, nh/SP, T, hd), so the
      window, the lag and the key padding are applied on global positions, then back
    loss: the rank's CE sum / the group's token count (local_share), so the SP ranks' gradients
      sum to the full sequence's gradient; DeepSpeed's reduction sums over SP (ZeRO 0/1/2; ZeRO-3
      with reduce_scatter false, see longspec.training.dsconfig) and averages over data parallel.
    tau while training (longspec.training.simtau): each rank decodes its own prompts whole, so it
      runs inside plain_attention(), which puts transformers' own attention functions back in
      place of the hook; the draft's evaluation (chainwalk.draft_all_lags) calls kernels directly
      and never goes through SeqParallel.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from longspec.model import attention as attn_ladder, comm, kernels

IGNORE = -100
_HOOKED: dict[str, tuple[Any, Any]] = {}   # attn implementation -> (transformers' own function, Ulysses' hook)


@dataclass
class SeqParallel:
    """This rank's place in its sequence-parallel group."""
    group: Any                       # torch.distributed ProcessGroup of the SP ranks
    rank: int                        # rank within the group: which chunk of the sequence it holds
    size: int                        # SP
    rows: int = 0                    # the target hook's fixed micro batch: smaller batches are padded to it
    _attn: dict = field(default_factory=dict, repr=False)   # (B, nh, kvh, hd) -> UlyssesSPAttentionHF

    def wrapper(self, batch: int, nh: int, kvh: int, hd: int):
        """DeepSpeed's Ulysses attention module around the draft's local attention (one per shape)."""
        key = (batch, nh, kvh, hd)
        if key not in self._attn:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            self._attn[key] = UlyssesSPAttentionHF(
                attn=_local_attention, batch_size=batch, attn_head_count=nh, attn_head_size=hd,
                kv_head_count=kvh, num_hidden_layers=1, process_group=self.group, seq_length_is_variable=True)
        return self._attn[key]


def register_target(hf_model, sequence_parallel_size: int, micro_batch_size: int):
    """Hook DeepSpeed's Ulysses attention into transformers for the target (process-global, once
    per process) -> (mpu for deepspeed.initialize, SeqParallel). The target must use a fused or
    sdpa attention (Ulysses refuses eager)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(hf_model.config, "_attn_implementation", None) or "sdpa"
    own = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else None
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model, core_attn_implementation=impl,
        sequence_parallel_size=sequence_parallel_size, micro_batch_size=micro_batch_size,
        seq_length_is_variable=True)
    hook = ALL_ATTENTION_FUNCTIONS[impl]
    if own is None:                 # a hub kernel, registered by the call above: the function it wraps
        own = next(c.cell_contents.attn for c in hook.__closure__ or ()
                   if isinstance(c.cell_contents, UlyssesSPAttentionHF))
    _HOOKED[impl] = (own, hook)
    sp = SeqParallel(mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(),
                     mpu.get_sequence_parallel_world_size(), rows=micro_batch_size)
    return mpu, sp


@contextmanager
def plain_attention():
    """Inside the block, transformers' own attention in place of Ulysses' process-global hook (a
    no-op without one): for forwards that see whole sequences on one rank, such as the tau
    evaluation's decoding. The hook is back on leaving, also on an error."""
    if not _HOOKED:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for impl, (own, _) in _HOOKED.items():
        ALL_ATTENTION_FUNCTIONS[impl] = own
    try:
        yield
    finally:
        for impl, (_, hook) in _HOOKED.items():
            ALL_ATTENTION_FUNCTIONS[impl] = hook


# ----------------------------------------------------------------------------- the batch

@dataclass
class Shards:
    input_ids: torch.Tensor          # (B, Tl) this rank's chunk
    position_ids: torch.Tensor       # (B, Tl)
    labels: torch.Tensor             # (B, Tl) already shifted: the target of each local position
    key_mask: torch.Tensor | None    # (B, T) the whole (padded) sequence's padding mask, None: no padding


def prepare(input_ids, labels, position_ids, attention_mask, size: int, rank: int, rows: int = 0) -> Shards:
    """The full batch (B, T) -> this rank's chunk, labels shifted first (next_token_loss's rule:
    position t predicts labels[t + 1]; padded labels are ignored). ``rows``: a batch of fewer rows
    (an epoch's last) gets rows without labels up to it (DeepSpeed's hook has a fixed batch size)."""
    B, T = input_ids.shape
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask.to(labels.device) == 0, IGNORE)
    if B < rows:
        extra = rows - B
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids = torch.cat([input_ids, input_ids.new_zeros(extra, T)])
        labels = torch.cat([labels, labels.new_full((extra, T), IGNORE)])
        position_ids = torch.cat([position_ids, position_ids[:1].expand(extra, T)])
        attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(extra, T)])
        B = rows
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)            # (B, T)
    pad = -T % size
    mask = attention_mask
    if pad:
        step = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, step], dim=1)
        input_ids = F.pad(input_ids, (0, pad), value=0)
        shifted = F.pad(shifted, (0, pad), value=IGNORE)
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
        mask = F.pad(mask, (0, pad), value=0)
    Tl = (T + pad) // size
    cut = slice(rank * Tl, (rank + 1) * Tl)
    if mask is not None and bool(mask.bool().all()):
        mask = None
    return Shards(input_ids[:, cut].contiguous(), position_ids[:, cut].contiguous(),
                  shifted[:, cut].contiguous(), mask)


# ----------------------------------------------------------------------------- attention

def _local_attention(module, q, k, v, attention_mask, *, window=None, lag=0, key_padding_mask=None, **_):
    """HF's attention-function signature around attention.attention (the ladder): q (B, nh/SP, T, hd) -> (B, T, nh/SP, hd)."""
    y = attn_ladder.attention(q, k, v, causal=True, window=window, lag=lag, key_padding_mask=key_padding_mask)
    return y.transpose(1, 2), None


def attention(sp: SeqParallel, module, q, k, v, position_ids, *, window=None, lag=0,
              key_padding_mask=None) -> torch.Tensor:
    """q (B, nh, Tl, hd); k, v (B, kvh, Tl, hd) local chunks -> (B, Tl, nh * hd): attention over the
    whole sequence (window, lag, key_padding_mask (B, T) on global positions) through DeepSpeed's
    all-to-all; kvh < SP is replicated as Ulysses does for the target."""
    B, nh, _, hd = q.shape
    uattn = sp.wrapper(B, nh, k.shape[1], hd)
    out, _ = uattn(module, q, k, v, None, position_ids=position_ids, window=window, lag=lag,
                   key_padding_mask=key_padding_mask)
    return out                                                   # (B, Tl, nh * hd)


# ----------------------------------------------------------------------------- loss

def local_share(hidden, weight, shifted_labels, sp: SeqParallel, chunk_size=None) -> torch.Tensor:
    """This rank's share of the group's mean CE: (sum over its labelled positions) / (the group's
    labelled positions). hidden (B, Tl, H), shifted_labels (B, Tl). The shares sum to the mean."""
    H = hidden.shape[-1]
    y = shifted_labels.reshape(-1)
    n_local = (y != IGNORE).sum().to(torch.float32)
    n_all = comm.all_reduce(n_local, group=sp.group)
    mean = kernels.linear_cross_entropy(hidden.reshape(-1, H), weight, y, ignore_index=IGNORE,
                                        chunk_size=chunk_size)
    return mean * (n_local / n_all.clamp(min=1))


__all__ = ["SeqParallel", "Shards", "register_target", "plain_attention", "prepare", "attention", "local_share"]
