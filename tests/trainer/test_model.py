"""GLIDE draft, frozen target wrapper and the training model, on tiny real targets of every family."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from longspec.model.glide import DraftConfig, GlideDraft, GlideModel, build_glide
from longspec.training.positions import anchor_offset_position_ids
from longspec.model.target import TargetWrapper
from tests.trainer.conftest import ROPE_THETA, TINY_DIMS, head_dim, make_tiny_target

# The LongSpec reference draft layer (Qwen2GlideDecoderLayer / LlamaGlideDecoderLayer): both
# attentions have q/k/v/o projections, q/k/v with bias, o without; SwiGLU MLP; three RMSNorms.
REFERENCE_KEYS = sorted(
    [f"{attn}.{p}_proj.{t}" for attn in ("self_attn", "cross_attn") for p in "qkv" for t in ("weight", "bias")]
    + [f"{attn}.o_proj.weight" for attn in ("self_attn", "cross_attn")]
    + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    + [f"{n}.weight" for n in ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm")]
)


def expected_keys(family: str) -> list[str]:
    """Qwen2 / Llama: the reference layout. Qwen3 / Mistral mirror their own layer: no q/k/v bias,
    and Qwen3 adds per-head q/k norms to both attentions."""
    if family in ("qwen2", "llama"):
        return REFERENCE_KEYS
    keys = [k for k in REFERENCE_KEYS if not k.endswith("_proj.bias")]
    if family == "qwen3":
        keys += [f"{attn}.{n}_norm.weight" for attn in ("self_attn", "cross_attn") for n in "qk"]
    return sorted(keys)


def batch(B=2, T=24, vocab=TINY_DIMS["vocab_size"], seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100                      # a masked prompt
    pos = anchor_offset_position_ids(T, B, anchors=4, max_offset=5000, generator=g)
    return ids, labels, pos


def glide(target, window=8):
    torch.manual_seed(1)
    return build_glide(target, sliding_window=window, dtype=torch.float32)


# ----------------------------------------------------------------------------- config

def test_draft_config_from_target(family, tiny_target):
    cfg = DraftConfig.from_target_config(tiny_target.config, sliding_window=256)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 128, 4, 2)
    assert cfg.head_dim == head_dim(family) and cfg.family == family and cfg.sliding_window == 256
    assert cfg.rope_theta == ROPE_THETA[family]
    assert cfg.max_position_embeddings == 32768 and cfg.rope_type == "default"
    assert cfg.attention_bias is (family in ("qwen2", "llama"))     # reference layout for those two
    assert cfg.qk_norm is (family == "qwen3")


def test_draft_config_reads_transformers4_style_rope_fields():
    old = SimpleNamespace(model_type="llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=123.0, max_position_embeddings=64,
                          rope_scaling={"type": "linear", "factor": 2.0}, hidden_act="silu")
    cfg = DraftConfig.from_target_config(old)
    assert cfg.rope_theta == 123.0 and cfg.rope_type == "linear" and cfg.head_dim == 8


def test_draft_config_rejects_other_families():
    from longspec.project.targets import refusal

    with pytest.raises(ValueError) as e:
        DraftConfig.from_target_config(SimpleNamespace(model_type="gpt2"))
    assert str(e.value) == refusal("gpt2", "silu")
    with pytest.raises(ValueError, match="activation 'gelu'.*qwen2, llama, qwen3 and mistral"):
        DraftConfig.from_target_config(SimpleNamespace(model_type="llama", hidden_act="gelu"))


# ----------------------------------------------------------------------------- draft block

def test_draft_state_dict_matches_reference_layout(family, tiny_target):
    draft = GlideDraft(DraftConfig.from_target_config(tiny_target.config))
    assert sorted(draft.state_dict()) == expected_keys(family)
    sd, hd = draft.state_dict(), head_dim(family)
    assert sd["self_attn.q_proj.weight"].shape == (4 * hd, 64)
    assert sd["self_attn.k_proj.weight"].shape == (2 * hd, 64)  # GQA: kvh * hd
    assert sd["self_attn.o_proj.weight"].shape == (64, 4 * hd)
    assert sd["mlp.gate_proj.weight"].shape == (128, 64)


def test_forward_shapes(family, tiny_target):
    model = glide(tiny_target)
    ids, labels, pos = batch()
    tgt = model.target(ids, pos)
    assert tgt.k.shape == tgt.v.shape == (2, 2, 24, head_dim(family))
    assert tgt.last_hidden.shape == (2, 24, 64) and tgt.llm_loss is None
    h = model.draft(model.target.embed(ids), pos, tgt.k, tgt.v, cross_lag=2, rope=model.target.rotary(pos, tgt.last_hidden))
    assert h.shape == (2, 24, 64)
    out = model(ids, labels, pos, cross_lag=3)
    assert set(out) == {"loss", "llm_loss"}
    assert out["loss"].shape == () and out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])


def test_only_draft_parameters_get_gradients(family, tiny_target):
    model = glide(tiny_target)
    model.train()
    ids, labels, pos = batch()
    model(ids, labels, pos, cross_lag=2)["loss"].backward()
    assert all(p.grad is None for p in model.target.parameters())
    assert not any(p.requires_grad for p in model.target.parameters())
    trainable = dict((n, p) for n, p in model.draft.named_parameters() if p.requires_grad)
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    # cross_attn k/v projections exist only for the reference layout: frozen, unused
    frozen = sorted(n for n, p in model.draft.named_parameters() if not p.requires_grad)
    assert frozen == [k for k in expected_keys(family) if k.startswith(("cross_attn.k_", "cross_attn.v_"))]
    assert model.trainable_parameters() == list(trainable.values())
    assert model.target.model.training is False          # train() on the parent keeps the target in eval


def test_target_kv_are_the_last_layers_post_rope_kv(family, tiny_target):
    """K/V from the cache == the last attention's own k_proj / v_proj outputs, RoPE applied."""
    ids, _, pos = batch(T=20)
    wrapper = TargetWrapper(tiny_target)
    attn = tiny_target.model.layers[-1].self_attn
    seen = {}
    hooks = [attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o)),
             attn.v_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("v", o))]
    out = wrapper(ids, pos)
    for h in hooks:
        h.remove()
    B, T, kvh, hd = 2, 20, 2, head_dim(family)
    k_raw = seen["k"].view(B, T, kvh, hd)
    k_raw = (attn.k_norm(k_raw) if family == "qwen3" else k_raw).transpose(1, 2)   # Qwen3: norm, then RoPE
    v_raw = seen["v"].view(B, T, kvh, hd).transpose(1, 2)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cos, sin = tiny_target.model.rotary_emb(k_raw, pos)
    _, k_rope = modeling.apply_rotary_pos_emb(k_raw, k_raw, cos, sin)
    torch.testing.assert_close(out.k, k_rope)
    torch.testing.assert_close(out.v, v_raw)
    assert not torch.allclose(out.k, k_raw)                       # RoPE really was applied


def test_draft_attention_mirrors_the_target_layer(family, tiny_target):
    """A draft self-attention given the target last layer's q/k weights (and q/k norms) computes
    exactly that layer's post-RoPE queries and keys: the draft layout is the family's."""
    ids, _, pos = batch(T=12)
    model = glide(tiny_target)
    attn, sa = tiny_target.model.layers[-1].self_attn, model.draft.self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "q_norm", "k_norm"):
            src = getattr(attn, name, None)
            assert (src is None) == (not hasattr(sa, name)), name        # norms exactly where the target has them
            if src is None:
                continue
            dst = getattr(sa, name)
            dst.weight.copy_(src.weight)
            if getattr(dst, "bias", None) is not None:
                dst.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.bias))
    seen = {}
    hook = tiny_target.model.layers[-1].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("x", kw.get("hidden_states", a[0] if a else None)), with_kwargs=True)
    out = model.target(ids, pos)
    hook.remove()
    cos, sin = model.target.rotary(pos, seen["x"])
    from longspec.model.glide import apply_rope

    torch.testing.assert_close(apply_rope(sa.heads(sa.k_proj, seen["x"]), cos, sin), out.k)


def test_target_llm_loss_equals_the_models_own_loss(family, tiny_target):
    ids, labels, pos = batch()
    with torch.no_grad():
        want = tiny_target(input_ids=ids, position_ids=pos, labels=labels, attention_mask=torch.ones_like(ids)).loss
    got = TargetWrapper(tiny_target)(ids, pos, labels=labels).llm_loss
    torch.testing.assert_close(got, want.float())


def test_draft_loss_matches_hand_computed_reference(family, tiny_target):
    model = glide(tiny_target)
    ids, labels, pos = batch()
    out = model(ids, labels, pos, cross_lag=2)
    tgt = model.target(ids, pos)
    h = model.draft(model.target.embed(ids), pos, tgt.k, tgt.v, cross_lag=2, rope=model.target.rotary(pos, tgt.last_hidden))
    logits = h.float() @ tiny_target.lm_head.weight.float().T     # (B, T, V), fine at this size
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out["loss"], want)
    with torch.no_grad():   # the target's loss as transformers computes it, not through longspec
        own = tiny_target(input_ids=ids, position_ids=pos, labels=labels, attention_mask=torch.ones_like(ids)).loss
    torch.testing.assert_close(out["llm_loss"], own.float())


def test_draft_rope_equals_target_rope(family, tiny_target):
    model = glide(tiny_target)
    _, _, pos = batch()
    like = torch.zeros(1, dtype=torch.float32)
    cos_t, sin_t = model.target.rotary(pos, like)
    cos_d, sin_d = model.draft.rotary(pos, torch.float32)
    torch.testing.assert_close(cos_d, cos_t)
    torch.testing.assert_close(sin_d, sin_t)


def test_cross_attention_respects_the_lag(family, tiny_target):
    """Output at t must not depend on the target's K/V after t - lag, and must depend on t - lag."""
    model = glide(tiny_target)
    ids, _, pos = batch(T=16)
    tgt = model.target(ids, pos)
    emb = model.target.embed(ids)
    lag, t = 3, 10
    base = model.draft(emb, pos, tgt.k, tgt.v, cross_lag=lag)
    k2, v2 = tgt.k.clone(), tgt.v.clone()
    k2[:, :, t - lag + 1:] += 5.0
    v2[:, :, t - lag + 1:] += 5.0
    after = model.draft(emb, pos, k2, v2, cross_lag=lag)
    torch.testing.assert_close(after[:, : t + 1], base[:, : t + 1])
    v3 = tgt.v.clone()
    v3[:, :, t - lag] += 5.0
    assert not torch.allclose(model.draft(emb, pos, tgt.k, v3, cross_lag=lag)[:, t], base[:, t])


def test_self_attention_window(family, tiny_target):
    """Window 4 = flash-attn's window_size=(4, -1): the draft's output at t sees t-4..t (5 keys)
    and ignores t-5 and earlier (cross-attn fixed)."""
    model = glide(tiny_target, window=4)
    ids, _, pos = batch(T=16)
    tgt = model.target(ids, pos)
    emb = model.target.embed(ids)
    t = 12
    base = model.draft(emb, pos, tgt.k, tgt.v)
    emb2 = emb.clone()
    emb2[:, : t - 4] += 3.0                                   # positions <= t-5
    torch.testing.assert_close(model.draft(emb2, pos, tgt.k, tgt.v)[:, t], base[:, t])
    emb3 = emb.clone()
    emb3[:, t - 4] += 3.0                                     # t-4 is inside the window
    assert not torch.allclose(model.draft(emb3, pos, tgt.k, tgt.v)[:, t], base[:, t])


def test_padding_mask_excludes_pads_from_the_loss(family, tiny_target):
    model = glide(tiny_target)
    ids, labels, pos = batch(B=1, T=20)
    mask = torch.ones_like(ids)
    padded_ids = torch.cat([ids, torch.zeros(1, 6, dtype=ids.dtype)], dim=1)
    padded_labels = torch.cat([labels, torch.zeros(1, 6, dtype=labels.dtype)], dim=1)   # pad labels not -100
    padded_mask = torch.cat([mask, torch.zeros(1, 6, dtype=mask.dtype)], dim=1)
    padded_pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, 7)], dim=1)
    a = model(ids, labels, pos, cross_lag=1)
    b = model(padded_ids, padded_labels, padded_pos, cross_lag=1, attention_mask=padded_mask)
    torch.testing.assert_close(b["loss"], a["loss"])
    torch.testing.assert_close(b["llm_loss"], a["llm_loss"])


def test_scaled_rope_target_needs_target_tables(tiny_target):
    target = make_tiny_target("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    model = glide(target)
    assert model.draft.config.rope_type == "linear"
    ids, labels, pos = batch()
    assert torch.isfinite(model(ids, labels, pos, cross_lag=1)["loss"])     # GlideModel passes the target's tables
    with pytest.raises(ValueError, match="rope"):
        model.draft.rotary(pos, torch.float32)


@pytest.mark.parametrize("family, scaling", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}),
])
def test_scaled_rope_reaches_the_draft_as_the_targets_tables(family, scaling):
    """Llama 3.1's llama3 scaling and Qwen3's yarn: the draft's queries use the target's tables."""
    target = make_tiny_target(family, rope_scaling=scaling)
    model = glide(target)
    assert model.draft.config.rope_type == scaling["rope_type"]
    ids, labels, pos = batch()
    like = torch.zeros(1)
    cos, sin = model.target.rotary(pos, like)
    plain = make_tiny_target(family)
    cos0, _ = TargetWrapper(plain).rotary(pos, like)
    assert not torch.allclose(cos, cos0)                               # the scaling changes the tables
    def draft_out(rope):
        with torch.no_grad():
            tgt = model.target(ids, pos)
            return model.draft(model.target.embed(ids), pos, tgt.k, tgt.v, cross_lag=1, rope=rope)

    h = draft_out((cos, sin))
    logits = h.float() @ target.lm_head.weight.float().T
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    loss = model(ids, labels, pos, cross_lag=1)["loss"]
    torch.testing.assert_close(loss, want)                             # the training model uses the scaled tables
    assert (h - draft_out((cos0, TargetWrapper(plain).rotary(pos, like)[1]))).abs().max() > 1e-4
    loss.backward()
    assert torch.isfinite(loss)


def test_mismatched_draft_is_refused():
    target = make_tiny_target("qwen2")
    other = DraftConfig.from_target_config(make_tiny_target("qwen2", hidden_size=32, num_attention_heads=2,
                                                            num_key_value_heads=2).config)
    with pytest.raises(ValueError, match="hidden_size"):
        GlideModel(target, GlideDraft(other))


def test_build_glide_from_folder_with_draft(tmp_path, tiny_target):
    from longspec.model.weights import save_draft

    tiny_target.save_pretrained(tmp_path / "target")
    first = build_glide(tmp_path / "target", sliding_window=8, dtype=torch.float32)
    save_draft(first.draft.state_dict(), tmp_path / "run")
    second = build_glide(tmp_path / "target", sliding_window=8, dtype=torch.float32,
                         draft_path=tmp_path / "run" / "draft_model_weights.pth")
    for (n, a), (_, b) in zip(first.draft.state_dict().items(), second.draft.state_dict().items()):
        assert torch.equal(a, b), n
    ids, labels, pos = batch()
    torch.testing.assert_close(first(ids, labels, pos, 2)["loss"], second(ids, labels, pos, 2)["loss"])
    with pytest.raises(FileNotFoundError):
        build_glide(tmp_path / "nowhere")


# DeepSpeed ZeRO-3 (partitioned at build, then trained through deepspeed.initialize): one 2-rank
# start-up in tests/trainer/test_train.py checks the weights, losses and gradients against this model.
