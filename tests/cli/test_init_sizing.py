"""`init` sizes the stages to the target and the machine (longspec.project.sizing): short CPU stages
for a small target without a GPU, the recipe where 8 GPUs fit it by the memory estimate, fitted
batches where the GPUs do not, the recipe anyway with --full-size. GPUs are a fake nvidia-smi on
PATH (detect_gpus' own reading); nothing is loaded, no torch in this process."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.files.yamlio import load_mapping, to_plain
from longspec.project import presets as P
from tests.cli.test_launch_argv import fake_smi

runner = CliRunner()
STAGES = ("base", "long", "longcot")
# A 135M Llama-family instruct target's config.json (30 layers, 9 query / 3 KV heads, tied embeddings).
SMALL = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 576, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
         "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def small_target(tmp_path: Path) -> Path:
    t = tmp_path / "small"
    t.mkdir()
    (t / "config.json").write_text(json.dumps(SMALL))
    (t / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return t


def init(tmp_path: Path, name: str, *args: str, env=None) -> tuple[list[str], dict]:
    res = runner.invoke(app, ["init", str(tmp_path / name), "--no-input", "--json", *args], env=env)
    assert res.exit_code == 0, res.output
    conf = {s: to_plain(load_mapping(tmp_path / name / "conf" / "exp" / f"{s}.yaml").data) for s in STAGES}
    conf["manifest"] = to_plain(load_mapping(tmp_path / name / "longspec.yaml").data)
    return json.loads(res.output)["notes"], conf


def test_a_small_target_on_a_cpu_gets_short_stages_with_their_cost(tmp_path):
    notes, conf = init(tmp_path, "p", "--target", str(small_target(tmp_path)), env=NO_GPU)
    assert notes[1].startswith("sizes fitted to this machine (no GPU: ") and "135M-parameter target" in notes[1]
    assert conf["manifest"]["launch"]["gpus"] == 1
    for stage, msl, lr in (("base", 512, 5.0e-4), ("long", 2048, 1.0e-4), ("longcot", 2048, 1.0e-4)):
        c = conf[stage]
        steps, every = c["max_steps"], c["eval_steps"]
        assert c["data"]["max_seq_length"] == msl and c["learning_rate"] == lr
        assert 50 <= steps <= 2000 and every == max(10, steps // 5) and c["save_steps"] == max(every, steps // 2)
        assert c["global_batch_size"] == c["per_gpu_train_batch_size"] * c["gradient_accumulation_steps"]
        (line,) = [n for n in notes if n.startswith(f"{stage}: ")]
        tokens = msl * c["global_batch_size"]
        assert line.startswith(f"{stage}: {steps} steps x {tokens:,} tokens") and f"= {steps * tokens:,} tokens" in line
        assert re.search(r"; ~\d+ min \(recipe: ", line), line        # a rough time from the measured rate
    res = runner.invoke(app, ["validate", str(tmp_path / "p"), "--json"])
    problems = json.loads(res.output[res.output.index("{"):])["problems"]
    assert not [p for p in problems if p["severity"] == "error" and p["key"] != "train_file"], problems


def test_full_size_writes_the_recipe_whatever_the_machine(tmp_path):
    _, conf = init(tmp_path, "p", "--target", str(small_target(tmp_path)), "--full-size", env=NO_GPU)
    for stage in STAGES:
        recipe = P.stage_defaults(stage)
        assert conf[stage]["data"]["max_seq_length"] == min(recipe["max_seq_length"], SMALL["max_position_embeddings"])
        assert (conf[stage]["max_steps"], conf[stage]["learning_rate"]) == (recipe["max_steps"], recipe["learning_rate"])
    assert conf["manifest"]["launch"]["gpus"] == 8


def test_the_32b_preset_keeps_its_recipe_on_8_gpus_that_fit_it_and_on_a_login_node(tmp_path):
    args = ("--preset", "qwq-32b-preview")
    notes, on_gpus = init(tmp_path, "gpus", *args, env={"CUDA_VISIBLE_DEVICES": None, **fake_smi(tmp_path, 8)})
    assert notes[0] == "sizes: the recipe's: the memory estimate fits 8 GPU(s) of 80 GiB (peak 67.7 GiB)"
    # each stage priced: tokens a step, and a step's time on the H100s at half their listed 989 TFLOP/s;
    # at least the target's forward (2 x 32.8B FLOPs a token), at most 1.6x it (the draft, lm_head, attention)
    for stage, tokens in (("base", 1024 * 2 * 128 * 8), ("long", 32768 * 8 * 8), ("longcot", 32768 * 32 * 8)):
        (line,) = [n for n in notes if n.startswith(f"{stage} cost: ")]
        assert line.startswith(f"{stage} cost: {tokens:,} tokens a step (") and "8 data-parallel" in line, line
        step_s = float(re.search(r"~([\d.]+) s a step on NVIDIA H100 80GB HBM3 \(989 TFLOP/s listed", line)[1])
        floor = 2 * 32.8e9 * tokens / (8 * 989e12 * 0.5)
        assert floor <= step_s <= 1.6 * floor, (line, floor)
        assert "per 1,000 steps; a whole epoch: `longspec prepare` counts its steps" in line
    _, full = init(tmp_path, "full", *args, "--full-size", env=NO_GPU)
    notes, login = init(tmp_path, "login", *args, env=NO_GPU)
    assert notes[0].startswith("sizes: the recipe's for 8 GPUs: the target (32.8B parameters) is not trained on a CPU")
    assert notes[1].startswith("base cost: 2,097,152 tokens a step") and "time not estimated (no GPU here" in notes[1]
    for stage in STAGES:
        keep = ("data", "learning_rate", "per_gpu_train_batch_size", "gradient_accumulation_steps",
                "global_batch_size", "max_steps", "eval_steps")
        assert {k: on_gpus[stage][k] for k in keep} == {k: full[stage][k] for k in keep} == {k: login[stage][k] for k in keep}
    assert on_gpus["base"]["global_batch_size"] == 2048 and on_gpus["manifest"]["launch"]["gpus"] == 8


def test_gpus_too_small_for_the_recipe_get_fitted_batches_that_keep_the_global_batch(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": None, **fake_smi(tmp_path, 2, mib=24576)}
    notes, conf = init(tmp_path, "p", "--preset", "qwen3-8b", env=env)
    assert notes[0] == "sizes fitted to 2 GPU(s) of 24 GiB (the recipe's do not fit the memory estimate)"
    assert conf["manifest"]["launch"]["gpus"] == 2
    for stage in STAGES:
        recipe = P.stage_defaults(stage, P.get_preset("qwen3-8b"))
        c = conf[stage]
        assert c["per_gpu_train_batch_size"] <= recipe["per_gpu_train_batch_size"]
        assert c["data"]["max_seq_length"] <= recipe["max_seq_length"]
        assert c["global_batch_size"] >= recipe["per_gpu_train_batch_size"] * recipe["gradient_accumulation_steps"] * 8
        assert any(n.startswith(f"{stage}: {c['data']['max_seq_length']} tokens x ") for n in notes)


def test_a_gpus_listed_rate_is_read_from_its_nvidia_smi_name_the_specific_name_first():
    from longspec.machine.gpus import listed_bf16_tflops

    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
             "NVIDIA H200": 989.0, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0,
             "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 362.0, "NVIDIA B200": 2250.0,
             "NVIDIA L4": None, "NVIDIA GeForce RTX 4090": None, "Tesla V100-SXM2-32GB": None,
             "NVIDIA RTX A1000": None, "NVIDIA H20": None}
    assert {n: listed_bf16_tflops(n) for n in names} == names
