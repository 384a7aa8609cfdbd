"""Decoding through the fused paths on a CPU, under the strict stand-ins (tests/standins): the draft's
attention on flash-attn in chain and tree decoding, the tree verify's flash-attn prefix merged with
the tree part, and fp32, which flash-attn refuses, kept on the exact path. Tokens equal greedy.
(The training forward, both losses and every draft gradient under the stand-ins:
test_reference_parity.py::test_fused_path_matches_the_dense_reference.)"""
from __future__ import annotations

import pytest
import torch

from longspec.model import attention, kernels
from longspec.decode import tree_attn
from longspec.decode.chain import GlideProposer, greedy_decode, new_cache, speculative_decode
from longspec.decode.tree import GlideTreeProposer, TokenTree, prefill_logits, tree_decode, verify_tree
from tests.standins import reached_from, sites
from tests.trainer.conftest import make_tiny_target
from tests.trainer.test_spec_decode import _deterministic, prompt, random_glide  # noqa: F401 (fixture)

CPU = torch.device("cpu")


def test_chain_decode_with_a_flash_draft_equals_greedy(family, fused_standins):
    """A bf16 draft (its attention on flash-attn) over an fp32 target: verification keeps greedy."""
    target = make_tiny_target(family)
    for seed in range(2):
        p = prompt(9 + 5 * seed, seed)
        ref = greedy_decode(target, p, 30)
        glide = random_glide(target, std=0.3, seed=seed)
        glide.draft.to(torch.bfloat16)
        got = speculative_decode(target, GlideProposer(glide.target, glide.draft), p, 3, 30)
        assert got.tokens == ref.tokens
    assert reached_from(fused_standins.flash.CALLERS, "decode/chain.py")
    assert sites(fused_standins.flash.CALLERS) == {("model/attention.py", "_flash_attention")}


def test_tree_decode_under_the_standins_equals_greedy(family, fused_standins):
    """What eval does on a GPU in half precision: the tree verify on the hybrid path (flash-attn over
    the cached prefix, merged by log-sum-exp with the exact tree part), the draft on flash-attn. fp16:
    in bf16 a many-token verify and a one-token forward round differently and can flip a near-tie
    (eval's own note), which the next test covers at the logits instead."""
    target = make_tiny_target(family).to(torch.float16)
    assert tree_attn.setup_verify(target, CPU, torch.float16) == "flash_attn" and tree_attn.installed(target)
    for seed in range(2):
        p = prompt(9 + 7 * seed, seed)
        ref = greedy_decode(target, p, 30)
        glide = random_glide(target, std=0.3, seed=seed)
        glide.draft.to(torch.float16)
        got = tree_decode(target, GlideTreeProposer(glide.target, glide.draft), p, (2, 3, 1), 30)
        assert got.tokens == ref.tokens
    assert ("decode/tree_attn.py", "_flash_prefix") in sites(fused_standins.flash.CALLERS)
    assert reached_from(fused_standins.flash.CALLERS, "decode/tree.py")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hybrid_verify_logits_match_the_models_own_attention(family, fused_standins, dtype):
    """The tree verify's logits on the hybrid flash path against the model's own attention with the
    4D tree mask (the exact path), same weights, same dtype."""
    tree = TokenTree([3])
    for par, tok in ((0, 4), (0, 8), (1, 2), (2, 6), (3, 1), (1, 9)):
        tree.add(par, tok)
    p = prompt(15, 2)
    outs = []
    for hybrid in (False, True):
        model = make_tiny_target(family).to(dtype)
        if hybrid:
            assert tree_attn.setup_verify(model, CPU, dtype) == "flash_attn"
        cache = new_cache()
        prefill_logits(model, p, cache)
        outs.append(verify_tree(model, tree, cache))
    assert ("decode/tree_attn.py", "_flash_prefix") in sites(fused_standins.flash.CALLERS)
    scale = outs[0].abs().max()
    torch.testing.assert_close(outs[1] / scale, outs[0] / scale, atol=3e-2, rtol=0)


def test_fp32_tree_verify_takes_the_exact_path(family, fused_standins):
    """flash-attn refuses fp32: `eval --dtype fp32 --method tree` on a GPU (or a stage trained in
    fp32 under --dtype auto) must verify on the exact path and say so, not crash at the first verify."""
    target = make_tiny_target(family)                                   # fp32
    backend = tree_attn.setup_verify(target, CPU, torch.float32)         # what eval does, then decodes
    for seed in range(2):
        p = prompt(9 + 7 * seed, seed)
        ref = greedy_decode(target, p, 30)
        glide = random_glide(target, std=0.3, seed=seed)
        got = tree_decode(target, GlideTreeProposer(glide.target, glide.draft), p, (2, 3, 1), 30)
        assert got.tokens == ref.tokens
    assert backend == "exact" and not tree_attn.installed(target)       # eval.json's backend.tree_verify
    assert not reached_from(fused_standins.flash.CALLERS, "decode/tree_attn.py")


def test_fp32_never_reaches_flash_in_the_tree_attention(fused_standins):
    """Asked for the flash prefix in fp32 anyway, the tree attention refuses clearly itself."""
    tree = TokenTree([0])
    for par in (0, 0, 1):
        tree.add(par, 0)
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 12, 16)
    assert not tree_attn.fused_available(CPU, torch.float32) and tree_attn.fused_available(CPU, torch.bfloat16)
    with pytest.raises(kernels.KernelUnavailable, match="fp16 or bf16"):
        tree_attn.tree_verify_attention(q, k, k, tree.ancestor_mask(), impl="flash")
    assert fused_standins.flash.CALLERS == []


def test_verify_backend_follows_dtype_and_device(fused_standins):
    model = make_tiny_target("qwen2")
    assert tree_attn.verify_impl(CPU, torch.bfloat16) == "flash"
    assert tree_attn.verify_impl(CPU, torch.float32) == "hybrid"
    assert tree_attn.setup_verify(model, torch.device("meta"), torch.bfloat16) == "exact"   # no fused device


def test_the_dispatch_routes_fp32_away_from_flash(fused_standins):
    """attention.attention under the stand-ins: bf16 takes flash-attn; fp32 torch's own fused rung
    where it runs (the backend says so), the SDPA path where it does not (a windowed call needing a
    backward on the CPU), or a clear refusal (fused); none ever hands fp32 to flash-attn."""
    from tests.trainer.test_kernels import rand_qkv

    assert kernels.backend(CPU) == {"attention": "flash_attn", "linear_cross_entropy": "liger"}
    assert kernels.backend(CPU, torch.bfloat16)["attention"] == "flash_attn"
    assert kernels.backend(CPU, torch.float32) == {"attention": "torch_fused", "linear_cross_entropy": "liger"}
    q, k, v = rand_qkv(T=12, dtype=torch.float32)
    attention.attention(q, k, v, window=3)
    assert fused_standins.flash.CALLERS == []
    attention.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=3)
    assert sites(fused_standins.flash.CALLERS) == {("model/attention.py", "_flash_attention")}
    kernels.set_mode("fused")
    try:
        with pytest.raises(kernels.KernelUnavailable, match="fp16 or bf16"):
            attention.attention(q, k, v, window=3)
    finally:
        kernels.set_mode("auto")
    assert len(fused_standins.flash.CALLERS) == 1
