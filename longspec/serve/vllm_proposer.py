"""The GLIDE proposer: vLLM's draft_model proposer with what a GLIDE draft needs.

vLLM picks its proposer class by the speculative method's name; `install()` (plugin.register, on a
supported vLLM only) puts this subclass where the model runner finds draft_model's, and for a
draft that is not GLIDE it behaves exactly as the stock one.

What stock draft_model gets wrong for GLIDE:

1. Every draft layer gets the same causal metadata, so the cross-attention would read the target's
   cache at and past the newest token's position p: slots holding rejected drafts' K/V, or none
   written yet. Lossless still (the target verifies), acceptance lost. Here the cross-attention
   layer has its own attention group whose metadata says: each request's keys are positions
   0 .. p - 1 of its first draft step (the verified tokens whose K/V the target wrote; p is the
   position of the token the target sampled last), every query sees all of them (non-causal), and
   the length stays there for the later draft steps (longspec/decode/chain.py's GlideProposer).
2. draft_model keeps a draft's own embeddings and lm_head; GLIDE has none and uses the target's.

The cross-attention reads the target's last layer's paged cache by name
(kv_sharing_target_layer_name), as vLLM's Gemma-4 MTP drafts do, and writes nothing.

LONGSPEC_VLLM_CROSS_METADATA=stock keeps fix 1 out (a diagnostic). LONGSPEC_VLLM_TRACE=FILE appends
one JSON line per draft step: the step, each request's query position (vLLM's own), and the length
and causality the cross-attention's metadata gives the kernel (tests/serve check that the keys end
at the verified length: position - step).
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch import nn
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.worker.utils import AttentionGroup

from longspec.formats.vllmdraft import ARCHITECTURE

logger = logging.getLogger("vllm.longspec_glide")   # under vLLM's logger: its handlers print it
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
CROSS = ".cross_attn."


def is_glide(vllm_config) -> bool:
    draft = vllm_config.speculative_config.draft_model_config.hf_config
    return ARCHITECTURE in (getattr(draft, "architectures", None) or [])


def last_layer(names) -> str:
    """The attention layer of the highest layer index among ``names`` (the target's last layer)."""
    indexed = [(int(m.group(1)), n) for n in names if (m := _LAYER_INDEX.search(n))]
    if not indexed:
        raise ValueError("the target has no `layers.N.` attention layers to share")
    return max(indexed)[1]


class GlideDraftProposer(DraftModelProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.glide = is_glide(vllm_config)
        self.stock_cross = os.environ.get("LONGSPEC_VLLM_CROSS_METADATA") == "stock"
        self.cross_layers: set[str] = set()
        self.verified: torch.Tensor | None = None      # (batch,) verified length per request
        self.trace = os.environ.get("LONGSPEC_VLLM_TRACE") if self.glide else None

    # -- the target's embeddings and lm_head

    def _maybe_share_embeddings(self, target_language_model: nn.Module) -> None:
        if not self.glide:
            return super()._maybe_share_embeddings(target_language_model)
        self.model.model.embed_tokens = target_language_model.model.embed_tokens

    def _maybe_share_lm_head(self, target_language_model: nn.Module) -> None:
        if not self.glide:
            return super()._maybe_share_lm_head(target_language_model)
        self.model.lm_head = target_language_model.lm_head

    # -- the cross-attention reads the target's last layer

    def load_model(self, target_model: nn.Module) -> None:
        target_layers = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase))
        super().load_model(target_model)
        if not self.glide:
            return
        last = last_layer(target_layers)
        want = getattr(self.draft_model_config.hf_config, "target_num_hidden_layers", None)
        have = int(_LAYER_INDEX.search(last).group(1)) + 1
        if want is not None and want != have:
            raise ValueError(f"the GLIDE draft was exported for a target of {want} layers; this target has {have}")
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        for name in self._draft_attn_layer_names:
            if CROSS in name:
                layers[name].kv_sharing_target_layer_name = last
                self.cross_layers.add(name)
        logger.info("GLIDE draft: %s reads the target's %s", ", ".join(sorted(self.cross_layers)), last)

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        """The stock groups, with the cross-attention layer moved into a group of its own."""
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        if not self.glide or self.stock_cross:
            return
        groups = []
        for g in self.draft_attn_groups:
            cross = [n for n in g.layer_names if n in self.cross_layers]
            g.layer_names = [n for n in g.layer_names if n not in self.cross_layers]
            if g.layer_names:
                groups.append(g)
            if cross:
                cg = AttentionGroup(backend=g.backend, layer_names=cross, kv_cache_spec=g.kv_cache_spec,
                                    kv_cache_group_id=g.kv_cache_group_id)
                gid = g.kv_cache_group_id
                block = kernel_block_sizes[gid] if kernel_block_sizes is not None and gid < len(kernel_block_sizes) else None
                cg.create_metadata_builders(self.vllm_config, self.device, kernel_block_size=block)
                cg.glide_cross = True
                groups.append(cg)
        self.draft_attn_groups = groups

    # -- the verified length, taken where the first draft step's inputs are laid out

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        out = super().set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
                                            target_hidden_states, token_indices_to_sample, cad,
                                            num_rejected_tokens_gpu)
        if self.glide:
            _, sample_at, _ = out
            # the token each request drafts from sits at position p; the target's cache holds 0 .. p - 1
            self.verified = self.positions[sample_at].to(torch.int32).clone()
        return out

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index: int = 0):
        per_group, per_layer = [], {}
        for g in self.draft_attn_groups:
            cm = self.cross_metadata(common_attn_metadata) if getattr(g, "glide_cross", False) else common_attn_metadata
            md = g.build_metadata_for_drafting(common_attn_metadata=cm, draft_index=draft_index)
            per_group.append(md)
            for name in g.layer_names:
                per_layer[name] = md
        if self.trace and self.cross_layers and self.verified is not None:
            self._trace(draft_index, per_layer[min(self.cross_layers)], common_attn_metadata.num_reqs)
        return per_group, per_layer

    def _trace(self, step: int, md, n: int) -> None:
        pos = self.verified[:n] if step == 0 else self.positions[:n]
        line = {"step": step, "pos": pos.tolist(), "seq": md.seq_lens[:n].tolist(), "causal": bool(md.causal)}
        with open(self.trace, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def cross_metadata(self, cm):
        """``cm`` with each request's keys cut to its verified length, every query seeing all of them."""
        seq = self.verified[: cm.num_reqs]
        kw = {"seq_lens": seq, "max_seq_len": int(seq.max()) if cm.num_reqs else 0, "causal": False}
        if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
            kw["seq_lens_cpu_upper_bound"] = seq.cpu()
        return cm.replace(**kw)


def install() -> None:
    import vllm.v1.worker.gpu_model_runner as runner

    if not issubclass(runner.DraftModelProposer, GlideDraftProposer):
        runner.DraftModelProposer = GlideDraftProposer
