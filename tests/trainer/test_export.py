"""Export of a stage's draft: HF folder (released-LongSpec layout) and a plain .safetensors file.

Round trips go through longspec.model.weights.load_draft_state and must give identical tensors.
The HF folder is also loaded the way the reference inference code loads a released draft: a
PreTrainedModel whose config class is the target family's and whose state dict is the bare
decoder block (built here from transformers' modules in the reference layout, not from
longspec's), through from_pretrained.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longspec.model.weights import load_draft_state, save_draft
from longspec.measure.runread import EvalError
from longspec.export import export_draft
from longspec.model.glide import DraftConfig, GlideDraft
from tests.trainer.conftest import ROPE_THETA, head_dim, make_tiny_target

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 64


def make_run(tmp_path: Path, family: str, dtype=torch.float32, seed=0) -> tuple[Path, Path, dict]:
    """A target folder and a contract-true finished run folder holding a random draft."""
    target = make_tiny_target(family)
    tdir = tmp_path / f"target-{family}"
    target.save_pretrained(tdir)
    torch.manual_seed(seed)
    draft = GlideDraft(DraftConfig.from_target_config(target.config, sliding_window=WINDOW))
    for p in draft.parameters():
        torch.nn.init.normal_(p)                 # no two tensors alike (ones/zeros would hide mix-ups)
    state = {k: v.to(dtype) for k, v in draft.state_dict().items()}
    run = tmp_path / f"run-{family}"
    pth = save_draft(state, run)
    (run / "training_config.yaml").write_text(
        f"stage: base\nmodel_name_or_path: {tdir}\ntrain_file: {tmp_path}/none.jsonl\nprecision: fp32\n"
        f"draft:\n  sliding_window: {WINDOW}\ndata:\n  max_seq_length: 64\n")
    from longspec.files.atomic import sha256_file

    (run / "stage_complete.json").write_text(json.dumps(
        {"stage": "base", "steps": 1, "final_loss": 1.0, "sha256": sha256_file(pth), "target": str(tdir),
         "config_sha256": "0" * 64, "draft_sha256": None, "finished_at": "now", "weights": pth.name}))
    return tdir, pth, state


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def reference_style_loader(family: str):
    """A decoder-block PreTrainedModel laid out like the reference's <Family>GlideDecoderLayer
    (LongSpec train/models/qwen2_glide.py:392-411, GlideAttention at :53-56), built from
    transformers' own MLP and RMSNorm classes of the family and plain nn.Linear projections:
    nothing of longspec.model.glide, so a layout drift on our side shows up as missing/unexpected keys.
    Qwen2/Llama: the reference layout (q/k/v bias in both families). Qwen3/Mistral (no reference
    draft): their own layer's layout, no bias, Qwen3 with per-head q/k norms."""
    import importlib

    import torch.nn as nn
    from transformers import AutoConfig, PreTrainedModel

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    mlp_cls, norm_cls = getattr(mod, f"{prefix}MLP"), getattr(mod, f"{prefix}RMSNorm")
    bias, qk_norm = family in ("qwen2", "llama"), family == "qwen3"

    class ReferenceAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            kv = config.num_key_value_heads * hd
            self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * hd, bias=bias)
            self.k_proj = nn.Linear(config.hidden_size, kv, bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, kv, bias=bias)
            self.o_proj = nn.Linear(config.num_attention_heads * hd, config.hidden_size, bias=False)
            if qk_norm:
                self.q_norm = norm_cls(hd, eps=config.rms_norm_eps)
                self.k_norm = norm_cls(hd, eps=config.rms_norm_eps)

    class GlideBlockModel(PreTrainedModel):
        config_class = type(AutoConfig.for_model(family))
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.self_attn = ReferenceAttention(config)
            self.cross_attn = ReferenceAttention(config)
            self.mlp = mlp_cls(config)
            self.input_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            self.post_self_attention_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            self.post_cross_attention_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            self.post_init()

        def _init_weights(self, module):
            pass

    return GlideBlockModel


# ----------------------------------------------------------------------------- hf folder

def test_hf_folder_round_trip_and_layout(tmp_path, family):
    tdir, pth, state = make_run(tmp_path, family)
    out = tmp_path / "exported"
    res = export_draft(pth, tdir, "hf", out, sliding_window=WINDOW, stage="base")
    assert res["verified"] and sorted(res["files"]) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same(load_draft_state(out), state)
    assert_same(load_draft_state(out / "model.safetensors"), state)

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"                  # transformers refuses safetensors without it
        assert sorted(f.keys()) == sorted(state)               # unprefixed reference keys
    cfg = json.loads((out / "config.json").read_text())
    arch = {"qwen2": "Qwen2GlideDecoderLayer", "llama": "LlamaGlideDecoderLayer",
            "qwen3": "Qwen3GlideDecoderLayer", "mistral": "MistralGlideDecoderLayer"}[family]
    assert cfg["architectures"] == [arch] and cfg["model_type"] == family
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["intermediate_size"]) == (64, 4, 2, head_dim(family), 128)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == ROPE_THETA[family]
    assert cfg["attention_bias"] is (family in ("qwen2", "llama"))
    assert cfg["sliding_window"] == WINDOW and cfg["num_hidden_layers"] == 1
    assert cfg["target_model_name_or_path"] == str(tdir)
    assert cfg["longspec"]["draft_config"]["sliding_window"] == WINDOW


def test_vllm_folder_names_the_plugin_architecture_and_the_targets_layers(tmp_path):
    """`--format vllm`: the hf folder's tensors, the architecture longspec's vLLM plugin registers,
    no family window key (vLLM would apply it to every layer of the draft, the cross-attention
    included), the window kept in longspec.draft_config, the target's layer count."""
    tdir, pth, state = make_run(tmp_path, "qwen2")
    out = tmp_path / "vllm"
    res = export_draft(pth, tdir, "vllm", out, sliding_window=WINDOW, stage="base")
    assert res["verified"] and res["architecture"] == "LongSpecGlideForCausalLM"
    assert_same(load_draft_state(out), state)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LongSpecGlideForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["sliding_window"] is None and cfg["use_sliding_window"] is False
    assert cfg["longspec"]["draft_config"]["sliding_window"] == WINDOW
    assert cfg["target_num_hidden_layers"] == 2 and cfg["target_model_name_or_path"] == str(tdir)


def test_hf_folder_loads_like_a_released_draft(tmp_path, family):
    """from_pretrained of a block-level PreTrainedModel: no missing/unexpected keys, same tensors."""
    from transformers import AutoConfig

    tdir, pth, state = make_run(tmp_path, family)
    out = tmp_path / "exported"
    export_draft(pth, tdir, "hf", out, sliding_window=WINDOW)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == family
    window = json.loads((out / "config.json").read_text())["sliding_window"]   # Qwen2Config drops it on load
    assert DraftConfig.from_target_config(cfg, window) == \
        DraftConfig.from_target_config(AutoConfig.from_pretrained(tdir), WINDOW)
    model, info = reference_style_loader(family).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same({k: v for k, v in model.state_dict().items()}, state)


def test_bf16_draft_keeps_its_dtype(tmp_path):
    tdir, pth, state = make_run(tmp_path, "qwen2", dtype=torch.bfloat16)
    out = tmp_path / "exported"
    res = export_draft(pth, tdir, "hf", out, sliding_window=WINDOW)
    assert res["dtype"] == "bfloat16"
    assert_same(load_draft_state(out), state)


# ----------------------------------------------------------------------------- safetensors file

def test_safetensors_file_round_trip(tmp_path, family):
    tdir, pth, state = make_run(tmp_path, family)
    out = tmp_path / "draft.safetensors"
    export_draft(pth, tdir, "safetensors", out, sliding_window=WINDOW, stage="base")
    assert_same(load_draft_state(out), state)
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert json.loads(meta["longspec_config"])["architectures"][0].endswith("GlideDecoderLayer")


def test_safetensors_needs_the_suffix(tmp_path):
    tdir, pth, _ = make_run(tmp_path, "qwen2")
    with pytest.raises(EvalError) as e:
        export_draft(pth, tdir, "safetensors", tmp_path / "draft.bin", sliding_window=WINDOW)
    assert e.value.code == 2


# ----------------------------------------------------------------------------- refusals, atomicity

def test_existing_destination_needs_force_and_is_replaced_whole(tmp_path):
    tdir, pth, state = make_run(tmp_path, "qwen2")
    out = tmp_path / "exported"
    out.mkdir()
    (out / "stale.txt").write_text("old export")
    with pytest.raises(EvalError) as e:
        export_draft(pth, tdir, "hf", out, sliding_window=WINDOW)
    assert e.value.code == 1 and (out / "stale.txt").read_text() == "old export"
    export_draft(pth, tdir, "hf", out, sliding_window=WINDOW, force=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]     # nothing of the old one left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp leftovers
    assert_same(load_draft_state(out), state)


def test_draft_of_another_target_is_refused_and_nothing_written(tmp_path):
    tdir, _, _ = make_run(tmp_path, "qwen2")
    other = GlideDraft(DraftConfig.from_target_config(make_tiny_target("qwen2", hidden_size=32).config))
    pth = save_draft(other.state_dict(), tmp_path / "other")
    out = tmp_path / "exported"
    with pytest.raises(EvalError) as e:
        export_draft(pth, tdir, "hf", out, sliding_window=WINDOW)
    assert e.value.code == 3 and "different target" in e.value.message
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]


# ----------------------------------------------------------------------------- the module's command line

def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "longspec.export", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_module_exports_a_run_folder(tmp_path):
    tdir, pth, state = make_run(tmp_path, "llama")
    run = pth.parent
    proc = run_module(str(run), "--format", "hf", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["out"] == str(run / "export" / "base-hf") and res["verified"]
    assert_same(load_draft_state(res["out"]), state)
    again = run_module(str(run), "--format", "hf", "--json")               # exists: refused, exit 1
    assert again.returncode == 1 and "already exists" in json.loads(again.stdout)["error"]


def test_module_refuses_an_unfinished_stage(tmp_path):
    tdir, pth, _ = make_run(tmp_path, "qwen2")
    (pth.parent / "stage_complete.json").unlink()
    proc = run_module(str(pth.parent), "--format", "safetensors", "--json")
    assert proc.returncode == 1 and "no finished draft" in proc.stderr
    assert "Traceback" not in proc.stderr
