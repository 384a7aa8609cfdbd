"""Per-GPU memory estimate: parameter counts against real models, and the reference QwQ-32B pipeline."""

from __future__ import annotations

import json

import pytest

from tests import needs
from longspec.machine import memory as M

QWQ = M.ModelSize(hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648, vocab=152064)


def qwq_stage(**kw) -> M.StageShape:
    base = dict(size=QWQ, precision="bf16", zero_stage=1, offload_optimizer=True, seq_len=1024, micro_batch=2,
                world_size=8, flash=True)
    return M.StageShape(**{**base, **kw})


# ----------------------------------------------------------------------- counts vs real modules

def tiny_qwen2_config(**kw) -> dict:
    cfg = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512,
               max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)
    return {**cfg, **kw}


@pytest.mark.parametrize("tie", [False, True])
def test_target_params_match_transformers(tmp_path, tie):
    transformers = needs.module("transformers")
    cfg = tiny_qwen2_config(tie_word_embeddings=tie)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    real = sum(p.numel() for p in model.parameters())
    assert M.ModelSize.from_config_json(tmp_path / "config.json").target_params() == real


def test_llama_target_has_no_qkv_bias():
    transformers = needs.module("transformers")
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=512, model_type="llama")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    assert M.ModelSize.from_mapping(cfg).target_params() == sum(p.numel() for p in model.parameters())


def test_draft_params_match_the_glide_block():
    needs.module("torch")
    from longspec.model import glide as model
    size = M.ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
    draft = model.GlideDraft(model.DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=16))
    total, trainable = size.draft_params()
    assert total == sum(p.numel() for p in draft.parameters())
    assert trainable == sum(p.numel() for p in draft.parameters() if p.requires_grad)


def test_preset_sizes_read_from_the_preset_table():
    from longspec.project import presets

    p = presets.get_preset("qwq-32b-preview")
    size = M.ModelSize.from_mapping({**p.size, "family": p.family})
    assert size == QWQ
    assert 32.7e9 < size.target_params() < 32.8e9  # QwQ-32B: 32.76 B parameters


# ----------------------------------------------------------------------- the reference pipeline

def test_qwq_stage1_zero1_1k_fits_80gb_but_the_replicated_target_dominates():
    est = M.estimate(qwq_stage())
    items = dict(est.persistent)
    assert items["target weights"] == QWQ.target_params() * 2  # ZeRO-1 replicates the frozen target
    assert 60 * M.GiB < est.peak < 76 * M.GiB
    assert M.fit_warning(est, 80 * M.GiB, "an 80 GiB GPU") is None


def test_qwq_stages_2_3_zero3_32k_fit_with_room():
    est = M.estimate(qwq_stage(zero_stage=3, seq_len=32768, micro_batch=1))
    assert dict(est.persistent)["target weights /world"] == pytest.approx(QWQ.target_params() * 2 / 8)
    assert 20 * M.GiB < est.peak < 45 * M.GiB
    assert est.peak_phase == "draft forward/backward"
    assert M.fit_warning(est, 80 * M.GiB, "x") is None


def test_zero1_at_32k_does_not_fit_80gb_which_is_why_long_stages_use_zero3():
    est = M.estimate(qwq_stage(seq_len=32768, micro_batch=1))
    warning = M.fit_warning(est, 80 * M.GiB, "GPU 0")
    assert warning is not None and "ZeRO-3" in warning


def test_knobs_move_the_estimate_the_right_way():
    z3 = qwq_stage(zero_stage=3, seq_len=32768, micro_batch=1)
    base = M.estimate(z3).peak
    assert M.estimate(M.StageShape(**{**z3.__dict__, "world_size": 16})).peak < base
    assert M.estimate(M.StageShape(**{**z3.__dict__, "flash": False})).peak > base
    assert M.estimate(M.StageShape(**{**z3.__dict__, "offload_optimizer": False})).peak > base
    assert M.estimate(M.StageShape(**{**z3.__dict__, "seq_len": 16384})).peak < base
    no_off = M.estimate(M.StageShape(**{**z3.__dict__, "offload_optimizer": False}))
    # Adam: fp32 master + two moments = 12 bytes per trainable draft parameter, split over 8 ranks.
    assert dict(no_off.persistent)["Adam states /world"] == pytest.approx(12 * QWQ.draft_params()[1] / 8)
    assert M.estimate(z3).cpu_offload_per_node > 0 and no_off.cpu_offload_per_node == 0


def test_report_lines_name_the_parts():
    text = "\n".join(M.estimate(qwq_stage()).lines())
    for word in ("per-GPU memory estimate", "target weights", "draft grads", "loss chunk", "ZeRO-1"):
        assert word in text


def test_zero12_gradients_and_bucket_are_held_across_accumulated_micro_steps():
    """ZeRO-1/2 make the gradients (and allocate the reduce bucket) at the backward and keep them
    to the optimizer step: with one micro-step they belong to the backward and the step; when
    gradients accumulate they live through the next micro-steps' forwards too (DeepSpeed 0.19:
    reduce_gradients runs at the accumulation boundary only)."""
    size = M.ModelSize(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064)
    shape = M.StageShape(size=size, zero_stage=1, offload_optimizer=False, seq_len=8192)
    one, many = M.estimate(shape), M.estimate(M.StageShape(**{**shape.__dict__, "grad_accumulation": 8}))
    draft = size.draft_params()[1]
    assert "draft grads" not in dict(one.persistent)
    assert dict(dict(one.phase_b_max)["draft backward"])["draft grads"] == draft * 2
    assert dict(dict(one.phase_b_max)["draft backward"])["reduce bucket"] == draft * 2   # sized to the draft
    assert dict(many.persistent)["draft grads (accumulating)"] == draft * 2
    assert dict(many.persistent)["reduce bucket (accumulating)"] == draft * 2
    assert many.peak > one.peak
    big = M.estimate(M.StageShape(**{**shape.__dict__, "reduce_bucket": 500_000_000}))
    assert dict(dict(big.phase_b_max)["draft backward"])["reduce bucket"] == 500_000_000 * 2
