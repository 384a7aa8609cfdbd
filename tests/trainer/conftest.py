"""Tiny real transformers targets (Qwen2 and Llama), built in-process from configs, seeded.

Nothing is downloaded: the models are random-init ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``
small enough that a forward + backward takes milliseconds on a CPU.
"""
from __future__ import annotations

import pytest
import torch

TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,      # GQA, like the real targets
    num_hidden_layers=2,
    vocab_size=96,
    max_position_embeddings=32768,
)
FAMILIES = ("qwen2", "llama")


def make_tiny_target(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-init tiny causal LM of ``family`` in fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dims = {**TINY_DIMS, **overrides}
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**dims, rope_theta=10000.0, tie_word_embeddings=False))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims, rope_theta=500000.0, tie_word_embeddings=False))
    else:
        raise ValueError(family)
    return model.float().eval()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_target(family):
    return make_tiny_target(family)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
