"""Target-family registry: what the GLIDE draft needs from each family of target, in one place.

Per family (keyed by the transformers `model_type`):

    embeddings      the target's input embedding module (the draft's input; frozen)
    lm_head         the target's output projection (both losses; frozen)
    decoder         the base model that runs the layers (the last layer's post-RoPE K/V are read
                    from its KV cache at ``kv_layer``: RoPE and any q/k norm already applied)
    rotary          the target's own RoPE tables at given positions; every rope scaling type the
                    family's transformers class implements (linear, dynamic, yarn, llama3,
                    longrope, ...) therefore reaches the draft unchanged
    draft layout    how the draft layer mirrors the family's decoder layer: q/k/v bias and
                    per-head q/k RMSNorm (Qwen3); the exported draft's architecture name

Adding a family = one `Family(...)` entry below, its name in
`longspec.project.targets.SUPPORTED_FAMILIES` (the list the CLI and trainer refuse with), and
its tiny target in tests/trainer/conftest.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from longspec.project.targets import SUPPORTED_FAMILIES, refusal


@dataclass(frozen=True)
class Family:
    name: str                 # transformers model_type
    architecture: str         # the exported draft's class name (<Family>GlideDecoderLayer)
    attention_bias: bool      # q/k/v projections of the draft's attentions carry a bias
    qk_norm: bool             # per-head RMSNorm on q and k before RoPE (Qwen3)

    # The accessors below are the same for every family transformers ships today; a family
    # whose model is laid out differently overrides them in a subclass.
    def decoder(self, model: nn.Module) -> nn.Module:
        return getattr(model, model.base_model_prefix)

    def embeddings(self, model: nn.Module) -> nn.Module:
        return model.get_input_embeddings()

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.get_output_embeddings()

    def kv_layer(self, config: Any) -> int:
        """The layer whose post-RoPE K/V the draft cross-attends to: the last one."""
        return config.num_hidden_layers - 1

    def rotary(self, model: nn.Module, like: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin), each (B, T, hd): the target's RoPE tables, scaling included."""
        return self.decoder(model).rotary_emb(like, position_ids)


# The reference draft (Qwen2 and Llama) builds its attentions with q/k/v biases for both
# families, so those keep them: a draft trained here loads into the reference and back. Qwen3 and
# Mistral have no reference draft; theirs mirror the target's own layer (no bias; Qwen3's q/k norms).
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", "Qwen2GlideDecoderLayer", attention_bias=True, qk_norm=False),
    Family("llama", "LlamaGlideDecoderLayer", attention_bias=True, qk_norm=False),
    Family("qwen3", "Qwen3GlideDecoderLayer", attention_bias=False, qk_norm=True),
    Family("mistral", "MistralGlideDecoderLayer", attention_bias=False, qk_norm=False),
)}
assert tuple(FAMILIES) == SUPPORTED_FAMILIES, "longspec.model.families and targets.SUPPORTED_FAMILIES disagree"


def get_family(config: Any) -> Family:
    """The registry entry for a transformers config; ValueError with the one refusal sentence."""
    problem = refusal(getattr(config, "model_type", None), getattr(config, "hidden_act", "silu"))
    if problem:
        raise ValueError(problem)
    return FAMILIES[config.model_type]


def rope_params(hf_config: Any) -> tuple[float, str]:
    """(rope_theta, rope_type): transformers 5 keeps them in rope_parameters, 4.x on the config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), str(params.get("rope_type", "default"))
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(getattr(hf_config, "rope_theta", 10000.0)), str(rope_type)
