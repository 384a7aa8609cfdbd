"""GLIDE draft (one decoder block that cross-attends to the frozen target) and its training model.

Shapes: B batch, T tokens, H hidden, nh query heads, kvh key/value heads, hd head dim, V vocab.

    target (frozen, no_grad) --input_ids--> last-layer post-RoPE K, V  (B, kvh, T, hd)
                                            final-norm hidden          (B, T, H) -> llm_loss
    embed(input_ids) -> GlideDraft(self-attn in a window, cross-attn onto K/V, MLP) -> (B, T, H)
                     -> frozen lm_head -> next-token CE (fp32, chunked/fused) = loss

The target side (TargetWrapper, next_token_loss, loading) is longspec.model.target; the ZeRO-3
parameter helpers are longspec.model.zero. The draft's state-dict keys follow the LongSpec reference
layer (`self_attn.*`, `cross_attn.*`, `mlp.*`, three norms), so a draft trained here loads there
and the other way round.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from longspec.model import attention as attn_ladder, seqpar
from longspec.model.families import get_family, rope_params as _rope_params
from longspec.model.target import TargetWrapper, load_target, next_token_loss
from longspec.model.zero import announce_zero3, gathered, gathered_for_update, zero3_dtype


# ----------------------------------------------------------------------------- config

@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"          # anything else needs rope=(cos, sin) from the target
    max_position_embeddings: int = 4096
    attention_bias: bool = True         # the reference draft has q/k/v biases in both families
    family: str = "qwen2"
    qk_norm: bool = False               # per-head q/k RMSNorm before RoPE (the family's layout)
    sliding_window: int = 512           # flash-attn window_size=(W, -1): W + 1 keys, own included
    initializer_range: float = 0.02

    @classmethod
    def from_target_config(cls, hf_config: Any, sliding_window: int = 512,
                           attention_bias: bool | None = None) -> "DraftConfig":
        """Read a transformers config of a family in longspec.model.families (transformers 4.x or 5.x).

        ``attention_bias``: None takes the family's draft layout (longspec.model.families).
        """
        family = get_family(hf_config)          # ValueError: the one refusal sentence
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (got {sliding_window})")
        nh = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
        theta, rope_type = _rope_params(hf_config)
        return cls(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=nh,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or nh,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rope_type=rope_type,
            max_position_embeddings=hf_config.max_position_embeddings,
            attention_bias=family.attention_bias if attention_bias is None else attention_bias,
            family=family.name,
            qk_norm=family.qk_norm,
            sliding_window=sliding_window,
            initializer_range=getattr(hf_config, "initializer_range", 0.02),
        )

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- draft block

class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd); cos/sin (B, T, hd)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class GlideAttention(nn.Module):
    """Projections of one draft attention. In ``cross_attn`` the keys and values come from the
    target, so k_proj / v_proj (and k_norm) are unused; they are kept (frozen) because reference
    drafts carry them. Families with q/k norms (Qwen3) normalise each head before RoPE."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(H, self.kvh * self.hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kvh * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj(x) split into heads; q_proj / k_proj outputs get the family's q/k norm."""
        B, T, _ = x.shape
        y = proj(x).view(B, T, -1, self.hd)                          # (B, T, heads, hd)
        if proj is self.q_proj and hasattr(self, "q_norm"):
            y = self.q_norm(y)
        elif proj is self.k_proj and hasattr(self, "k_norm"):
            y = self.k_norm(y)
        return y.transpose(1, 2)                                     # (B, heads, T, hd)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape                                         # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))  # (B, T, H)


class GlideMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GlideDraft(nn.Module):
    """One pre-norm decoder block: windowed self-attn, cross-attn onto the target's K/V, SwiGLU MLP.
    No final norm: the output goes straight into the target's lm_head."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.config = cfg
        self.self_attn = GlideAttention(cfg)
        self.cross_attn = GlideAttention(cfg)
        self.mlp = GlideMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_self_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_cross_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # An integer arange: zero.Init casts floating tensors it creates to the training dtype.
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)   # not a state-dict key
        self.reset_parameters()
        unused = [self.cross_attn.k_proj, self.cross_attn.v_proj, getattr(self.cross_attn, "k_norm", None)]
        for m in filter(None, unused):
            for t in m.parameters():
                t.requires_grad_(False)

    def reset_parameters(self) -> None:
        """Reference init; also on ZeRO-3 partitioned parameters (gathered, rank 0's values kept)."""
        std = self.config.initializer_range
        with gathered_for_update(list(self.parameters())):
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, mean=0.0, std=std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, RMSNorm):
                    nn.init.ones_(m.weight)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain RoPE tables (B, T, hd) at ``position_ids`` (only for rope_type 'default')."""
        if self.config.rope_type != "default":
            raise ValueError(f"rope_type {self.config.rope_type!r}: pass rope=(cos, sin) from the target's rotary embedding")
        freqs = position_ids[..., None].float() * self.inv_freq.float().to(position_ids.device)  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)                      # (B, T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        hidden: torch.Tensor,              # (B, T, H) target embeddings of the input ids
        position_ids: torch.Tensor,        # (B, T) the same ids the target ran with
        target_k: torch.Tensor,            # (B, kvh, S, hd) target last layer, post-RoPE
        target_v: torch.Tensor,            # (B, kvh, S, hd)
        cross_lag: int = 0,
        attention_mask: torch.Tensor | None = None,   # (B, T) 1 = real token
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        sp: seqpar.SeqParallel | None = None,    # sequence parallel: T is this rank's chunk, the mask global
    ) -> torch.Tensor:
        cfg = self.config
        cos, sin = rope if rope is not None else self.rotary(position_ids, hidden.dtype)

        # self-attention in a sliding window
        x = self.input_layernorm(hidden)
        sa = self.self_attn
        q = apply_rope(sa.heads(sa.q_proj, x), cos, sin)            # (B, nh, T, hd)
        k = apply_rope(sa.heads(sa.k_proj, x), cos, sin)            # (B, kvh, T, hd)
        v = sa.heads(sa.v_proj, x)                                   # (B, kvh, T, hd)
        hidden = hidden + self._attend(sa, q, k, v, position_ids, sp, window=cfg.sliding_window,
                                       key_padding_mask=attention_mask)

        # cross-attention: queries from the draft, keys/values from the target (already RoPE'd)
        x = self.post_self_attention_layernorm(hidden)
        ca = self.cross_attn
        q = apply_rope(ca.heads(ca.q_proj, x), cos, sin)            # (B, nh, T, hd)
        hidden = hidden + self._attend(ca, q, target_k, target_v, position_ids, sp, lag=cross_lag,
                                       key_padding_mask=attention_mask)

        # SwiGLU MLP
        x = self.post_cross_attention_layernorm(hidden)
        return hidden + self.mlp(x)                                  # (B, T, H)

    @staticmethod
    def _attend(attn: GlideAttention, q, k, v, position_ids, sp, **kw) -> torch.Tensor:
        """Causal attention then o_proj -> (B, T, H); under SP over the whole sequence (seqpar)."""
        if sp is None:
            return attn.out(attn_ladder.attention(q, k, v, causal=True, **kw))
        return attn.o_proj(seqpar.attention(sp, attn, q, k, v, position_ids, **kw))


# ----------------------------------------------------------------------------- training model

class GlideModel(nn.Module):
    """Frozen target + trainable draft. forward -> {"loss": draft loss, "llm_loss": target loss}."""

    def __init__(self, target: TargetWrapper | nn.Module, draft: GlideDraft, loss_chunk_size: int | None = None):
        super().__init__()
        self.target = target if isinstance(target, TargetWrapper) else TargetWrapper(target)
        self.draft = draft
        self.loss_chunk_size = loss_chunk_size
        self.sp: seqpar.SeqParallel | None = None      # set by the trainer at sequence_parallel_size > 1
        tcfg = DraftConfig.from_target_config(self.target.config, draft.config.sliding_window)
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(tcfg, name) != getattr(draft.config, name):
                raise ValueError(f"draft {name}={getattr(draft.config, name)} does not match the target's {getattr(tcfg, name)}")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.draft.parameters() if p.requires_grad]

    def forward(self, input_ids, labels, position_ids=None, cross_lag: int = 0, attention_mask=None) -> dict:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if self.sp is not None:
            return self._forward_sp(input_ids, labels, position_ids, cross_lag, attention_mask)
        tgt = self.target(input_ids, position_ids, attention_mask=attention_mask)
        hidden = self.target.embed(input_ids)                        # (B, T, H) frozen embeddings
        draft_dtype = self.draft.input_layernorm.weight.dtype
        hidden = hidden.to(draft_dtype)
        rope = self.target.rotary(position_ids, hidden)              # (B, T, hd) x2
        h = self.draft(hidden, position_ids, tgt.k, tgt.v, cross_lag=cross_lag,
                       attention_mask=attention_mask, rope=rope)     # (B, T, H)
        # One gather of the lm_head serves both losses; the loss kernels compute their gradients
        # in forward, so backward never needs the (released) gathered weight.
        with gathered(self.target.lm_head.weight) as w:
            with torch.no_grad():
                llm_loss = next_token_loss(tgt.last_hidden, w, labels, attention_mask, self.loss_chunk_size)
            loss = next_token_loss(h, w, labels, attention_mask, self.loss_chunk_size)
        return {"loss": loss, "llm_loss": llm_loss}

    def _forward_sp(self, input_ids, labels, position_ids, cross_lag, attention_mask) -> dict:
        """Sequence parallel: every rank of the group gets the same full batch (B, T) and runs its
        chunk; the losses are this rank's shares of the group's means (seqpar.local_share)."""
        sp = self.sp
        sh = seqpar.prepare(input_ids, labels, position_ids, attention_mask, sp.size, sp.rank, sp.rows)
        # No mask for the target: Ulysses drops it (causal attention; right padding never reaches
        # a real token) and a local 4D mask would only cost memory.
        tgt = self.target(sh.input_ids, sh.position_ids)             # K/V (B, kvh, Tl, hd)
        draft_dtype = self.draft.input_layernorm.weight.dtype
        hidden = self.target.embed(sh.input_ids).to(draft_dtype)     # (B, Tl, H)
        rope = self.target.rotary(sh.position_ids, hidden)
        h = self.draft(hidden, sh.position_ids, tgt.k, tgt.v, cross_lag=cross_lag,
                       attention_mask=sh.key_mask, rope=rope, sp=sp)  # (B, Tl, H)
        with gathered(self.target.lm_head.weight) as w:
            with torch.no_grad():
                llm_loss = seqpar.local_share(tgt.last_hidden, w, sh.labels, sp, self.loss_chunk_size)
            loss = seqpar.local_share(h, w, sh.labels, sp, self.loss_chunk_size)
        return {"loss": loss, "llm_loss": llm_loss}


def build_glide(
    target_path_or_model: str | Path | nn.Module,
    sliding_window: int = 512,
    draft_path: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
    loss_chunk_size: int | None = None,
    zero3_config: dict | None = None,
) -> GlideModel:
    """Load (or take) the target, build a fresh draft or load one, and join them.

    ``zero3_config``: the DeepSpeed config of a ZeRO-3 run (torch.distributed initialised, every
    rank calls this). The target and the draft are then partitioned while they are built
    (deepspeed.zero.Init): each rank keeps its 1/world share of their parameters (plus one
    module's, gathered, while the weights load) and only rank 0 reads the target's weights from
    disk. The config's bf16 / fp16 blocks must say ``dtype``.
    """
    from longspec.model.weights import load_draft_state, load_draft_weights

    if zero3_config is not None:
        if zero3_dtype(zero3_config) != dtype:
            raise ValueError(f"dtype {dtype} but the DeepSpeed config trains in {zero3_dtype(zero3_config)}")
        announce_zero3(zero3_config)
    if isinstance(target_path_or_model, nn.Module):
        hf_model = target_path_or_model
    else:
        hf_model = load_target(Path(target_path_or_model), dtype, attn_implementation)
    cfg = DraftConfig.from_target_config(hf_model.config, sliding_window)
    if zero3_config is None:
        draft = GlideDraft(cfg).to(dtype)
    else:
        import deepspeed

        # No dtype= here: zero.Init takes it from the config (deepspeed 0.19 turns an explicit
        # float32 into bfloat16 on an accelerator without fp16, e.g. the CPU).
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(zero3_config)):
            draft = GlideDraft(cfg)
    if draft_path is not None:
        load_draft_weights(draft, load_draft_state(draft_path))
    return GlideModel(TargetWrapper(hf_model), draft, loss_chunk_size)


__all__ = ["DraftConfig", "GlideDraft", "GlideModel", "build_glide", "apply_rope"]
