"""The training model against an independent dense GLIDE reference (tests/trainer/reference_glide.py).

Forward (draft output, draft loss, target loss, the target's K/V) and every draft gradient, across
window, lag, per-sequence sinks, right padding and GQA (the tiny targets have 4 query heads over 2
KV heads), on every target family. CPU: the reference kernels in fp32 against the fp64 reference at 1e-5.
The fused kernels (flash-attn + Liger) in bf16 and fp32 against the same reference: on CUDA with the
real kernels (marked ``gpu``), and on the CPU under the strict stand-ins (tests/standins).
"""
from __future__ import annotations

import pytest
import torch

from longspec.model import kernels
from longspec.model.glide import build_glide
from tests.trainer.conftest import TINY_DIMS, make_tiny_target
from tests.trainer.reference_glide import reference_forward

CASES = [  # (window, lag, padded)
    (3, 0, False),
    (8, 1, True),
    (64, 3, True),      # a window longer than the sequence
    (5, 4, False),
]


def inputs(B=2, T=32, pad=7, padded=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY_DIMS["vocab_size"], (B, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100                                  # a masked prompt on row 0
    # per-sequence sinks: row 0 keeps none, row 1 keeps 3; both shifted by one offset
    pos = torch.arange(T).expand(B, T).clone()
    for row, sinks in enumerate((0, 3)):
        pos[row, sinks:] += 1000
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, T - pad:] = 0                             # right padding on row 1
        ids[1, T - pad:] = 0                              # the pad id; its labels are NOT -100
    return ids, labels, pos, mask if padded else None


def draft_params(model, device="cpu", dtype=torch.float64) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(device=device, dtype=dtype).clone().requires_grad_(True)
            for k, v in model.draft.named_parameters() if v.requires_grad}


def model_outputs(model, ids, labels, pos, lag, mask):
    out = model(ids, labels, pos, cross_lag=lag, attention_mask=mask)
    out["loss"].backward()
    grads = {k: p.grad.detach() for k, p in model.draft.named_parameters() if p.requires_grad}
    with torch.no_grad():
        tgt = model.target(ids, pos, attention_mask=mask)
        emb = model.target.embed(ids).to(model.draft.input_layernorm.weight.dtype)
        h = model.draft(emb, pos, tgt.k, tgt.v, cross_lag=lag, attention_mask=mask,
                        rope=model.target.rotary(pos, emb))
    return out, grads, h, tgt


def reference(target_cpu, params, ids, labels, pos, window, lag, mask, eps):
    loss, llm_loss, h = reference_forward(target_cpu, params, ids, labels, pos, window=window, lag=lag,
                                          attention_mask=mask, eps=eps)
    loss.backward()
    return loss, llm_loss, h, {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("window,lag,padded", CASES)
def test_cpu_path_matches_the_dense_reference(family, window, lag, padded):
    target = make_tiny_target(family)
    torch.manual_seed(3)
    model = build_glide(target, sliding_window=window, dtype=torch.float32)
    for p in model.draft.parameters():                    # no ones/zeros that would hide mix-ups
        torch.nn.init.normal_(p, std=0.2)
    ids, labels, pos, mask = inputs(padded=padded)
    params = draft_params(model)
    out, grads, h, tgt = model_outputs(model, ids, labels, pos, lag, mask)
    r_loss, r_llm, r_h, r_grads = reference(target, params, ids, labels, pos, window, lag, mask,
                                            model.draft.config.rms_norm_eps)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"].double(), r_loss.detach(), **tol)
    torch.testing.assert_close(out["llm_loss"].double(), r_llm.detach(), **tol)
    torch.testing.assert_close(h.double(), r_h.detach(), **tol)
    assert set(grads) == set(r_grads)
    for name in grads:
        torch.testing.assert_close(grads[name].double(), r_grads[name], **tol, msg=name)
    # the lag really cuts: the first `lag` queries got nothing from the cross-attention
    if lag:
        assert torch.count_nonzero(grads["cross_attn.q_proj.weight"]) > 0


def test_reference_is_not_blind_to_the_window_or_the_lag(family):
    """The yardstick itself: one key more in the window, or one lag less, changes its answer."""
    target = make_tiny_target(family)
    torch.manual_seed(3)
    model = build_glide(target, sliding_window=4, dtype=torch.float32)
    for p in model.draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids, labels, pos, mask = inputs(padded=True)
    eps = model.draft.config.rms_norm_eps
    params = {k: v.detach().double() for k, v in model.draft.named_parameters()}
    base = reference_forward(target, params, ids, labels, pos, window=4, lag=2, attention_mask=mask, eps=eps)[0]
    for kw in (dict(window=3, lag=2), dict(window=5, lag=2), dict(window=4, lag=1)):
        other = reference_forward(target, params, ids, labels, pos, attention_mask=mask, eps=eps, **kw)[0]
        assert abs(float(other - base)) > 1e-6, kw


# ----------------------------------------------------------------------------- fused path
# fused_env: the real kernels on CUDA (gpu-marked), and the CPU stand-ins (tests/standins) everywhere.

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window,lag,padded", CASES)
def test_fused_path_matches_the_dense_reference(fused_env, family, window, lag, padded, dtype):
    """bf16: flash-attn (or, on a GPU without it, torch's fused rung) + Liger (kernels=fused, so
    nothing falls back); fp32: torch's fused rung / SDPA + Liger (flash-attn refuses fp32). On a GPU
    without Liger this skips and says so."""
    if fused_env == "cuda" and kernels.liger_unusable("cuda"):
        pytest.skip(kernels.liger_unusable("cuda"))
    mode = "fused" if dtype == torch.bfloat16 else "auto"
    kernels.set_mode(mode)
    seen = _standin_callers(fused_env)
    try:
        chosen = kernels.backend(fused_env)
        assert chosen["linear_cross_entropy"] == "liger"
        target = make_tiny_target(family)
        torch.manual_seed(3)
        model = build_glide(make_tiny_target(family), sliding_window=window, dtype=dtype).to(fused_env)
        for p in model.draft.parameters():
            torch.nn.init.normal_(p, std=0.2)
        params = draft_params(model)                              # fp64 copies on the CPU
        ids, labels, pos, mask = inputs(padded=padded)
        dev = lambda x: None if x is None else x.to(fused_env)    # noqa: E731
        out, grads, h, _ = model_outputs(model, dev(ids), dev(labels), dev(pos), lag, dev(mask))
        r_loss, r_llm, r_h, r_grads = reference(target, params, ids, labels, pos, window, lag, mask,
                                                model.draft.config.rms_norm_eps)
    finally:
        kernels.set_mode("auto")
    if seen is not None:      # the stand-ins were really called, from the dispatch's fused paths
        from tests.standins import sites

        assert ("model/kernels.py", "linear_cross_entropy") in sites(seen["liger"])
        assert (("model/attention.py", "_flash_attention") in sites(seen["flash"])) == (dtype == torch.bfloat16)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert abs(out["loss"].item() - r_loss.item()) <= tol * max(1.0, abs(r_loss.item()))
    assert abs(out["llm_loss"].item() - r_llm.item()) <= tol * max(1.0, abs(r_llm.item()))
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    err = (h.double().cpu() - r_h.detach())[real].norm() / r_h.detach()[real].norm()
    assert err < tol, err
    assert set(grads) == set(r_grads)
    for name, g in grads.items():
        rel = (g.double().cpu() - r_grads[name]).norm() / r_grads[name].norm().clamp(min=1e-12)
        assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-3), (name, float(rel))


def _standin_callers(fused_env):
    """The stand-ins' caller lists (None on a real GPU)."""
    if fused_env == "cuda":
        return None
    from tests.standins import flash_attn_standin, liger_standin

    return {"flash": flash_attn_standin.CALLERS, "liger": liger_standin.CALLERS}
