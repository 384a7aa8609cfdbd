"""The GLIDE draft block as a vLLM model (architecture LongSpecGlideForCausalLM).

Shapes: T tokens of the batch (vLLM packs every request's tokens into one row), H hidden,
nh/kvh heads, hd head dim.

    embed(ids) (T, H)  [the target's embeddings, set by the proposer]
    + self_attn(input_layernorm(h))                 windowed causal, the draft's own KV cache
    + cross_attn(post_self_attention_layernorm(h))  queries only; K/V: the target's last layer's
                                                    cache (kv_sharing_target_layer_name, set by the
                                                    proposer), lengths: the verified prefix
    + mlp(post_cross_attention_layernorm(h))        -> (T, H) -> the target's lm_head

The same arithmetic as longspec/model/glide.py's GlideDraft (no final norm; RoPE at each token's
own position, for the cross-attention's queries too). Weights: the export's unprefixed keys;
cross_attn.k_proj / v_proj / k_norm are carried by the reference layout and unused here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                               QKVParallelLinear, RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from longspec.serve.plugin import require_supported

# export key -> (this model's parameter, shard of a packed projection)
PACKED = {"self_attn.q_proj": ("self_attn.qkv_proj", "q"), "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
          "self_attn.v_proj": ("self_attn.qkv_proj", "v"), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
          "mlp.up_proj": ("mlp.gate_up_proj", 1)}
UNUSED = ("cross_attn.k_proj.", "cross_attn.v_proj.", "cross_attn.k_norm.")


def draft_config(hf_config) -> dict:
    """The draft's own sizes (config.json `longspec.draft_config`, written by the export)."""
    block = getattr(hf_config, "longspec", None) or {}
    dc = block.get("draft_config") if isinstance(block, dict) else None
    if not dc:
        raise ValueError("config.json has no longspec.draft_config: export the draft with "
                         "`longspec export DIR --format vllm`")
    return dc


def rotary(hf_config, head_dim: int):
    """The target's RoPE (the export copies its rope_parameters), as the target's layers have it."""
    params = getattr(hf_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    return get_rope(head_dim, max_position=hf_config.max_position_embeddings,
                    rope_parameters=dict(params), is_neox_style=True)


class HeadNorm(nn.Module):
    """The family's per-head q/k RMSNorm (Qwen3) on a (T, heads * hd) projection."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.hd = head_dim
        self.norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        return self.norm(x.view(T, -1, self.hd)).view(T, -1)


class GlideSelfAttention(nn.Module):
    def __init__(self, hf_config, dc: dict, cache_config, quant_config, prefix: str):
        super().__init__()
        H, nh, kvh, hd = dc["hidden_size"], dc["num_attention_heads"], dc["num_key_value_heads"], dc["head_dim"]
        self.q_size, self.kv_size = nh * hd, kvh * hd
        self.qkv_proj = QKVParallelLinear(H, hd, nh, kvh, bias=dc["attention_bias"], quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(nh * hd, H, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if dc.get("qk_norm"):
            self.q_norm = HeadNorm(hd, dc["rms_norm_eps"])
            self.k_norm = HeadNorm(hd, dc["rms_norm_eps"])
        self.rotary_emb = rotary(hf_config, hd)
        # longspec's window W (flash-attn window_size=(W, -1)) shows a query W + 1 keys, its own
        # included; vLLM's sliding_window counts the keys a query sees.
        self.attn = Attention(nh, hd, hd ** -0.5, num_kv_heads=kvh, cache_config=cache_config,
                              quant_config=quant_config, per_layer_sliding_window=dc["sliding_window"] + 1,
                              prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)                                          # (T, (nh + 2 kvh) hd)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))                           # (T, H)
        return out


class GlideCrossAttention(nn.Module):
    """Queries only: keys and values are the target's last layer's cache (post-RoPE), which this
    layer reads through KV sharing and never writes."""

    def __init__(self, hf_config, dc: dict, cache_config, quant_config, prefix: str):
        super().__init__()
        H, nh, kvh, hd = dc["hidden_size"], dc["num_attention_heads"], dc["num_key_value_heads"], dc["head_dim"]
        self.q_proj = ColumnParallelLinear(H, nh * hd, bias=dc["attention_bias"], quant_config=quant_config,
                                           prefix=f"{prefix}.q_proj")
        self.o_proj = RowParallelLinear(nh * hd, H, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if dc.get("qk_norm"):
            self.q_norm = HeadNorm(hd, dc["rms_norm_eps"])
        self.rotary_emb = rotary(hf_config, hd)
        self.attn = Attention(nh, hd, hd ** -0.5, num_kv_heads=kvh, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj(x)                                              # (T, nh hd)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q, _ = self.rotary_emb(positions, q, None)
        out, _ = self.o_proj(self.attn(q, None, None))                     # (T, H)
        return out


class GlideMLP(nn.Module):
    def __init__(self, dc: dict, quant_config, prefix: str):
        super().__init__()
        H, inter = dc["hidden_size"], dc["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(H, [inter, inter], bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, H, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(self.act(y))
        return y


class GlideBlock(nn.Module):
    def __init__(self, hf_config, dc: dict, cache_config, quant_config, prefix: str):
        super().__init__()
        H, eps = dc["hidden_size"], dc["rms_norm_eps"]
        self.self_attn = GlideSelfAttention(hf_config, dc, cache_config, quant_config, f"{prefix}.self_attn")
        self.cross_attn = GlideCrossAttention(hf_config, dc, cache_config, quant_config, f"{prefix}.cross_attn")
        self.mlp = GlideMLP(dc, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.post_self_attention_layernorm = RMSNorm(H, eps=eps)
        self.post_cross_attention_layernorm = RMSNorm(H, eps=eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        h = h + self.cross_attn(positions, self.post_self_attention_layernorm(h))
        return h + self.mlp(self.post_cross_attention_layernorm(h))


class GlideModel(nn.Module):
    def __init__(self, hf_config, dc: dict, cache_config, quant_config, prefix: str):
        super().__init__()
        self.embed_tokens: nn.Module | None = None      # the target's (vllm_proposer)
        self.layers = nn.ModuleList([GlideBlock(hf_config, dc, cache_config, quant_config, f"{prefix}.layers.0")])

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)   # (T, H)
        return self.layers[0](positions, h)


class GlideForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        require_supported()
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.config = hf_config
        self.draft_config = draft_config(hf_config)
        self.model = GlideModel(hf_config, self.draft_config, vllm_config.cache_config, vllm_config.quant_config,
                                f"{prefix}.model" if prefix else "model")
        self.lm_head: nn.Module | None = None           # the target's (vllm_proposer)
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                **_) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for key, tensor in weights:
            if key.startswith(UNUSED):
                continue
            name, shard = key, None
            for src, (dst, sid) in PACKED.items():
                if key.startswith(src + "."):
                    name, shard = dst + key[len(src):], sid
                    break
            full = "model.layers.0." + name
            if full not in params:
                raise ValueError(f"draft weight {key!r} is not a GLIDE block key")
            p = params[full]
            if shard is None:
                getattr(p, "weight_loader", default_weight_loader)(p, tensor)
            else:
                p.weight_loader(p, tensor, shard)
            loaded.add(full)
        return loaded
