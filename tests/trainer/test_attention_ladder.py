"""The attention ladder (longspec.model.attention): torch's fused rung against the per-query loop
(FlexAttention's forward and SDPA's causal path run on the CPU), its band BlockMask against the one
torch builds from the mask_mod, the rung each call takes, and the reference path's chunks: no host
sync per chunk, shapes that repeat, no q-sized gradient per chunk. The same comparisons on CUDA in
bf16, forward and gradients, are gpu-marked."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longspec.model import attention, kernels
from tests.trainer.test_kernels import naive_attention, rand_qkv

CASES = [(None, 0), (None, 1), (None, 3), (5, 0), (4, 2), (50, 0)]   # (window, lag)


class OpLog(TorchDispatchMode):
    """Every aten op below autograd: host syncs (``_local_scalar_dense``: .item(), bool(), int()),
    attention calls with their shapes, and q-sized slice_backward outputs."""

    def __init__(self):
        super().__init__()
        self.syncs, self.attn_shapes, self.slice_backward = 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "_local_scalar_dense" in name:
            self.syncs += 1
        if "scaled_dot_product" in name and "backward" not in name:
            self.attn_shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        out = func(*args, **(kwargs or {}))
        if "slice_backward" in name:
            self.slice_backward.append(tuple(out.shape))
        return out


# ----------------------------------------------------------------------------- torch_fused rung, CPU

@pytest.mark.parametrize("window,lag", CASES)
def test_torch_fused_forward_matches_the_rule(window, lag):
    """FlexAttention (eager, forward) for a window, SDPA's causal path on shifted queries without:
    both equal the per-query loop, GQA, rows before the lag 0."""
    q, k, v = (x.detach() for x in rand_qkv(T=23))
    got = attention._torch_fused_attention(q, k, v, window, lag, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(got, naive_attention(q, k, v, window=window, lag=lag))


@pytest.mark.parametrize("lag", [0, 2])
def test_torch_fused_unwindowed_grads_match_the_reference(lag):
    """The cross-attention's rung (SDPA causal, enable_gqa) has a backward on every device."""
    q1, k1, v1 = rand_qkv(T=40)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q1, k1, v1))
    a = attention._torch_fused_attention(q1, k1, v1, None, lag, 1 / math.sqrt(q1.shape[-1]))
    b = attention.attention(q2, k2, v2, lag=lag, impl="sdpa", q_chunk=16)
    torch.testing.assert_close(a, b)
    dout = torch.randn_like(a)
    for ga, gb in zip(torch.autograd.grad(a, (q1, k1, v1), dout), torch.autograd.grad(b, (q2, k2, v2), dout)):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("T,window,lag,block", [(300, 20, 0, 128), (100, 20, 3, 16), (97, None, 2, 16),
                                                (64, 0, 0, 16), (130, 200, 1, 32)])
def test_band_block_mask_equals_torchs_own(T, window, lag, block):
    """The band BlockMask built from its block structure = create_block_mask from the mask_mod
    (partial and full blocks), without ever building a dense T x T mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    ours = attention.band_block_mask(T, window, lag, torch.device("cpu"), block)
    ref = create_block_mask(attention.window_mask_mod(window, lag), None, None, T, T, device="cpu",
                            BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    n = ref.kv_num_blocks.shape[-1]
    full = lambda bm: torch.zeros(n, n, dtype=torch.bool).index_put_(   # noqa: E731
        (torch.arange(n).repeat_interleave(bm.full_kv_num_blocks[0, 0].long()),
         torch.cat([bm.full_kv_indices[0, 0, i, :c] for i, c in enumerate(bm.full_kv_num_blocks[0, 0].tolist())]).long()),
        torch.tensor(True))
    assert torch.equal(full(ours), full(ref))
    assert attention.band_block_mask(T, window, lag, torch.device("cpu"), block) is ours     # cached


def test_mask_mod_is_one_object_per_window_and_lag():
    assert attention.window_mask_mod(512, 0) is attention.window_mask_mod(512, 0)
    assert attention.window_mask_mod(512, 0) is not attention.window_mask_mod(512, 1)


# ----------------------------------------------------------------------------- the rung per call

def test_each_call_takes_the_highest_rung_that_computes_it(fused_standins):
    """Under the stand-ins (a CPU that counts as fused): bf16 -> flash-attn; fp32 -> torch's rung,
    except a windowed call with a backward (FlexAttention has none on the CPU), left padding and a
    short windowed call, which take the reference; kernels=reference -> the reference. Counted in
    CHOSEN."""
    q, k, v = rand_qkv(T=20, dtype=torch.float32)
    right = torch.ones(2, 20, dtype=torch.bool)
    right[0, 15:] = False
    left = right.flip(-1)
    calls = [
        (dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), window=4), "flash_attn"),
        (dict(q=q, k=k, v=v, lag=2), "torch_fused"),
        (dict(q=q, k=k, v=v, lag=2, key_padding_mask=right), "torch_fused"),
        (dict(q=q, k=k, v=v, lag=2, key_padding_mask=left), "sdpa"),
        (dict(q=q, k=k, v=v, window=4), "sdpa"),
        (dict(q=q.detach(), k=k.detach(), v=v.detach(), window=4), "sdpa"),         # short: one call
        (dict(q=q.detach(), k=k.detach(), v=v.detach(), window=30), "torch_fused"),  # window >= T
    ]
    for kw, want in calls:
        before = attention.CHOSEN.copy()
        attention.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
        assert attention.CHOSEN - before == {want: 1}, (kw.keys(), want)
    kernels.set_mode("reference")
    try:
        before = attention.CHOSEN.copy()
        attention.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=4)
        assert attention.CHOSEN - before == {"sdpa": 1}
    finally:
        kernels.set_mode("auto")
    with pytest.raises(kernels.KernelUnavailable, match="torch_fused requested"):
        attention.attention(q, k, v, window=4, impl="torch_fused")


def test_right_padded_rows_on_torch_fused_equal_the_reference_where_real(fused_standins):
    q, k, v = (x.detach() for x in rand_qkv(T=20))
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[1, 13:] = False
    for window, lag in ((4, 0), (None, 2)):
        got = attention.attention(q, k, v, window=window, lag=lag, key_padding_mask=pad, impl="torch_fused")
        want = naive_attention(q, k, v, window=window, lag=lag, pad=pad)
        real = pad[:, None, :, None].expand_as(got)
        torch.testing.assert_close(got[real], want[real])


# ----------------------------------------------------------------------------- the reference's chunks

def test_chunk_plan_is_nearly_equal_chunks():
    assert attention.chunk_plan(100, 1, 1, 1, "cpu", q_chunk=32) == [25, 25, 25, 25]
    assert attention.chunk_plan(101, 1, 1, 1, "cpu", q_chunk=32) == [26, 26, 26, 23]
    assert attention.chunk_plan(10, 1, 1, 1, "cpu", q_chunk=32) == [10]
    assert attention.chunk_plan(0, 1, 1, 1, "cpu") == []
    big = attention.chunk_plan(8192, 1, 28, 8192, "cuda")
    assert len(big) < len(attention.chunk_plan(8192, 1, 28, 8192, "cpu"))     # a GPU-sized budget


def test_a_windowed_reference_call_keeps_each_chunk_within_the_score_budget(monkeypatch):
    """A band chunk reads size + window keys, not window + 1: sized by the window alone, a windowed
    call took one chunk of the whole sequence by the whole sequence up to thousands of queries, and
    past them chunks of several times the budget (5x at SP 1, 9x at SP 2 in bench_sp). Every
    chunk's scores (B x nh x queries x keys, twice) stay within the budget at any length, and the
    values are the rule's."""
    monkeypatch.setitem(attention.SCORE_BUDGET, "cpu", 1 << 14)
    for T in (96, 384):
        q, k, v = (x.detach() for x in rand_qkv(T=T))
        with OpLog() as log:
            got = attention.attention(q, k, v, window=8, impl="sdpa")
        torch.testing.assert_close(got, naive_attention(q, k, v, window=8))
        assert len(log.attn_shapes) > 1
        for (b, kvh, rows, _), (_, _, keys, _) in log.attn_shapes:
            assert 2 * b * kvh * rows * keys <= 1 << 14, (T, rows, keys)     # rows: g x queries
        sizes = attention.chunk_plan(T, 2, 4, T, "cpu", window=8)
        assert 2 * 2 * 4 * sizes[0] * min(T, sizes[0] + 8) <= 1 << 14


def test_an_unpadded_lagged_reference_call_is_one_causal_call_at_any_length(monkeypatch):
    """The training step's cross-attention (no window, no padding) on the reference path: one SDPA
    call of one shape with no mask at any length, where the budget would cut the explicit mask into
    chunks reading the keys up to their last query (a shape each); values and grads equal those
    chunks' in fp32 and the per-query loop's."""
    monkeypatch.setitem(attention.SCORE_BUDGET, "cpu", 1 << 14)
    for T in (96, 384):
        q1, k1, v1 = rand_qkv(T=T, dtype=torch.float32)
        q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q1, k1, v1))
        with OpLog() as log:
            a = attention.attention(q1, k1, v1, lag=2, impl="sdpa")
        assert len(log.attn_shapes) == 1, log.attn_shapes
        with OpLog() as chunked:
            b = attention.attention(q2, k2, v2, lag=2, impl="sdpa",
                                    q_chunk=attention.chunk_plan(T, 2, 4, T, "cpu")[0])
        assert len(set(chunked.attn_shapes)) > 1                  # what the budget alone would do
        torch.testing.assert_close(a, b)
        dout = torch.randn_like(a)
        for ga, gb in zip(torch.autograd.grad(a, (q1, k1, v1), dout), torch.autograd.grad(b, (q2, k2, v2), dout)):
            torch.testing.assert_close(ga, gb)
        if T == 96:
            want = naive_attention(*(x.detach().double() for x in (q1, k1, v1)), lag=2)
            torch.testing.assert_close(a.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_reference_path_host_syncs_and_shapes_do_not_grow_with_length(padded):
    """A windowed and a lagged call, forward and backward, at 4x the length and 4x the chunks:
    the same number of host syncs (none per chunk), the windowed call's attention shapes all one
    (but the last chunk's), and no q-sized gradient written per chunk."""
    seen = {}
    for T in (64, 256):
        q, k, v = rand_qkv(T=T, dtype=torch.float32)
        pad = torch.ones(2, T, dtype=torch.bool)
        if padded:
            pad[0, :3] = False                       # left padding: the reference's own case
        with OpLog() as log:
            a = attention.attention(q, k, v, window=8, key_padding_mask=pad, impl="sdpa", q_chunk=16)
            n_self = len(log.attn_shapes)
            b = attention.attention(q, k, v, lag=3, key_padding_mask=pad, impl="sdpa", q_chunk=16)
            (a.sum() + b.sum()).backward()
        assert n_self >= T // 16 - 1
        assert len(set(log.attn_shapes[:n_self - 1])) == 1, log.attn_shapes[:n_self]
        assert tuple(q.shape) not in log.slice_backward
        seen[T] = log.syncs
        want = naive_attention(q.detach().double(), k.detach().double(), v.detach().double(), window=8,
                               pad=pad) if T == 64 else None
        if want is not None:
            torch.testing.assert_close(a.double(), want, atol=1e-5, rtol=1e-5)
    assert seen[64] == seen[256], seen


# ----------------------------------------------------------------------------- on CUDA (gpu-marked)

def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = kernels.torch_fused_unusable("cuda")
    if why:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("window,lag,padded", [(None, 0, False), (None, 3, False), (64, 0, False),
                                               (64, 0, True), (None, 2, True)])
def test_torch_fused_matches_the_reference_on_cuda(window, lag, padded):
    """bf16 on the GPU: FlexAttention (compiled) / SDPA causal against the SDPA reference, forward
    and the gradients of q, k, v; GQA 28 over 4 heads, hd 128, a length that is no multiple of 128."""
    _cuda_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = 1000
    mk = lambda h: torch.randn(2, h, T, 128, device="cuda", generator=gen).bfloat16().requires_grad_(True)  # noqa: E731
    q, k, v = mk(28), mk(4), mk(4)
    pad = None
    if padded:
        pad = torch.ones(2, T, dtype=torch.bool, device="cuda")
        pad[1, 700:] = False
    got = attention.attention(q, k, v, window=window, lag=lag, key_padding_mask=pad, impl="torch_fused")
    # q_chunk: the reference's masked chunks (unpadded and unwindowed, it would take the same
    # shifted causal call as the fused rung)
    want = attention.attention(q, k, v, window=window, lag=lag, key_padding_mask=pad, impl="sdpa", q_chunk=256)
    real = torch.ones(2, T, dtype=torch.bool, device="cuda") if pad is None else pad
    sel = real[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[sel].float(), want[sel].float(), rtol=2e-2, atol=2e-2)
    dout = torch.randn_like(got) * sel
    for name, ga, gb in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        rel = (ga.float() - gb.float()).norm() / gb.float().norm().clamp(min=1e-6)
        assert rel < 2e-2, (name, float(rel))


@pytest.mark.gpu
def test_flex_does_not_recompile_per_call():
    """The same length again, and a shorter one in the same length bucket: no new compilation."""
    _cuda_or_skip()
    import torch._dynamo.utils as du

    def run(T):
        q = torch.randn(1, 28, T, 128, device="cuda", dtype=torch.bfloat16)
        # k and v apart, as a model's are (one tensor for both is an alias dynamo guards on, and the
        # padded bucket's copies are not aliases: that alone compiled a second graph on an H200)
        k, v = (torch.randn(1, 4, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        attention.attention(q, k, v, window=64, impl="torch_fused")       # the mask_mod of the test above

    run(1024)
    du.counters.clear()
    for T in (1024, 1000, 1024):
        run(T)
    assert du.counters["stats"].get("unique_graphs", 0) == 0, dict(du.counters["stats"])


@pytest.mark.gpu
def test_liger_reads_a_bf16_lm_head():
    """Liger with the lm_head in bf16 (no fp32 copy) against the chunked fp32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = kernels.liger_unusable("cuda")
    if why:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 256, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(3000, 256, device="cuda", generator=gen) * 0.05).bfloat16()
    y = torch.randint(0, 3000, (512,), device="cuda", generator=gen)
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    a = kernels.linear_cross_entropy(h1, w, y, impl="liger")
    b = kernels.linear_cross_entropy(h2, w, y, impl="chunked")
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    a.backward()
    b.backward()
    rel = (h1.grad.float() - h2.grad.float()).norm() / h2.grad.float().norm()
    assert rel < 2e-2, float(rel)
