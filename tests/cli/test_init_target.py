"""`init --target PATH` reads the target folder (config.json, tokenizer files; JSON only), the
family check of `validate`, and the presets for Qwen3 and Llama 3.1. No torch in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project import presets as P
from longspec_cli.launch.scaffold import InitAnswers, plan_project
from longspec.project.targets import SUPPORTED_FAMILIES, read_target, refusal
from longspec.files.yamlio import load_mapping, parse, to_plain

from .conftest import panel_text

runner = CliRunner()


def target_dir(root: Path, family: str, positions: int, dtype: str | None, chat: str | None,
               act: str = "silu") -> Path:
    """A target folder as a hub download leaves it (weights are not read, so none are written)."""
    root.mkdir(parents=True)
    cfg = {"model_type": family, "architectures": ["XForCausalLM"], "hidden_act": act, "hidden_size": 4096,
           "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": positions}
    if dtype:
        cfg["torch_dtype"] = dtype
    (root / "config.json").write_text(json.dumps(cfg))
    tok = {"eos_token": "<|im_end|>"}
    if chat == "inline":
        tok["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(tok))
    if chat == "file":
        (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return root


def init(tmp_path: Path, target: Path, *args: str):
    return runner.invoke(app, ["init", str(tmp_path / "proj"), "--target", str(target), "--gpus", "1",
                               "--no-input", "--json", *args])


def stage(tmp_path: Path, name: str) -> tuple[dict, str]:
    path = tmp_path / "proj" / "conf" / "exp" / f"{name}.yaml"
    return to_plain(load_mapping(path).data), path.read_text()


def test_qwen3_target_fills_family_precision_and_chat_template(tmp_path):
    t = target_dir(tmp_path / "Qwen3-8B", "qwen3", 40960, "bfloat16", "inline")
    res = init(tmp_path, t)
    assert res.exit_code == 0, res.output
    notes = json.loads(res.output)["notes"]
    assert notes[0] == "target: qwen3 family, 40960 positions (max_position_embeddings), precision bf16"
    assert notes[-1] == "chats render with the target's chat template (tokenizer_config.json)"
    assert not any("capped" in n for n in notes)                      # 32768 <= 40960
    base, base_text = stage(tmp_path, "base")
    long, long_text = stage(tmp_path, "long")
    assert base["precision"] == long["precision"] == "bf16"
    assert (base["data"]["max_seq_length"], long["data"]["max_seq_length"]) == (1024, 32768)
    assert base["positions"]["max_offset"] == 30000                 # > 16k positions: the 0-30k range
    assert "# Target: qwen3 family, 40960 positions" in base_text
    assert "chat template" not in base_text                          # base trains on plain text
    assert "# Chats render with the target's chat template (tokenizer_config.json)" in long_text
    manifest = (tmp_path / "proj" / "longspec.yaml").read_text()
    assert f"target: {t}  # qwen3 family, 40960 positions" in manifest
    assert to_plain(load_mapping(tmp_path / "proj" / "longspec.yaml").data)["target"] == str(t)


def test_short_context_target_caps_stage_lengths_with_a_note(tmp_path):
    t = target_dir(tmp_path / "mistral-8k", "mistral", 8192, "float16", None)
    res = init(tmp_path, t)
    assert res.exit_code == 0, res.output
    notes = json.loads(res.output)["notes"]
    assert "long: max_seq_length capped at the target's 8192 positions (stage default 32768)" in notes
    assert "longcot: max_seq_length capped at the target's 8192 positions (stage default 32768)" in notes
    assert notes[-1].startswith("the target's tokenizer has no chat template")
    for name in ("long", "longcot"):
        conf, text = stage(tmp_path, name)
        assert conf["data"]["max_seq_length"] == 8192 and conf["precision"] == "fp16"
        assert "max_seq_length: 8192  # capped at the target's 8192 positions (stage default 32768)" in text
        assert "no chat template" in text
    base, _ = stage(tmp_path, "base")
    assert base["positions"]["max_offset"] == 8192 - 1024            # 15k would leave the target's range
    res = runner.invoke(app, ["validate", str(tmp_path / "proj"), "--json"])
    problems = json.loads(res.output[res.output.index("{"):])["problems"]
    assert not [p for p in problems if "max_seq_length" in (p["key"] or "") or "family" in p["message"]]


def test_precision_flag_wins_and_chat_template_file_is_found(tmp_path):
    t = target_dir(tmp_path / "t", "llama", 131072, "bfloat16", "file")
    res = init(tmp_path, t, "--precision", "fp32")
    assert res.exit_code == 0, res.output
    assert stage(tmp_path, "base")[0]["precision"] == "fp32"
    assert "(chat_template.jinja)" in json.loads(res.output)["notes"][-1]
    info = read_target(t)
    assert (info.family, info.position_limit, info.precision, info.size["kv_heads"]) == ("llama", 131072, "bf16", 8)


@pytest.mark.parametrize("family, act, word", [("gpt_neox", "gelu", "'gpt_neox'"), ("llama", "gelu", "'gelu'")])
def test_unsupported_target_is_refused_with_one_sentence(tmp_path, family, act, word):
    t = target_dir(tmp_path / "t", family, 4096, "bfloat16", None, act=act)
    res = init(tmp_path, t)
    assert res.exit_code == 1 and not (tmp_path / "proj").exists()
    text = panel_text(res.output)
    assert text == "error " + refusal(family, act) and word in text
    assert all(f in text for f in SUPPORTED_FAMILIES)


def test_unreadable_target_config_is_bad_input(tmp_path):
    t = tmp_path / "t"
    t.mkdir()
    (t / "config.json").write_text("{not json")
    res = init(tmp_path, t)
    assert res.exit_code == 3 and "not readable JSON" in panel_text(res.output)


def test_validate_flags_a_stage_whose_target_family_is_unsupported(tmp_path):
    good = target_dir(tmp_path / "good", "qwen3", 40960, "bfloat16", "inline")
    assert init(tmp_path, good).exit_code == 0
    bad = target_dir(tmp_path / "bad", "phi3", 4096, "bfloat16", None)
    long = tmp_path / "proj" / "conf" / "exp" / "long.yaml"
    long.write_text(long.read_text().replace(f"model_name_or_path: {good}", f"model_name_or_path: {bad}"))
    res = runner.invoke(app, ["validate", str(tmp_path / "proj"), "--json"])
    problems = json.loads(res.output[res.output.index("{"):])["problems"]
    family = [p for p in problems if refusal("phi3", "silu") in p["message"]]
    assert res.exit_code == 1 and len(family) == 1
    assert family[0]["severity"] == "error" and family[0]["key"] == "model_name_or_path"
    assert family[0]["file"].endswith("long.yaml")


@pytest.mark.parametrize("name, family, context, billions", [
    ("qwen3-8b", "qwen3", 40960, 8.2), ("qwen3-32b", "qwen3", 40960, 32.8), ("llama3.1-8b-instruct", "llama", 131072, 8.0)])
def test_new_presets_render_within_their_context(tmp_path, name, family, context, billions):
    from longspec.machine.memory import ModelSize

    preset = P.get_preset(name)
    assert (preset.family, preset.context) == (family, context)
    size = ModelSize.from_mapping({**preset.size, "family": preset.family})    # what the memory estimate reads
    assert size.hd == 128 and abs(size.target_params() / 1e9 - billions) < 0.05 * billions   # published sizes
    files = plan_project(InitAnswers(tmp_path / "p", preset=name))
    for s in P.STAGE_ORDER:
        conf = to_plain(parse(files[(tmp_path / "p").resolve() / "conf" / "exp" / f"{s}.yaml"]))
        assert conf["data"]["max_seq_length"] <= context and conf["precision"] == "bf16"
        assert conf["model_name_or_path"] == preset.target
    lines = (P.templates_dir() / "presets.yaml").read_text().splitlines()
    i = lines.index(f"{name}:")
    while not lines[i - 1].startswith("#"):                     # up to the comment over this preset's group
        i -= 1
    comment = []
    while i > 0 and lines[i - 1].startswith("#"):
        comment.insert(0, lines[i - 1])
        i -= 1
    text = " ".join(comment)
    assert "Paper's:" in text and "Extrapolated:" in text


def test_validate_warns_about_fp16_training_of_a_bf16_target(tmp_path):
    t = target_dir(tmp_path / "t", "qwen3", 40960, "bfloat16", "inline")
    assert init(tmp_path, t, "--precision", "fp16").exit_code == 0
    res = runner.invoke(app, ["validate", str(tmp_path / "proj"), "--json"])
    warns = [p for p in json.loads(res.output[res.output.index("{"):])["problems"] if p["key"] == "precision"]
    assert len(warns) == 3 and all(p["severity"] == "warning" and "bfloat16" in p["message"] for p in warns)
    assert init(tmp_path, t, "--force").exit_code == 0               # bf16 from torch_dtype: no warning
    res = runner.invoke(app, ["validate", str(tmp_path / "proj"), "--json"])
    assert not [p for p in json.loads(res.output[res.output.index("{"):])["problems"] if p["key"] == "precision"]
