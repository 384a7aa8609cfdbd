"""Tree speculative decoding: greedy equals the target's greedy output, the oracle reaches the
tree's maximum tau, the degenerate tree is the chain, and speculative sampling follows the
target's distribution (chi-square over many seeded runs). Tiny real Qwen2 / Llama targets, fp32.
"""
from __future__ import annotations

import math

import pytest
import torch

from longspec.decode import tree_attn
from longspec.decode.chain import GlideProposer, _cache_kwarg, cache_length, crop_cache, greedy_decode, new_cache, speculative_decode
from longspec.decode.tree import (
    GlideTreeProposer, TokenTree, grow_level, keep_path, parse_tree_shape, prefill_logits, sample_decode,
    tree_decode, verify_tree,
)
from tests.trainer.conftest import make_tiny_target
from tests.trainer.test_spec_decode import _deterministic, prompt, random_glide  # noqa: F401 (fixture)

SHAPES = [(1, 1, 1, 1), (2, 3, 1), (4, 16, 16, 16, 16), (6,)]


class TargetTreeProposer:
    """Grows the tree with a model's own logits (the target itself: an oracle), level by level on
    its own cache. ``noise``: a fixed per-token logit perturbation, so the proposal q differs from
    the target's p (for the sampling test). ``hide_after``: greedy proposals lose the target's
    argmax below that depth (partial acceptance, exercises the cache rollback). ``sure``: the
    target's argmax made near-certain, so the beam always keeps the target's greedy path."""

    def __init__(self, model, noise: float = 0.0, hide_after: int | None = None, seed: int = 0, sure: bool = False):
        self.model, self.hide_after, self.sure = model, hide_after, sure
        V = model.config.vocab_size
        self.bias = noise * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
        self.cache = None

    def start(self, prompt, cache):
        self.cache = new_cache()
        prefill_logits(self.model, prompt[:, :-1], self.cache) if prompt.shape[1] > 1 else None

    def rollback(self, valid):
        pass

    def propose_tree(self, seq, cache, shape, temperature=0.0, generator=None):
        from longspec.decode.tree import _log_proposal

        crop_cache(self.cache, min(cache_length(self.cache), seq.shape[1] - 1))
        gap = seq[:, cache_length(self.cache):-1]
        if gap.shape[1]:
            prefill_logits(self.model, gap, self.cache)
        tree, parents, scores = TokenTree([int(seq[0, -1])]), [0], torch.zeros(1)
        for d, width in enumerate(shape, 1):
            P = cache_length(self.cache)
            logits = verify_tree(self.model, tree, self.cache)[parents]          # (m, V)
            crop_cache(self.cache, P)
            logits = logits + self.bias[[tree.tokens[i] for i in parents]]
            if self.sure:
                logits.scatter_add_(1, logits.argmax(-1, keepdim=True), torch.full((len(parents), 1), 50.0))
            if self.hide_after is not None and d > self.hide_after:
                logits.scatter_(1, logits.argmax(-1, keepdim=True), float("-inf"))
            logp = _log_proposal(logits, temperature)
            if temperature > 0:
                for row, node in enumerate(parents):
                    tree.q[node] = logp[row].exp()
            picks = grow_level(logp, scores, width, temperature > 0, generator)
            parents = [tree.add(parents[r], t) for r, t, _ in picks]
            scores = torch.tensor([s for _, _, s in picks])
        return tree


def test_tree_shape_is_validated():
    assert parse_tree_shape([4, 16]) == (4, 16)
    for bad in ([], [0, 3], [600, 600]):
        with pytest.raises(ValueError):
            parse_tree_shape(bad)


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_greedy_equals_target_greedy(family, tiny_target, shape):
    for seed in range(2):
        p = prompt(9 + 7 * seed, seed)
        ref = greedy_decode(tiny_target, p, 40)
        glide = random_glide(tiny_target, std=0.3, seed=seed)
        got = tree_decode(tiny_target, GlideTreeProposer(glide.target, glide.draft), p, shape, 40)
        assert got.tokens == ref.tokens
        assert 1.0 <= got.tau <= len(shape) + 1


def test_degenerate_tree_is_the_chain(family, tiny_target):
    """Shape (1,)*gamma: the same proposals, the same accepted counts (so the same tau) as the chain."""
    p = prompt(14, 4)
    glide = random_glide(tiny_target, std=0.3, seed=2)
    chain = speculative_decode(tiny_target, GlideProposer(glide.target, glide.draft), p, 4, 40)
    tree = tree_decode(tiny_target, GlideTreeProposer(glide.target, glide.draft), p, (1, 1, 1, 1), 40)
    assert tree.tokens == chain.tokens and tree.accepted == chain.accepted and tree.tau == chain.tau


@pytest.mark.parametrize("shape", [(3, 5, 5), (1, 1, 1, 1), (4, 16, 16, 16, 16)])
def test_oracle_tree_reaches_maximum_tau(family, tiny_target, shape):
    p = prompt(13, 3)
    D = len(shape)
    ref = greedy_decode(tiny_target, p, 41)
    got = tree_decode(tiny_target, TargetTreeProposer(tiny_target, sure=True), p, shape, 41)
    assert got.tokens == ref.tokens
    assert got.tau == D + 1                                           # every round: D accepted + bonus
    assert got.target_forwards == math.ceil(40 / (D + 1))


@pytest.mark.parametrize("hide_after", [0, 1, 2])
def test_partial_acceptance_rolls_the_cache_back(family, tiny_target, hide_after):
    """The target's argmax hidden below depth `hide_after`: every round accepts exactly that many
    draft tokens + the bonus, and the kept K/V (moved out of the tree block) stay right."""
    p = prompt(11, 5)
    ref = greedy_decode(tiny_target, p, 37)
    got = tree_decode(tiny_target, TargetTreeProposer(tiny_target, hide_after=hide_after, sure=True), p, (3, 6, 6, 6), 37)
    assert got.tokens == ref.tokens
    assert set(got.accepted) == {hide_after + 1}


def test_keep_path_moves_the_accepted_nodes(tiny_target):
    """After a tree forward and keep_path, the cache equals a plain forward of the accepted tokens."""
    p = prompt(10, 1)
    tree = TokenTree([5])
    a, b = tree.add(0, 7), tree.add(0, 9)
    c, _ = tree.add(b, 3), tree.add(a, 11)
    cache = new_cache()
    prefill_logits(tiny_target, p, cache)
    logits = verify_tree(tiny_target, tree, cache)
    keep_path(cache, len(tree), [0, b, c])
    ref_cache = new_cache()
    ref = tiny_target(input_ids=torch.cat([p, torch.tensor([[5, 9, 3]])], 1), use_cache=True,
                      **{_cache_kwarg(tiny_target): ref_cache}).logits[0]
    assert cache_length(cache) == cache_length(ref_cache) == 13
    for (k, v), layer in zip([(l.keys, l.values) for l in cache.layers], ref_cache.layers):
        torch.testing.assert_close(k, layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, layer.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[[0, b, c]], ref[-3:], atol=1e-4, rtol=1e-4)


def test_hybrid_tree_attention_equals_the_reference():
    torch.manual_seed(0)
    T, P = 7, 19
    tree = TokenTree([0])
    for par in (0, 0, 1, 1, 2, 4):
        tree.add(par, 0)
    q = torch.randn(1, 4, T, 16)
    k, v = torch.randn(1, 2, P + T, 16), torch.randn(1, 2, P + T, 16)
    ref = tree_attn.tree_verify_attention(q, k, v, tree.ancestor_mask(), impl="reference")
    torch.testing.assert_close(tree_attn.tree_verify_attention(q, k, v, tree.ancestor_mask(), impl="hybrid"), ref)


def test_installed_hybrid_path_verifies_like_the_reference(family):
    """The transformers hook (what CUDA uses, with a flash prefix) gives the same tree logits as the
    model's own attention with the 4D mask; here its prefix part runs in torch."""
    model = make_tiny_target(family)
    tree = TokenTree([3])
    for par, tok in ((0, 4), (0, 8), (1, 2), (2, 6), (3, 1)):
        tree.add(par, tok)
    p = prompt(15, 2)
    outs = []
    for install in (False, True):
        if install:
            tree_attn.install(model)
        cache = new_cache()
        prefill_logits(model, p, cache)
        outs.append(verify_tree(model, tree, cache))
    assert tree_attn.installed(model)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_flash_prefix_matches_the_reference(fused_env):
    """The prefix part on flash-attn (real on CUDA, the stand-in on CPU) merged with the tree part by
    log-sum-exp equals one masked attention over prefix + tree."""
    if not tree_attn.fused_available(torch.device(fused_env), torch.bfloat16):
        pytest.skip("needs flash-attn")
    torch.manual_seed(0)
    T, P = 21, (300 if fused_env == "cuda" else 60)
    tree = TokenTree([0])
    for i in range(1, T):
        tree.add((i - 1) // 3, 0)
    q = torch.randn(1, 8, T, 64, device=fused_env, dtype=torch.bfloat16)
    k = torch.randn(1, 2, P + T, 64, device=fused_env, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = tree.ancestor_mask(fused_env)
    ref = tree_attn.tree_verify_attention(q.float(), k.float(), v.float(), mask, impl="reference")
    got = tree_attn.tree_verify_attention(q, k, v, mask, impl="flash")
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- sampling

def _chi2_bound(dof: int, z: float = 3.3) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) (z = 3.3: about p = 0.0005)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(counts: torch.Tensor, expected_p: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic with bins of expected count < 5 merged into one."""
    exp = expected_p * n
    big = exp >= 5
    obs_b, exp_b = counts[big].float(), exp[big]
    obs_s, exp_s = counts[~big].sum().float(), exp[~big].sum()
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    bins = int(big.sum())
    if exp_s >= 5:
        stat += float((obs_s - exp_s) ** 2 / exp_s)
        bins += 1
    return stat, bins - 1


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 4, 2)])
def test_speculative_sampling_follows_the_target_distribution(shape):
    """Tokens 2 and 3 of many seeded runs (both go through tree acceptance or rejection) against
    their exact marginals under the target, computed by enumerating the earlier tokens."""
    V, T = 12, 0.8
    model = make_tiny_target("qwen2", seed=4, vocab_size=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)                              # peaked, not near-uniform, distributions
    p = prompt(6, 9) % V
    proposer = TargetTreeProposer(model, noise=1.5, seed=1)
    runs = 400
    second, third = torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.long)
    accepted = []
    for seed in range(runs):
        g = torch.Generator().manual_seed(seed)
        out = tree_decode(model, proposer, p, shape, 3, temperature=T, generator=g)
        second[out.tokens[1]] += 1
        third[out.tokens[2]] += 1
        accepted += out.accepted
    with torch.no_grad():                                          # exact marginals by enumeration
        probs = lambda ids: torch.softmax(model(input_ids=ids).logits[:, -1].float() / T, -1)  # noqa: E731
        p1 = probs(p)[0]                                                         # (V,)
        seq2 = torch.cat([p.repeat(V, 1), torch.arange(V)[:, None]], 1)          # (V, P+1)
        p2_given = probs(seq2)                                                   # (V, V)
        m2 = p1 @ p2_given
        seq3 = torch.cat([seq2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3_given = probs(seq3).view(V, V, V)
        m3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    for counts, marg in ((second, m2), (third, m3)):
        stat, dof = _chi2(counts, marg, runs)
        assert dof >= 3 and stat < _chi2_bound(dof), (stat, dof, counts.tolist(), (marg * runs).round().tolist())
    assert max(accepted) >= 2 and min(accepted) == 1                 # both acceptance and rejection happened
    # the test has power: token 2 as the draft proposes it (q, not p) is told apart
    with torch.no_grad():
        logits2 = model(input_ids=seq2).logits[:, -1].float() + proposer.bias[torch.arange(V)]
        q2 = p1 @ torch.softmax(logits2 / T, -1)
    stat, dof = _chi2(second, q2, runs)
    assert stat > _chi2_bound(dof), "the draft's distribution passes too: the test cannot tell p from q"


def test_sample_decode_at_temperature_zero_is_greedy(tiny_target):
    p = prompt(10, 2)
    assert sample_decode(tiny_target, p, 20, 0.0).tokens == greedy_decode(tiny_target, p, 20).tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chain_and_tree_decoding_run_where_the_model_is(tiny_target, device):
    """Both decoders with every tensor on the model's device (each CPU-made tensor that meets a
    CUDA one is a crash there; the CPU cannot see one). fp32, so greedy is exact on either."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = prompt(11, 5)
    ref = greedy_decode(tiny_target, p, 24)
    model = tiny_target.to(device)
    try:
        glide = random_glide(model, std=0.3, seed=3)
        glide.draft.to(device)
        chain = speculative_decode(model, glide, p.to(device), 4, 24)
        tree = tree_decode(model, GlideTreeProposer(glide.target, glide.draft), p.to(device), (3, 4, 2), 24)
    finally:
        tiny_target.to("cpu")
    assert chain.tokens == ref.tokens and tree.tokens == ref.tokens
