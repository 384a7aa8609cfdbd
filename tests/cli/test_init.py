"""`longspec init`: real files from the shipped templates, parsed back with ruamel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project import presets as P
from longspec_cli.launch.scaffold import InitAnswers, plan_project, yaml_scalar
from longspec.files.yamlio import load_mapping, parse, to_plain

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def _init(tmp_path: Path, *args: str):
    return runner.invoke(app, ["init", str(tmp_path / "proj"), "--no-input", *args])


def test_init_writes_a_three_stage_project(tmp_path):
    data = tmp_path / "slim.jsonl"
    res = _init(tmp_path, "--preset", "qwq-32b-preview", "--data", f"base={data}")
    assert res.exit_code == 0, res.output
    proj = tmp_path / "proj"
    manifest = to_plain(load_mapping(proj / "longspec.yaml").data)
    assert [s["name"] for s in manifest["stages"]] == ["base", "long", "longcot"]
    assert [s["draft_from"] for s in manifest["stages"]] == [None, "base", "long"]
    base = to_plain(load_mapping(proj / "conf/exp/base.yaml").data)
    assert base["model_name_or_path"] == "Qwen/QwQ-32B-Preview"
    assert base["draft_model_name_or_path"] is None
    assert base["train_file"] == str(data)
    assert base["data"]["max_seq_length"] == 1024
    assert base["defaults"][0] == {"/deepspeed@ds_cfg": "zero1_offload_cosine"}
    assert base["learning_rate"] == 5e-4
    assert base["per_gpu_train_batch_size"] * base["gradient_accumulation_steps"] * 8 == 2048
    assert base["positions"] == {"mode": "anchor_offset", "anchors": 4, "max_offset": 30000, "threshold": 1200}
    long = to_plain(load_mapping(proj / "conf/exp/long.yaml").data)
    assert long["data"]["max_seq_length"] == 32768 and long["train_file"] == "???"
    assert long["per_gpu_train_batch_size"] * long["gradient_accumulation_steps"] * 8 == 64
    cot = to_plain(load_mapping(proj / "conf/exp/longcot.yaml").data)
    assert cot["per_gpu_train_batch_size"] * cot["gradient_accumulation_steps"] * 8 == 256
    assert cot["data"]["collator"] == "long_cot"
    ds3 = to_plain(load_mapping(proj / "conf/deepspeed/zero3_offload_cosine.yaml").data)
    assert ds3["zero_optimization"]["stage"] == 3
    assert ds3["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds3["optimizer"]["params"]["lr"] == "${learning_rate}"


def test_every_stage_file_opens_with_its_run_command_and_sets_precision_once(tmp_path):
    assert _init(tmp_path, "--preset", "llama3-8b-262k").exit_code == 0
    for stage in P.STAGE_ORDER:
        text = (tmp_path / "proj/conf/exp" / f"{stage}.yaml").read_text()
        first = text.splitlines()[:4]
        assert first[0] == "# @package _global_"  # Hydra reads the header only before other comments
        assert first[2].startswith("# Run:  deepspeed --num_gpus=8 --module longspec.train")
        assert f"+exp={stage}" in first[2]
        assert text.count("precision:") == 1


def test_variants_and_presets_differ_where_they_should(tmp_path):
    """LongSpec's two families train alike (anchor offsets + noisy lag); each stage file names the
    reference config it mirrors. Presets set the offset range and the context."""
    root = (tmp_path / "a").resolve()
    std = plan_project(InitAnswers(tmp_path / "a", preset="vicuna-7b-16k", variant="standard"))
    sink = plan_project(InitAnswers(tmp_path / "a", preset="vicuna-7b-16k", variant="sinkpi-slicing"))
    for files in (std, sink):
        base = to_plain(parse(files[root / "conf/exp/base.yaml"]))
        assert base["positions"]["mode"] == "anchor_offset" and base["cross_attn_lag"] == 4
        assert base["positions"]["max_offset"] == 15000  # a 16k-context target
    long = to_plain(parse(std[root / "conf/exp/long.yaml"]))
    assert long["data"]["max_seq_length"] == 16384
    assert "mirrors LongSpec's conf/exp/qwq_glide_8gpu_slim6b.yaml" in std[root / "conf/exp/base.yaml"]
    assert "conf/exp/qwq_glide_8gpu_slim6b_sinkpi-slicing.yaml" in sink[root / "conf/exp/base.yaml"]
    assert "variant: standard" in std[root / "longspec.yaml"]


def test_init_never_overwrites_without_force(tmp_path):
    assert _init(tmp_path, "--preset", "qwq-32b-preview").exit_code == 0
    cfg = tmp_path / "proj/conf/exp/base.yaml"
    cfg.write_text("edited: true\n")
    res = _init(tmp_path, "--preset", "qwq-32b-preview")
    assert res.exit_code == 1
    assert cfg.read_text() == "edited: true\n"
    assert _init(tmp_path, "--preset", "qwq-32b-preview", "--force").exit_code == 0
    assert cfg.read_text() != "edited: true\n"


@pytest.mark.parametrize(
    "args, code",
    [
        (["--preset", "nope"], 2),
        (["--preset", "tiny", "--data", "junk"], 2),
        (["--preset", "tiny", "--data", "other=/x"], 2),
        (["--preset", "tiny", "--variant", "fancy"], 2),
        (["--target", "/m", "--precision", "fp8"], 2),
        (["--target", "/m", "--gpus", "0"], 2),
        ([], 2),
    ],
)
def test_bad_answers_are_usage_errors_and_write_nothing(tmp_path, args, code):
    res = _init(tmp_path, *args)
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "proj").exists()


def test_dry_run_json_lists_files_and_writes_nothing(tmp_path):
    res = _init(tmp_path, "--target", "/models/x", "--stages", "base,long", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["written"] is False and len(out["files"]) == 5  # 2 stages, 2 DeepSpeed files, manifest
    assert not (tmp_path / "proj").exists()


def test_paths_with_spaces_and_unicode_survive(tmp_path):
    proj = tmp_path / "my projé"
    res = runner.invoke(app, ["init", str(proj), "--no-input", "--target", "/models/Qwen 2/été"])
    assert res.exit_code == 0, res.output
    base = to_plain(load_mapping(proj / "conf/exp/base.yaml").data)
    assert base["model_name_or_path"] == "/models/Qwen 2/été"
    assert base["output_dir"] == str(proj.resolve() / "runs" / "base")


@pytest.mark.parametrize("value", ["null", "yes", "1e5", "a: b", "#x", "", "x y", "ünï", "/p/a-b_c.d"])
def test_yaml_scalar_reads_back_as_the_same_string(value):
    assert to_plain(parse(f"k: {yaml_scalar(value)}\n"))["k"] == value


def test_templates_ship_in_the_wheel(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = wheel_dir.glob("longspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("presets.yaml", "stages.yaml", "exp/stage.yaml", "deepspeed/zero3_offload_cosine.yaml"):
        assert f"longspec/_templates/{f}" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    for f in ("conf/config.yaml", "train.py", "training/__init__.py", "training/loop.py", "data/encoding.py"):
        assert f"longspec/{f}" in names                       # the trainer's groups ship too
    code = ("from longspec.project import hydracompose, presets; from longspec_cli.launch import trainer\n"
            "print(presets.templates_dir()); print(hydracompose.trainer_conf_dir()); print(trainer.trainer_root())\n"
            "from longspec.formats.prepared import collator_version; print(collator_version())")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    templates, conf, root, version = out.stdout.split()
    assert templates.startswith(str(site)) and conf == str(site / "longspec" / "conf")
    assert root == str(site) and version.isdigit()   # `python -m longspec...` runs from the install
