"""The frozen target: what the GLIDE draft reads from it, and the next-token loss over its lm_head.

Shapes: B batch, T tokens, H hidden, kvh key/value heads, hd head dim.

    input_ids (B, T) -> TargetWrapper -> last-layer post-RoPE K, V  (B, kvh, T, hd)
                                         final-norm hidden          (B, T, H)
                                         llm_loss (fp32) when labels are given

Every family in longspec.model.families works: the family entry says where the embeddings, lm_head,
K/V layer and rotary embedding are.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from longspec.model import kernels
from longspec.model.families import get_family
from longspec.model.zero import gathered


@dataclass
class TargetOutput:
    k: torch.Tensor                      # (B, kvh, T, hd) last layer, post-RoPE
    v: torch.Tensor                      # (B, kvh, T, hd)
    last_hidden: torch.Tensor            # (B, T, H) after the final norm
    llm_loss: torch.Tensor | None        # the target's own next-token loss (fp32) or None


def _last_layer_cache_cls():
    from transformers import DynamicCache

    class LastLayerCache(DynamicCache):
        """A DynamicCache that stores only one layer: the other layers get their own K/V back
        unchanged (what an empty cache returns on a prefill) and nothing is kept for them."""

        def __init__(self, keep_layer: int):
            super().__init__()
            self.keep_layer = keep_layer

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx != self.keep_layer:
                return key_states, value_states
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        def kept(self) -> tuple[torch.Tensor, torch.Tensor]:
            if hasattr(self, "layers"):                          # transformers 5
                layer = self.layers[self.keep_layer]
                return layer.keys, layer.values
            return self.key_cache[self.keep_layer], self.value_cache[self.keep_layer]

    return LastLayerCache


class TargetWrapper(nn.Module):
    """A frozen transformers causal LM of a family in longspec.model.families that hands out what the
    draft needs; the family entry says where each part is."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model
        self.family = get_family(hf_model.config)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()
        self._cache_kw = "cache" if "cache" in _forward_params(self.base) else "past_key_values"

    def train(self, mode: bool = True) -> "TargetWrapper":
        return super().train(False)      # frozen: never dropout, whatever the parent does

    @property
    def config(self):
        return self.model.config

    @property
    def base(self) -> nn.Module:
        return self.family.decoder(self.model)

    @property
    def lm_head(self) -> nn.Module:
        return self.family.lm_head(self.model)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H). Calls the embedding module so ZeRO-3 hooks gather its weight."""
        return self.family.embeddings(self.model)(input_ids)

    @torch.no_grad()
    def rotary(self, position_ids: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's own RoPE tables (B, T, hd), including any rope scaling."""
        return self.family.rotary(self.model, like, position_ids)

    @torch.no_grad()
    def forward(self, input_ids, position_ids, attention_mask=None, labels=None) -> TargetOutput:
        cache = _last_layer_cache_cls()(keep_layer=self.family.kv_layer(self.config))
        out = self.base(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        k, v = cache.kept()                                          # (B, kvh, T, hd)
        T = input_ids.shape[1]
        if k is None or k.shape[-2] != T:
            raise RuntimeError(f"target cache holds {None if k is None else k.shape[-2]} positions, expected {T}")
        last_hidden = out.last_hidden_state                          # (B, T, H)
        llm_loss = None
        if labels is not None:
            with gathered(self.lm_head.weight) as w:
                llm_loss = next_token_loss(last_hidden, w, labels, attention_mask)
        return TargetOutput(k=k, v=v, last_hidden=last_hidden, llm_loss=llm_loss)


def _forward_params(module: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def next_token_loss(hidden, weight, labels, attention_mask=None, chunk_size=None) -> torch.Tensor:
    """Mean CE of hidden[:, t] predicting labels[:, t+1] (fp32, ignore_index -100, no (N, V) logits)."""
    B, T, H = hidden.shape
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask.to(labels.device) == 0, -100)
    h = hidden[:, :-1].reshape(-1, H)                               # (B*(T-1), H), the kernel upcasts
    y = labels[:, 1:].reshape(-1)                                    # (B*(T-1),)
    return kernels.linear_cross_entropy(h, weight, y, ignore_index=-100, chunk_size=chunk_size)


def load_target(path: Path, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """The target folder as a transformers causal LM in ``dtype`` (FileNotFoundError without config.json)."""
    import transformers
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target model folder {path} has no config.json")
    # None: flash-attn's where transformers finds it (and the dtype allows), else SDPA
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation or kernels.target_attn_implementation(dtype)}
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    kwargs[dtype_kw] = dtype
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


__all__ = ["TargetOutput", "TargetWrapper", "next_token_loss", "load_target"]
