"""attention.attention (the ladder) and kernels.linear_cross_entropy against naive loops / full logits."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longspec.model import attention, kernels

# ----------------------------------------------------------------------------- naive references

def rule_sees(t: int, s: int, window, lag: int) -> bool:
    """The documented semantics, spelled out: window W -> keys t-W..t (flash-attn's
    window_size=(W, -1): W + 1 keys); lag j -> keys 0..t-j."""
    last = t - lag
    first = 0 if window is None else last - window
    return first <= s <= last


def naive_attention(q, k, v, window=None, lag=0, pad=None):
    """Per-query loop in float64; rows with no visible key give 0."""
    B, nh, T, hd = q.shape
    kvh, S = k.shape[1], k.shape[2]
    g = nh // kvh
    out = torch.zeros_like(q)
    rows = []
    for b in range(B):
        for h in range(nh):
            for t in range(T):
                keys = [s for s in range(S) if rule_sees(t, s, window, lag) and (pad is None or bool(pad[b, s]))]
                if not keys:
                    rows.append(torch.zeros(hd, dtype=q.dtype))
                    continue
                kk = k[b, h // g, keys]                      # (n, hd)
                vv = v[b, h // g, keys]
                w = torch.softmax(kk @ q[b, h, t] / math.sqrt(hd), dim=0)
                rows.append(w @ vv)
    return torch.stack(rows).view(B, nh, T, hd)


def rand_qkv(B=2, nh=4, kvh=2, T=23, hd=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T, hd, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(B, kvh, T, hd, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(B, kvh, T, hd, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


# ----------------------------------------------------------------------------- masks

@pytest.mark.parametrize("window,lag", [(None, 0), (1, 0), (4, 0), (None, 1), (None, 3), (3, 2), (50, 4)])
def test_visible_mask_matches_rule(window, lag):
    T = 12
    got = attention.visible_mask(torch.arange(T), torch.arange(T), window, lag)
    want = torch.tensor([[rule_sees(t, s, window, lag) for s in range(T)] for t in range(T)])
    assert torch.equal(got, want)


def test_window_and_lag_examples():
    m = attention.visible_mask(torch.arange(10), torch.arange(10), 3, 0)
    assert m[9].nonzero().flatten().tolist() == [6, 7, 8, 9]     # window 3: t-3..t, 4 keys
    m = attention.visible_mask(torch.arange(10), torch.arange(10), 0, 0)
    assert m[9].nonzero().flatten().tolist() == [9]              # window 0: itself only
    m = attention.visible_mask(torch.arange(10), torch.arange(10), None, 2)
    assert m[5].nonzero().flatten().tolist() == [0, 1, 2, 3]      # lag 2: 0..t-2
    assert not m[1].any()                                         # t < lag sees nothing


# ----------------------------------------------------------------------------- SDPA path == naive

@pytest.mark.parametrize("window,lag", [(None, 0), (5, 0), (None, 3), (4, 2), (1, 0), (None, 30)])
@pytest.mark.parametrize("q_chunk", [16, None])
def test_sdpa_attention_matches_naive_values_and_grads(window, lag, q_chunk):
    q, k, v = rand_qkv(T=37)
    got = attention.attention(q, k, v, window=window, lag=lag, impl="sdpa", q_chunk=q_chunk)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    want = naive_attention(q2, k2, v2, window=window, lag=lag)
    torch.testing.assert_close(got, want)
    dout = torch.randn_like(got)
    (got * dout).sum().backward()
    (want * dout).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad)


def test_sdpa_attention_with_padding_matches_naive():
    q, k, v = rand_qkv(T=19)
    pad = torch.ones(2, 19, dtype=torch.long)
    pad[0, :5] = 0          # left padding on row 0: its first queries see nothing at all
    pad[1, 15:] = 0         # right padding on row 1
    got = attention.attention(q, k, v, window=6, key_padding_mask=pad, impl="sdpa", q_chunk=16)
    want = naive_attention(q.detach(), k.detach(), v.detach(), window=6, pad=pad)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_lag_rows_are_zero_and_grads_finite():
    q, k, v = rand_qkv(T=10, dtype=torch.float32)
    out = attention.attention(q, k, v, lag=4)
    assert torch.count_nonzero(out[:, :, :4]) == 0
    assert torch.count_nonzero(out[:, :, 4:]) > 0
    out.pow(2).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.count_nonzero(q.grad[:, :, :4]) == 0


def test_lag_longer_than_sequence_gives_zeros():
    q, k, v = rand_qkv(T=3, dtype=torch.float32)
    out = attention.attention(q, k, v, lag=5)
    assert out.shape == q.shape and torch.count_nonzero(out) == 0


def test_non_causal_gqa_matches_repeated_heads():
    q, k, v = rand_qkv(T=9)
    got = attention.attention(q, k, v, causal=False)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, kr, vr))


def test_attention_rejects_bad_shapes():
    q, k, v = rand_qkv()
    with pytest.raises(ValueError, match="multiple"):
        attention.attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="causal"):
        attention.attention(q, k, v, causal=False, lag=1)


def test_backend_on_cpu_is_reference():
    assert kernels.backend("cpu") == {"attention": "sdpa", "linear_cross_entropy": "chunked"}


@pytest.fixture
def kernel_mode():
    yield kernels.set_mode
    kernels.set_mode("auto")


def test_fused_mode_refuses_to_fall_back(kernel_mode):
    kernel_mode("fused")
    with pytest.raises(kernels.KernelUnavailable, match="kernels = fused but no CUDA device"):
        kernels.backend("cpu")
    kernel_mode("reference")
    assert kernels.backend("cpu") == {"attention": "sdpa", "linear_cross_entropy": "chunked"}
    with pytest.raises(ValueError, match="auto, fused, reference"):
        kernels.set_mode("fast")


def test_flash_blockers_name_the_reason():
    q, k, _ = rand_qkv(T=6, dtype=torch.float32)
    why = attention.flash_blocker(q, k, True, None)
    assert why and ("not installed" in why or "CUDA" in why)
    assert attention._right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
    assert not attention._right_padded(torch.tensor([[0, 1, 1]]).bool())


# ----------------------------------------------------------------------------- linear cross entropy

def naive_ce(hidden, weight, labels, ignore_index=-100):
    return F.cross_entropy((hidden.float() @ weight.float().T), labels, ignore_index=ignore_index)


def ce_inputs(N=53, H=16, V=37, seed=0, ignore_frac=0.3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype)
    weight = torch.randn(V, H, generator=gen, dtype=dtype) * 0.5
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < ignore_frac] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_linear_ce_matches_naive_loss_and_grads(chunk):
    hidden, weight, labels = ce_inputs()
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = kernels.linear_cross_entropy(h1, w1, labels, chunk_size=chunk, impl="chunked")
    want = naive_ce(h2, w2, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    (got * 3.0).backward()
    (want * 3.0).backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_linear_ce_bf16_inputs_are_computed_in_fp32():
    hidden, weight, labels = ce_inputs(dtype=torch.bfloat16)
    got = kernels.linear_cross_entropy(hidden, weight, labels)
    want = naive_ce(hidden, weight, labels)     # fp32 logits from the same bf16 values
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_chunked_linear_ce_reads_a_bf16_lm_head_without_an_fp32_copy():
    """On CUDA the chunked loss (a GPU without Liger) multiplies the bf16 lm_head into fp32 logits:
    the loss of the same bf16 values in fp32, and no (V, H) fp32 copy of the weight in its peak."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, weight, labels = (x.cuda() for x in ce_inputs(N=256, H=512, V=32000, ignore_frac=0.1,
                                                           dtype=torch.bfloat16))
    hidden.requires_grad_(True)
    want = naive_ce(hidden.detach(), weight, labels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = kernels.linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_size=64)
    got.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert extra < weight.numel() * 4, f"{extra:,} bytes above the inputs: an fp32 copy of the weight"


def test_linear_ce_frozen_weight_gets_no_grad():
    hidden, weight, labels = ce_inputs()
    hidden.requires_grad_(True)
    kernels.linear_cross_entropy(hidden, weight, labels).backward()
    assert hidden.grad is not None and weight.grad is None


def test_linear_ce_all_ignored_is_zero_with_zero_grads():
    hidden, weight, _ = ce_inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    labels = torch.full((hidden.shape[0],), -100)
    loss = kernels.linear_cross_entropy(hidden, weight, labels)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_linear_ce_custom_ignore_index_and_bad_label():
    hidden, weight, labels = ce_inputs(ignore_frac=0.0)
    labels[:10] = 5
    got = kernels.linear_cross_entropy(hidden, weight, labels, ignore_index=5)
    torch.testing.assert_close(got, naive_ce(hidden, weight, labels, ignore_index=5))
    labels[0] = 999
    with pytest.raises(ValueError, match="vocabulary"):
        kernels.linear_cross_entropy(hidden, weight, labels, ignore_index=5)


def test_linear_ce_under_no_grad():
    hidden, weight, labels = ce_inputs()
    hidden.requires_grad_(True)
    with torch.no_grad():
        loss = kernels.linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, naive_ce(hidden, weight, labels))


# ----------------------------------------------------------------------------- fused == reference
# fused_env: the real kernels on CUDA (gpu-marked), and the CPU stand-ins (tests/standins) everywhere.

@pytest.mark.parametrize("window,lag", [(None, 0), (64, 0), (None, 3), (5, 2)])
def test_flash_attention_matches_sdpa(fused_env, window, lag):
    if kernels.backend(fused_env)["attention"] != "flash_attn":
        pytest.skip(f"needs flash-attn ({kernels.flash_unusable(fused_env, torch.bfloat16)})")
    T = 300 if fused_env == "cuda" else 70
    q, k, v = (x.detach().to(fused_env, torch.bfloat16).requires_grad_(True) for x in rand_qkv(T=T, hd=64))
    got = attention.attention(q, k, v, window=window, lag=lag, impl="flash_attn")
    want = attention.attention(q, k, v, window=window, lag=lag, impl="sdpa")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    dout = torch.randn_like(got)
    gq_flash, gk_flash = torch.autograd.grad(got, (q, k), dout)
    gq_sdpa, gk_sdpa = torch.autograd.grad(want, (q, k), dout)
    torch.testing.assert_close(gq_flash.float(), gq_sdpa.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gk_flash.float(), gk_sdpa.float(), rtol=5e-2, atol=5e-2)


def test_liger_matches_chunked(fused_env):
    if kernels.backend(fused_env)["linear_cross_entropy"] != "liger":
        pytest.skip(f"needs liger-kernel ({kernels.liger_unusable(fused_env)})")
    hidden, weight, labels = (x.to(fused_env) for x in ce_inputs(N=512, H=64, V=1000))
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    w1, w2 = weight.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    a = kernels.linear_cross_entropy(h1, w1, labels, impl="liger")
    b = kernels.linear_cross_entropy(h2, w2, labels, impl="chunked")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    a.backward()
    b.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)
