"""Tiny real transformers targets (one per family in longspec.model.families), built in-process from
configs, seeded.

Nothing is downloaded: the models are random-init ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` /
``Qwen3ForCausalLM`` / ``MistralForCausalLM`` small enough that a forward + backward takes
milliseconds on a CPU. The Qwen3 one has an explicit ``head_dim`` unlike hidden / heads (as the
real Qwen3 models do), and q/k norms with non-trivial weights so that a draft that skipped them
would not match.
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
FAMILIES = ("qwen2", "llama", "qwen3", "mistral")
ROPE_THETA = {"qwen2": 10000.0, "llama": 500000.0, "qwen3": 1000000.0, "mistral": 1000000.0}
QWEN3_HEAD_DIM = 32          # explicit, != hidden / heads = 16


def tiny_config(family: str, **overrides):
    """The transformers config of a tiny ``family`` target."""
    import transformers

    dims = {**TINY_DIMS, **overrides}
    common = dict(rope_theta=ROPE_THETA[family], tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**dims, **common)
    if family == "llama":
        return transformers.LlamaConfig(**dims, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": QWEN3_HEAD_DIM, **dims}, **common)
    if family == "mistral":
        return transformers.MistralConfig(**{"sliding_window": 4096, **dims}, **common)
    raise ValueError(family)


def make_tiny_target(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-init tiny causal LM of ``family`` in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():                    # norms away from 1, so that a skipped norm shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model.float().eval()


def head_dim(family: str) -> int:
    return QWEN3_HEAD_DIM if family == "qwen3" else TINY_DIMS["hidden_size"] // TINY_DIMS["num_attention_heads"]


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


@pytest.fixture
def fused_standins(monkeypatch):
    """The CPU stand-ins for flash-attn and Liger in place (tests/standins): the project's own
    dispatch takes its fused path on CPU tensors. Yields the stand-in modules (their CALLERS)."""
    from tests import standins

    yield standins.install(monkeypatch)
    standins.uninstall()


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "standin"])
def fused_env(request, monkeypatch):
    """Where a fused-kernel test runs: "cuda" (the real kernels; gpu-marked, skipped without CUDA)
    or the CPU under the stand-ins. Yields the device to put tensors on."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        yield "cuda"
        return
    from tests import standins

    standins.install(monkeypatch)
    yield "cpu"
    standins.uninstall()
