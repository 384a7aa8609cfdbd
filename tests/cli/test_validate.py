"""`longspec validate`: real projects and stage files on disk, through the CLI (CliRunner)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project.validate import validate_paths
from tests.cli.conftest import panel_text

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- a clean project, per docs/DESIGN.md

STAGE = """\
# @package _global_
# Stage {n} of 3 ({name})
# Run:  longspec run {root} {name}
defaults:
  - /deepspeed@ds_cfg: {ds}
  - _self_

stage: {name}
model_name_or_path: {root}/target
draft_model_name_or_path: {draft}
train_file: data/{name}.jsonl
output_dir: runs/{name}
precision: bf16

data:
  collator: {collator}
  max_seq_length: {msl}
  on_bad_record: error

positions:
  mode: anchor_offset
  anchors: 4
  max_offset: 30000
  threshold: 1200
cross_attn_lag: 4

draft:
  sliding_window: 512

learning_rate: {lr}
weight_decay: 0.1
adam_betas: [0.9, 0.95]
adam_epsilon: 1.0e-6
max_grad_norm: 1.0
per_gpu_train_batch_size: {pg}
gradient_accumulation_steps: {ga}
global_batch_size: {gbs}
num_train_epochs: 1
max_steps: 0
warmup_proportion: 0.1
save_steps: 200
save_total_limit: 2
logging_steps: 1
seed: 42

logging:
  wandb: false
  tensorboard: false
"""

DS = """\
train_micro_batch_size_per_gpu: ${{per_gpu_train_batch_size}}
gradient_accumulation_steps: ${{gradient_accumulation_steps}}
gradient_clipping: ${{max_grad_norm}}
optimizer:
  type: AdamW
  params:
    lr: ${{learning_rate}}
    betas: ${{adam_betas}}
    eps: ${{adam_epsilon}}
    weight_decay: ${{weight_decay}}
scheduler:
  type: WarmupCosineLR
  params:
    warmup_type: linear
zero_optimization:
  stage: {stage}
  offload_optimizer:
    device: cpu
    pin_memory: true
"""

MANIFEST = """\
name: demo
preset: null
variant: sinkpi-slicing
target: target
launch: {{gpus: 8, nodes: {nodes}, hostfile: {hostfile}}}
stages:
  - {{name: base,    config: conf/exp/base.yaml,    output_dir: runs/base,    draft_from: null}}
  - {{name: long,    config: conf/exp/long.yaml,    output_dir: runs/long,    draft_from: base}}
  - {{name: longcot, config: conf/exp/longcot.yaml, output_dir: runs/longcot, draft_from: long}}
"""

STAGES = [
    dict(n=1, name="base", ds="zero1_offload_cosine", draft="null", collator="short_text", msl=1024, lr="5.0e-4",
         pg=2, ga=128, gbs=2048),
    dict(n=2, name="long", ds="zero3_offload_cosine", draft="runs/base/draft_model_weights.pth",
         collator="long_data", msl=32768, lr="5.0e-6", pg=1, ga=8, gbs=64),
    dict(n=3, name="longcot", ds="zero3_offload_cosine", draft="runs/long/draft_model_weights.pth",
         collator="long_cot", msl=32768, lr="5.0e-6", pg=1, ga=32, gbs=256),
]


def make_project(tmp_path: Path, nodes: int = 1, hostfile: str = "null") -> Path:
    root = tmp_path / "proj"
    (root / "conf" / "exp").mkdir(parents=True)
    (root / "conf" / "deepspeed").mkdir()
    (root / "data").mkdir()
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    (root / "longspec.yaml").write_text(MANIFEST.format(nodes=nodes, hostfile=hostfile))
    for st in STAGES:
        (root / "conf" / "exp" / f"{st['name']}.yaml").write_text(STAGE.format(root=root, **st))
        (root / "data" / f"{st['name']}.jsonl").write_text('{"text": "hello"}\n')
    (root / "conf" / "deepspeed" / "zero1_offload_cosine.yaml").write_text(DS.format(stage=1))
    (root / "conf" / "deepspeed" / "zero3_offload_cosine.yaml").write_text(DS.format(stage=3))
    return root


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def run_json(*args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["validate", "--json", *args])
    assert res.exit_code in (0, 1), res.output
    assert "Traceback" not in res.output
    return res.exit_code, json.loads(res.stdout)


def line_of(path: Path, start: str) -> int:
    """1-based line of the first line of `path` that starts with `start`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(start))


def problems(report: dict, severity: str | None = None) -> list[dict]:
    return [p for p in report["problems"] if severity is None or p["severity"] == severity]


def find(report: dict, needle: str, severity: str | None = None) -> list[dict]:
    pool = report["problems"] + report["info"]
    return [p for p in pool if needle in p["message"] and (severity is None or p["severity"] == severity)]


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    return make_project(tmp_path)


def stage(proj: Path, name: str) -> Path:
    return proj / "conf" / "exp" / f"{name}.yaml"


# ---------------------------------------------------------------- clean project

def test_clean_project_passes(proj):
    res = runner.invoke(app, ["validate", str(proj)])
    assert res.exit_code == 0, res.output
    assert "3 stage files checked: 0 errors, 0 warnings" in res.output
    code, rep = run_json(str(proj))
    assert code == 0 and rep["ok"] is True and rep["errors"] == 0 and rep["warnings"] == 0
    assert [f["global_batch"] for f in rep["files"]] == [2048, 64, 256]
    assert [f["dialect"] for f in rep["files"]] == ["longspec"] * 3
    assert find(rep, "global batch = 2 per GPU x 128 accumulation x 8 GPUs", "info")
    # the long stage's draft does not exist yet: stage base will write it
    assert find(rep, "stage base will write it", "info")


def test_json_schema(proj):
    edit(stage(proj, "base"), "learning_rate: 5.0e-4", "learning_rate: 7")
    code, rep = run_json(str(proj))
    assert code == 1
    assert set(rep) == {"ok", "errors", "warnings", "problems", "info", "files"}
    assert rep["ok"] is False and rep["errors"] == len(problems(rep, "error")) >= 1
    for p in rep["problems"] + rep["info"]:
        assert set(p) == {"severity", "file", "line", "key", "message", "hint"}
        assert p["severity"] in ("error", "warning", "info")
    (bad,) = [p for p in rep["problems"] if p["key"] == "learning_rate"]
    assert bad["file"] == str(stage(proj, "base")) and bad["line"] == line_of(stage(proj, "base"), "learning_rate") and "(0, 1]" in bad["message"]


def test_table_output_lists_errors_and_a_summary(proj):
    edit(stage(proj, "long"), "cross_attn_lag: 4", "cross_attn_lag: 9")
    res = runner.invoke(app, ["validate", str(proj)])
    assert res.exit_code == 1
    flat = "".join(ch for ch in res.output if ch.isalnum() or ch in ".:_")  # the table may wrap long paths
    line = line_of(stage(proj, "long"), "cross_attn_lag")
    assert "error" in res.output and "cross_attn_lag" in flat and f"long.yaml:{line}" in flat
    assert "1 error" in res.output and "not ready to run" in res.output


def test_usage_errors_exit_2(tmp_path, proj):
    res = runner.invoke(app, ["validate", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such file" in panel_text(res.output) and "Traceback" not in res.output
    assert runner.invoke(app, ["validate", str(proj), "--bogus"]).exit_code == 2
    assert runner.invoke(app, ["validate", str(proj), "--world-size", "0"]).exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["validate", str(empty)]).exit_code == 2


def test_an_error_naming_a_path_wider_than_the_box_prints_it_whole(tmp_path):
    """The panel folds a word wider than itself; a path or command to copy is printed unboxed and
    whole instead (the terminal wraps it, a copy gets it in one piece). Narrow errors keep the box."""
    import os

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    deep = tmp_path / ("a-folder-with-a-long-name-" * 4) / "nope.yaml"
    cmd = [sys.executable, "-m", "longspec_cli", "validate"]
    wide = subprocess.run([*cmd, str(deep)], capture_output=True, text=True, env=env, timeout=60)
    assert wide.returncode == 2 and "Traceback" not in wide.stderr
    line = next(l for l in wide.stderr.splitlines() if str(deep) in l)     # on one line, not folded
    assert wide.stderr.startswith("error: ") and "no such file" in line and "│" not in wide.stderr
    narrow = subprocess.run([*cmd, "nope.yaml"], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert narrow.returncode == 2 and narrow.stderr.startswith("╭─ error") and "no such file" in narrow.stderr


def test_help_has_examples():
    res = runner.invoke(app, ["validate", "--help"])
    assert res.exit_code == 0 and "longspec validate my-proj --json --strict" in res.output


def test_strict_turns_warnings_into_errors(proj):
    edit(stage(proj, "base"), "model_name_or_path: " + str(proj / "target"), "model_name_or_path: Qwen/QwQ-32B-Preview")
    code, rep = run_json(str(proj))
    assert code == 0 and rep["warnings"] >= 1 and find(rep, "hub id", "warning")
    code, rep = run_json(str(proj), "--strict")
    assert code == 1 and find(rep, "hub id", "error")


# ---------------------------------------------------------------- bad input: one problem with a line

BAD_INPUT = {
    "tabs": b"a: 1\n\tb: 2\n",
    "list_root": b"- a\n- b\n",
    "scalar_root": b"just some text\n",
    "empty": b"",
    "comments_only": b"# nothing here\n",
    "binary": b"a: 1\n\x00\x01\x02garbage",
    "non_utf8": b"a: 1\nb: caf\xe9\n",
    "duplicate_keys": b"learning_rate: 1\nseed: 2\nlearning_rate: 3\n",
    "syntax": b"a: [1, 2\nb: 3\n",
    "alias_bomb": (b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
                   + b"".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n".encode()
                              for p, c in zip("abcdefgh", "bcdefghi"))),
    "self_alias": b"a: &x\n  b: *x\n",
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_is_one_problem_with_a_line(tmp_path, name):
    f = tmp_path / "conf" / "exp" / f"{name}.yaml"
    f.parent.mkdir(parents=True)
    f.write_bytes(BAD_INPUT[name])
    code, rep = run_json(str(f))
    assert code == 1
    (p,) = rep["problems"]
    assert p["severity"] == "error" and isinstance(p["line"], int) and p["line"] >= 1
    assert p["file"] == str(f)
    res = runner.invoke(app, ["validate", str(f)])
    assert res.exit_code == 1 and "Traceback" not in res.output


def test_bad_input_lines_point_at_the_fault(tmp_path):
    lines = {"tabs": 2, "duplicate_keys": 3, "non_utf8": 2, "binary": 2, "syntax": 2}
    for name, want in lines.items():
        f = tmp_path / f"{name}.yaml"
        f.write_bytes(BAD_INPUT[name])
        _, rep = run_json(str(f))
        assert rep["problems"][0]["line"] == want, name


# ---------------------------------------------------------------- placeholders

@pytest.mark.parametrize("value", ["'???'", "/path/to/data.jsonl", "<path>", "[Your Directory]/data.jsonl"])
def test_placeholders(proj, value):
    edit(stage(proj, "long"), "train_file: data/long.jsonl", f"train_file: {value}")
    code, rep = run_json(str(proj))
    assert code == 1
    (p,) = problems(rep)
    assert p["key"] == "train_file" and p["line"] == line_of(stage(proj, "long"), "train_file") and p["hint"] == "replace the placeholder with your path"


# ---------------------------------------------------------------- types and ranges

@pytest.mark.parametrize("old,new,key,needle", [
    ("learning_rate: 5.0e-6", 'learning_rate: "5e-4"', "learning_rate", "remove the quotes"),
    ("learning_rate: 5.0e-6", "learning_rate: 0", "learning_rate", "(0, 1]"),
    ("adam_betas: [0.9, 0.95]", "adam_betas: [0.9, 1.0]", "adam_betas", "(0, 1)"),
    ("adam_betas: [0.9, 0.95]", 'adam_betas: "(0.9, 0.95)"', "adam_betas", "not a list"),
    ("precision: bf16", "precision: bf61", "precision", "bf16, fp16, fp32"),
    ("collator: long_data", "collator: long-data", "data.collator", "short_text"),
    ("max_seq_length: 32768", "max_seq_length: 0", "data.max_seq_length", ">= 1"),
    ("mode: anchor_offset", "mode: sink", "positions.mode", "anchor_offset"),
    ("cross_attn_lag: 4", "cross_attn_lag: 9", "cross_attn_lag", "[0, 8]"),
    ("per_gpu_train_batch_size: 1", "per_gpu_train_batch_size: 1.5", "per_gpu_train_batch_size", "whole"),
    ("seed: 42", "seed: 42\nkernels: fast", "kernels", "auto, fused, reference"),
    ("seed: 42", "seed: -1", "seed", ">= 0"),
])
def test_types_and_ranges(proj, old, new, key, needle):
    _, rep = run_json(str(proj))
    assert not [p for p in rep["problems"] if p["key"] == key]  # passing case
    edit(stage(proj, "long"), old, new)
    code, rep = run_json(str(proj))
    assert code == 1
    hits = [p for p in problems(rep, "error") if p["key"] == key]
    assert hits and needle in hits[0]["message"] + (hits[0]["hint"] or ""), rep["problems"]


def test_enum_typo_gets_a_did_you_mean(proj):
    edit(stage(proj, "base"), "precision: bf16", "precision: bf61")
    _, rep = run_json(str(proj))
    (p,) = [p for p in rep["problems"] if p["key"] == "precision"]
    assert p["hint"] == "did you mean 'bf16'?"


# ---------------------------------------------------------------- unknown keys

def test_unknown_key_did_you_mean(proj):
    edit(stage(proj, "base"), "learning_rate: 5.0e-4", "learnig_rate: 5.0e-4")
    code, rep = run_json(str(proj))
    assert code == 1
    (p,) = [p for p in rep["problems"] if p["key"] == "learnig_rate"]
    assert p["severity"] == "error" and p["line"] == line_of(stage(proj, "base"), "learnig_rate")
    assert p["hint"] == "did you mean `learning_rate`?"
    # ...and the ds block's ${learning_rate} now points at nothing
    # Hydra fills learning_rate from the trainer's defaults: the DeepSpeed block still resolves
    assert not find(rep, "refers to `learning_rate`", "error")


def test_unknown_nested_keys(proj):
    edit(stage(proj, "base"), "  anchors: 4", "  anchor: 4")
    edit(stage(proj, "base"), "precision: bf16", "precision: bf16\nds_cfg:\n  steps_per_prnt: 10")
    _, rep = run_json(str(proj))
    (a,) = [p for p in rep["problems"] if p["key"] == "positions.anchor"]
    assert a["severity"] == "error" and a["hint"] == "did you mean `positions.anchors`?"
    (d,) = [p for p in rep["problems"] if p["key"] == "ds_cfg.steps_per_prnt"]
    assert d["severity"] == "warning" and "steps_per_print" in d["hint"]


# ---------------------------------------------------------------- files on disk

def test_missing_train_file(proj):
    (proj / "data" / "base.jsonl").unlink()
    _, rep = run_json(str(proj))
    (p,) = problems(rep)
    assert p["key"] == "train_file" and "does not exist" in p["message"]
    assert p["line"] == line_of(stage(proj, "base"), "train_file")


def test_model_folder_checks(proj, tmp_path):
    base = stage(proj, "base")
    target = str(proj / "target")
    edit(base, f"model_name_or_path: {target}", f"model_name_or_path: {tmp_path}/nowhere")
    _, rep = run_json(str(proj))
    assert find(rep, "nowhere does not exist", "error")
    edit(base, f"model_name_or_path: {tmp_path}/nowhere", f"model_name_or_path: {proj / 'data'}")
    _, rep = run_json(str(proj))
    assert find(rep, "has no config.json", "error")
    edit(base, f"model_name_or_path: {proj / 'data'}", "model_name_or_path: org/some-model")
    code, rep = run_json(str(proj))
    assert code == 0 and find(rep, "hub id", "warning")


def test_draft_file_checks(proj, tmp_path):
    long = stage(proj, "long")
    # a draft that a previous stage will produce is fine (info)
    _, rep = run_json(str(proj))
    assert find(rep, "stage base will write it", "info")
    # a draft that nobody produces is an error
    edit(long, "draft_model_name_or_path: runs/base/draft_model_weights.pth",
         f"draft_model_name_or_path: {tmp_path}/lost.pth")
    _, rep = run_json(str(proj))
    assert find(rep, "lost.pth does not exist", "error")


# ---------------------------------------------------------------- the chain

def test_first_stage_must_start_fresh(proj):
    (proj / "w.pth").write_bytes(b"x")
    edit(stage(proj, "base"), "draft_model_name_or_path: null", "draft_model_name_or_path: w.pth")
    _, rep = run_json(str(proj))
    (p,) = problems(rep)
    assert p["key"] == "draft_model_name_or_path" and "starts the lineage" in p["message"]


def test_null_draft_later_is_chained_by_next_stage(proj):
    edit(stage(proj, "long"), "draft_model_name_or_path: runs/base/draft_model_weights.pth",
         "draft_model_name_or_path: null")
    code, rep = run_json(str(proj))
    assert code == 0 and find(rep, "next-stage` sets it to", "info")


def test_lineage_fork_names_both_stages(proj):
    edit(stage(proj, "longcot"), "runs/long/draft_model_weights.pth", "runs/base/draft_model_weights.pth")
    code, rep = run_json(str(proj))
    assert code == 1
    (p,) = problems(rep)
    assert "lineage fork" in p["message"] and "stage longcot" in p["message"] and "stage base" in p["message"]
    assert p["file"] == str(stage(proj, "longcot"))
    assert p["line"] == line_of(stage(proj, "longcot"), "draft_model_name_or_path")


def test_checkpoint_in_model_name_or_path(proj):
    edit(stage(proj, "long"), f"model_name_or_path: {proj}/target",
         "model_name_or_path: runs/base/checkpoint-200")
    code, rep = run_json(str(proj))
    assert code == 1
    hit = [p for p in problems(rep, "error") if p["key"] == "model_name_or_path"]
    assert hit and "keep model_name_or_path = the target" in hit[0]["hint"]
    assert "stage base's output" in hit[0]["message"]


def test_two_stages_one_output_dir_and_manifest_disagreement(proj):
    edit(proj / "longspec.yaml", "output_dir: runs/longcot,", "output_dir: runs/long,   ")
    _, rep = run_json(str(proj))
    assert find(rep, "stages long and longcot both write to", "error")
    assert find(rep, "disagrees with longspec.yaml", "error")  # longcot.yaml still says runs/longcot


def test_manifest_errors_are_problems(proj):
    edit(proj / "longspec.yaml", "draft_from: long}", "draft_from: lnog}")
    code, rep = run_json(str(proj))
    (p,) = problems(rep)
    assert code == 1 and p["file"].endswith("longspec.yaml") and p["line"] == line_of(proj / "longspec.yaml", "  - {name: longcot") and "lnog" in p["message"]


def test_multi_node_paths_must_be_shared(tmp_path):
    proj = make_project(tmp_path, nodes=2)
    code, rep = run_json(str(proj))  # 2 nodes x 8 GPUs: every global_batch_size is now off by 2x
    assert code == 1 and len(find(rep, "x 16 GPUs (launch: 8 GPUs x 2 nodes)", "error")) == 3
    code, rep = run_json(str(proj), "--world-size", "8")
    assert code == 0
    assert find(rep, "no hostfile", "warning")
    assert find(rep, "is relative", "warning")  # train_file data/base.jsonl
    assert find(rep, "node-local", "warning") or not str(proj).startswith("/tmp")
    assert not find(make_and_run_single_node(tmp_path / "b"), "is relative")


def make_and_run_single_node(tmp_path: Path) -> dict:
    return run_json(str(make_project(tmp_path)))[1]


# ---------------------------------------------------------------- precision, duplicates, ZeRO

def test_precision_vs_deepspeed_blocks(proj):
    ds = proj / "conf" / "deepspeed" / "zero3_offload_cosine.yaml"
    ds.write_text(ds.read_text() + "bf16:\n  enabled: true\n")
    assert run_json(str(proj))[0] == 0  # agrees with precision: bf16
    ds.write_text(ds.read_text() + "fp16:\n  enabled: true\n")
    code, rep = run_json(str(proj))
    hits = [p for p in problems(rep) if p["key"] == "ds_cfg.fp16.enabled"]
    assert code == 1 and len(hits) == 1  # long and longcot share the file: one row
    assert "disagrees with precision: bf16" in hits[0]["message"] and hits[0]["file"] == str(ds)


@pytest.mark.parametrize("old,new,needle", [
    ("    betas: ${adam_betas}", "    betas: [0.9, 0.999]", "adam_betas = [0.9, 0.95]"),
    ("    lr: ${learning_rate}", "    lr: 1.0e-4", "learning_rate = 5e-06"),
    ("gradient_accumulation_steps: ${gradient_accumulation_steps}", "gradient_accumulation_steps: 4",
     "gradient_accumulation_steps = 8"),
    ("train_micro_batch_size_per_gpu: ${per_gpu_train_batch_size}", "train_micro_batch_size_per_gpu: 2",
     "per_gpu_train_batch_size = 1"),
    ("    eps: ${adam_epsilon}", "    eps: 1.0e-8", "adam_epsilon"),
    ("gradient_clipping: ${max_grad_norm}", "gradient_clipping: 0.5", "max_grad_norm = 1.0"),
])
def test_same_hyper_parameter_twice(proj, old, new, needle):
    ds = proj / "conf" / "deepspeed" / "zero3_offload_cosine.yaml"
    edit(ds, old, new)
    code, rep = run_json(str(proj))
    hits = find(rep, "the same hyper-parameter twice", "error")
    assert code == 1 and hits and needle in hits[0]["message"]
    assert hits[0]["file"] == str(ds)


def test_equal_values_written_twice_are_fine(proj):
    ds = proj / "conf" / "deepspeed" / "zero3_offload_cosine.yaml"
    edit(ds, "    lr: ${learning_rate}", "    lr: 5.0e-6")  # same number as learning_rate
    assert run_json(str(proj))[0] == 0


@pytest.mark.parametrize("old,new,severity,needle", [
    ("stage: 3", "stage: 5", "error", "[0, 3]"),
    ("stage: 3", "stage: 0", "error", "offload_optimizer needs ZeRO stage 1, 2 or 3"),
    ("  offload_optimizer:", "  offload_param: {device: cpu}\n  offload_optimizer:", "warning", None),
    ("    pin_memory: true", "    pin_memory: maybe", "error", "true or false"),
    ("    device: cpu", "    device: nvme", "error", "nvme_path"),
])
def test_zero_sanity(proj, old, new, severity, needle):
    ds = proj / "conf" / "deepspeed" / "zero3_offload_cosine.yaml"
    edit(ds, old, new)
    _, rep = run_json(str(proj))
    if needle is None:  # offload_param with stage 3 is fine
        assert not find(rep, "offload_param")
        edit(ds, "stage: 3", "stage: 2")
        _, rep = run_json(str(proj))
        assert find(rep, "offload_param needs ZeRO stage 3 (stage is 2)", "error")
        return
    assert find(rep, needle, severity), rep["problems"]


def test_stage3_keys_and_long_stage_without_zero3(proj):
    z1 = proj / "conf" / "deepspeed" / "zero1_offload_cosine.yaml"
    z1.write_text(z1.read_text() + "  stage3_max_live_parameters: 100000000\n")
    _, rep = run_json(str(proj))
    (p,) = find(rep, "only apply to ZeRO stage 3", "warning")
    assert p["file"] == str(z1) and p["line"] == line_of(z1, "  stage3_max_live_parameters")
    edit(stage(proj, "long"), "/deepspeed@ds_cfg: zero3_offload_cosine", "/deepspeed@ds_cfg: zero1_offload_cosine")
    _, rep = run_json(str(proj))
    assert find(rep, "a 32768-token stage with ZeRO stage 1", "warning")


def test_missing_deepspeed_default(proj):
    edit(stage(proj, "long"), "/deepspeed@ds_cfg: zero3_offload_cosine", "/deepspeed@ds_cfg: zero3_ofload_cosine")
    _, rep = run_json(str(proj))
    (p,) = [p for p in problems(rep) if p["key"] == "defaults"]
    assert p["line"] == line_of(stage(proj, "long"), "  - /deepspeed") and "zero3_ofload_cosine.yaml" in p["message"] and "zero3_offload_cosine" in p["hint"]


# ---------------------------------------------------------------- batch arithmetic, positions

def test_global_batch_arithmetic(proj):
    code, rep = run_json(str(proj), "--world-size", "16")
    assert code == 1
    errs = find(rep, "global_batch_size is 2048 but 2 per GPU x 128 accumulation x 16 GPUs", "error")
    assert errs and errs[0]["hint"].startswith("set global_batch_size: 4096")
    assert [f["global_batch"] for f in rep["files"]] == [4096, 128, 512]
    edit(stage(proj, "base"), "global_batch_size: 2048", "global_batch_size: 1024")
    _, rep = run_json(str(proj))
    (p,) = find(rep, "global_batch_size is 1024", "error")
    assert "gradient_accumulation_steps to 64" in p["hint"]


def test_max_seq_length_against_the_target(proj):
    edit(stage(proj, "long"), "max_seq_length: 32768", "max_seq_length: 65536")
    _, rep = run_json(str(proj))
    (p,) = find(rep, "exceeds the target's position limit 32768", "error")
    assert p["key"] == "data.max_seq_length" and "config.json" in p["message"]


def test_max_seq_length_against_the_preset(proj):
    edit(proj / "longspec.yaml", "preset: null", "preset: qwq-32b-preview")
    edit(proj / "longspec.yaml", "target: target", "target: Qwen/QwQ-32B-Preview")
    for st in STAGES:
        edit(stage(proj, st["name"]), f"model_name_or_path: {proj}/target", "model_name_or_path: Qwen/QwQ-32B-Preview")
    edit(stage(proj, "longcot"), "max_seq_length: 32768", "max_seq_length: 40000")
    _, rep = run_json(str(proj))
    (p,) = find(rep, "exceeds the target's position limit", "error")
    assert "preset qwq-32b-preview" in p["message"] and "longcot.yaml" in p["file"]


# ---------------------------------------------------------------- single files

def test_a_stage_file_of_a_project_is_checked_in_its_project(proj):
    code, rep = run_json(str(stage(proj, "long")))
    assert code == 0 and len(rep["files"]) == 1 and find(rep, "stage base will write it", "info")


def test_a_lone_stage_file(tmp_path, proj):
    lone = tmp_path / "lone" / "conf"
    (lone / "exp").mkdir(parents=True)
    (lone / "deepspeed").mkdir()
    (lone / "exp" / "x.yaml").write_text(stage(proj, "long").read_text())
    (lone / "deepspeed" / "zero3_offload_cosine.yaml").write_text(DS.format(stage=3))
    code, rep = run_json(str(lone / "exp" / "x.yaml"))
    assert code == 1
    assert find(rep, "does not exist", "error")  # relative data/long.jsonl, runs/base/... from cwd


# ---------------------------------------------------------------- projects made by `longspec init`

def test_init_no_input_project_reports_only_what_init_left_open(tmp_path):
    res = runner.invoke(app, ["init", str(tmp_path / "p"), "--preset", "qwq-32b-preview", "--no-input"])
    assert res.exit_code == 0, res.output
    code, rep = run_json(str(tmp_path / "p"))
    assert code == 1
    errs = problems(rep, "error")
    assert [(p["key"], "???" in p["message"]) for p in errs] == [("train_file", True)] * 3
    warns = problems(rep, "warning")
    assert {p["key"] for p in warns} == {"model_name_or_path"}  # Qwen/QwQ-32B-Preview is a hub id
    assert [f["global_batch"] for f in rep["files"]] == [2048, 64, 256]


def test_init_project_with_data_and_a_local_target_passes(tmp_path):
    target = tmp_path / "QwQ-32B-Preview"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768}))
    data = []
    for name in ("base", "long", "longcot"):
        f = tmp_path / f"{name}.jsonl"
        f.write_text('{"text": "x"}\n')
        data += ["--data", f"{name}={f}"]
    res = runner.invoke(app, ["init", str(tmp_path / "p"), "--preset", "qwq-32b-preview", "--target", str(target),
                              "--no-input", *data])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["validate", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["errors"] == 0
    # The one warning a clean project can get depends on this machine: its free disk space against
    # three stages of 32B-target checkpoints (~29 GiB each).
    assert all("would fail part-way" in p["message"] for p in rep["problems"]), rep["problems"]


# ---------------------------------------------------------------- schema vs the trainer's defaults

def test_schema_knows_every_trainer_key_and_its_default_fits():
    from longspec.project import schema as S
    from longspec.files.yamlio import load_mapping, to_plain

    cfg = ROOT / "longspec" / "conf" / "config.yaml"
    defaults = to_plain(load_mapping(cfg).data)

    def walk(node: dict, specs: dict, prefix: str) -> None:
        for k, v in node.items():
            if prefix == "" and k in ("defaults", "hydra"):
                continue
            assert k in specs, f"trainer key {prefix}{k} is missing from schema.LONGSPEC_SPEC"
            spec = specs[k]
            if v != "???":
                assert S.check_value(spec, v, prefix + k, S.LONGSPEC) is None, (prefix + k, v)
            if isinstance(v, dict) and spec.children is not None:
                walk(v, spec.children, f"{prefix}{k}.")

    walk(defaults, S.LONGSPEC_SPEC, "")


# ---------------------------------------------------------------- purity (timings: bench/bench_cli.py)

def test_validate_imports_no_heavy_packages(proj):
    """Nor pyarrow: the project's data is JSONL (pyarrow is for parquet/arrow paths alone)."""
    code = ("import sys; from longspec_cli.app import main; sys.argv=['longspec','validate',%r,'--json'];\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad=[m for m in ('torch','deepspeed','transformers','textual','pyarrow') if m in sys.modules];"
            "print('HEAVY', bad)") % str(proj)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
