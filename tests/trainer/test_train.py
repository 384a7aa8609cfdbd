"""longspec.train end to end: real DeepSpeed launches (DS_ACCELERATOR=cpu) on the tiny preset.

The fast tests run `python -m longspec.train` and stop before any process group exists (bad input,
a finished stage). The slow ones launch `deepspeed --module longspec.train` with 1 or 2 CPU ranks.
Stage files are written into tmp_path/conf the way `longspec init` lays them out (docs/DESIGN.md);
the DeepSpeed files are the shipped templates/deepspeed/*.yaml.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspec.training import rank, entry, preflight
from longspec.runs import runfolder

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "templates" / "deepspeed"
PY = sys.executable
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
LAUNCH_TIMEOUT = 900

# Stage 1 as the tests run it: small enough for a shared 2-core machine, long enough to learn.
BASE_STEPS, BASE_SAVE = 30, 10
STAGE_TEXT = """\
# @package _global_
# {title}
# Run:  deepspeed --num_gpus={gpus} --module longspec.train --config-dir {conf} +exp={stage} output_dir=...
defaults:
  - /deepspeed@ds_cfg: {deepspeed}
  - _self_

stage: {stage}
model_name_or_path: {target}
draft_model_name_or_path: {draft}
train_file: {train_file}
output_dir: {output_dir}
precision: fp32

data:
  collator: {collator}
  max_seq_length: {seq}
  on_bad_record: error

positions:
  mode: anchor_offset
  anchors: 4
  max_offset: null
  threshold: 1200
cross_attn_lag: 4

draft:
  sliding_window: 512

learning_rate: {lr}
weight_decay: 0.1
adam_betas: [0.9, 0.95]
adam_epsilon: 1.0e-6
max_grad_norm: 1.0
per_gpu_train_batch_size: {batch}
gradient_accumulation_steps: {ga}
global_batch_size: null
num_train_epochs: 1
max_steps: {steps}
warmup_proportion: 0.1
save_steps: {save}
eval_steps: {eval}
eval_share: 0  # every eval_steps, as set: the tests count the evaluations
eval_tokens: 1024
save_total_limit: 2
logging_steps: 1
seed: 42

logging:
  wandb: false
  tensorboard: false
"""


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    from longspec.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


def write_project(root: Path, tiny: dict, draft: str | None = None, data: dict | None = None) -> Path:
    """root/conf/exp/{base,long}.yaml + root/conf/deepspeed/* (templates, CPU offload); `data`
    replaces a stage's train_file."""
    conf = root / "conf"
    (conf / "exp").mkdir(parents=True, exist_ok=True)
    (conf / "deepspeed").mkdir(exist_ok=True)
    for tpl in TEMPLATES.glob("*.yaml"):
        text = tpl.read_text().replace("{{offload_device}}", "cpu").replace("{{pin_memory}}", "false")
        (conf / "deepspeed" / tpl.name).write_text(text)
    stages = {
        "base": dict(title="Stage 1 (tiny)", deepspeed="zero1_offload_cosine", collator="short_text",
                     seq=96, lr=3.0e-3, batch=4, ga=1, steps=BASE_STEPS, save=BASE_SAVE, gpus=1, eval=BASE_SAVE),
        "long": dict(title="Stage 2 (tiny)", deepspeed="zero3_offload_cosine", collator="long_data",
                     seq=128, lr=1.0e-3, batch=1, ga=2, steps=4, save=2, gpus=2, eval=2),
    }
    for stage, values in stages.items():
        text = STAGE_TEXT.format(stage=stage, conf=conf, target=tiny["target"],
                                 draft="null" if draft is None else draft,
                                 train_file=(data or {}).get(stage, tiny["data"][stage]),
                                 output_dir=root / "runs" / stage,
                                 **values)
        (conf / "exp" / f"{stage}.yaml").write_text(text)
    return conf


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])
    return e


def launch_argv(conf: Path, stage: str, ranks: int, *overrides: str) -> list[str]:
    return [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", str(ranks), "--module",
            "longspec.train", "--config-dir", str(conf), f"+exp={stage}", *overrides]


def launch(conf: Path, stage: str, ranks: int, *overrides: str, extra_env: dict | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run(launch_argv(conf, stage, ranks, *overrides), cwd=conf.parent,
                          env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)


def shm_left(proc: subprocess.CompletedProcess) -> list[str]:
    """DeepSpeed's CPU allreduce buffers of this launch (its --master_port) still in /dev/shm."""
    port = proc.args[proc.args.index("--master_port") + 1]
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def direct(cwd: Path, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m longspec.train ...` without a launcher (a world of one)."""
    return subprocess.run([PY, "-m", "longspec.train", *args], cwd=cwd, env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=300)


def show(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def steps_of(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in runfolder.read_metrics(run_dir / "metrics.jsonl").steps}


def events_of(run_dir: Path) -> list[dict]:
    return runfolder.read_metrics(run_dir / "metrics.jsonl").events


@pytest.fixture(scope="module")
def base_run(tiny, tmp_path_factory) -> dict:
    """One uninterrupted stage-1 run (1 rank, ZeRO-1 + CPU offload), shared by several tests."""
    root = tmp_path_factory.mktemp("proj")
    conf = write_project(root, tiny)
    t0 = time.time()
    proc = launch(conf, "base", 1)
    return {"root": root, "conf": conf, "proc": proc, "run": root / "runs" / "base",
            "seconds": time.time() - t0}


# ----------------------------------------------------------------------------- fast: pure helpers

def test_take_local_rank_strips_both_spellings(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank.take_local_rank(["--local_rank=3", "+exp=base", "max_steps=4"]) == ["+exp=base", "max_steps=4"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.delenv("LOCAL_RANK")
    assert rank.take_local_rank(["--local_rank", "1", "x=1"]) == ["x=1"]
    assert os.environ["LOCAL_RANK"] == "1"


def test_config_dir_is_implied_only_from_a_project_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert entry.implied_config_dir(["+exp=base"]) == ["+exp=base"]  # no conf/ here: Hydra says what is missing
    (tmp_path / "conf").mkdir()
    assert entry.implied_config_dir(["+exp=base"]) == ["--config-dir", "conf", "+exp=base"]
    for given in (["--config-dir", "x"], ["--config-dir=x"], ["-cd", "x"]):
        assert entry.implied_config_dir([*given, "+exp=base"]) == [*given, "+exp=base"]


def test_seeded_generators_repeat_for_the_same_step_and_differ_across_steps():
    import torch

    a = torch.randint(0, 1 << 30, (4,), generator=rank.seeded(42, 7, 0, 0))
    b = torch.randint(0, 1 << 30, (4,), generator=rank.seeded(42, 7, 0, 0))
    c = torch.randint(0, 1 << 30, (4,), generator=rank.seeded(42, 8, 0, 0))
    assert torch.equal(a, b) and not torch.equal(a, c)


def make_checkpoint(run: Path, step: int, complete: bool = True, sha: str = "cfg", math: dict | None = None) -> Path:
    from longspec.training import runwriter

    writer = runwriter.RunWriter(run)
    path = writer.prepare_checkpoint(step)
    (path / "draft_model_weights.pth").write_bytes(b"x")
    if complete:
        writer.mark_checkpoint(path, {"step": step, "config_sha256": sha, **({"math": math} if math else {})})
    return path


def test_rotation_keeps_the_newest_complete_checkpoints_and_drops_crash_leftovers(tmp_path):
    from longspec.training import runwriter

    for step, complete in ((5, True), (10, True), (12, False), (15, True), (20, False)):
        make_checkpoint(tmp_path, step, complete)
    removed = runwriter.RunWriter(tmp_path).rotate(keep=2, current_step=15)
    assert sorted(p.name for p in removed) == ["checkpoint-12", "checkpoint-5"]
    # 20 is newer than the step being saved: not ours to judge, left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-15", "checkpoint-20"]


RESUME_CONF = {"stage": "base", "force": False, "resume_schedule": "refuse", "learning_rate": 3e-3,
               "max_steps": 30, "num_train_epochs": 1, "seed": 42, "save_steps": 10, "save_total_limit": 2,
               "logging_steps": 1, "logging": {"wandb": False}, "kernels": "auto", "eval_every": 5,
               "data": {"collator": "short_text", "max_seq_length": 96}, "ds_cfg": {"steps_per_print": 10}}


def test_resume_picks_the_newest_complete_checkpoint_and_refuses_another_config(tmp_path):
    from longspec.training import runwriter, resume

    writer = runwriter.RunWriter(tmp_path)
    origin = preflight.Origin(exp_file=None, overrides=[], config_sha256="cfg")
    conf = dict(RESUME_CONF)
    assert resume.decide_resume(writer, origin, conf) is None
    make_checkpoint(tmp_path, 10, math=resume.math_config(conf))
    make_checkpoint(tmp_path, 20, complete=False)           # killed while saving
    assert resume.decide_resume(writer, origin, conf).step == 10
    make_checkpoint(tmp_path, 30, sha="other")               # saved before checkpoints named their math keys
    with pytest.raises(entry.TrainError, match="another config") as e:
        resume.decide_resume(writer, origin, conf)
    assert "force=true starts over" in str(e.value)
    assert resume.decide_resume(writer, origin, {**conf, "force": True}) is None


def test_only_math_keys_block_a_resume_and_a_longer_schedule_needs_stretch(tmp_path):
    from longspec.training import runwriter, resume

    writer = runwriter.RunWriter(tmp_path)
    origin = preflight.Origin(exp_file=None, overrides=[], config_sha256="now")
    conf = dict(RESUME_CONF)
    # saving, logging, tracking, eval, kernels: the checkpoint resumes
    saved = {**conf, "save_steps": 5, "save_total_limit": 9, "logging_steps": 3, "logging": {"wandb": True},
             "kernels": "reference", "eval_every": 50, "ds_cfg": {"steps_per_print": 1}}
    make_checkpoint(tmp_path, 10, sha="before", math=resume.math_config(saved))
    assert resume.decide_resume(writer, origin, conf).step == 10
    # a math key: refused, naming the key, its two values; the checkpoints stay
    make_checkpoint(tmp_path, 20, sha="before", math=resume.math_config({**conf, "learning_rate": 1e-3,
                                                                         "data": {**conf["data"], "max_seq_length": 64}}))
    with pytest.raises(entry.TrainError, match=r"data.max_seq_length 64 -> 96, learning_rate 0.001 -> 0.003") as e:
        resume.decide_resume(writer, origin, conf)
    assert "checkpoints are kept" in str(e.value) and (tmp_path / "checkpoint-20").is_dir()
    # the schedule's length: refused unless resume_schedule=stretch, which says what the lr does
    make_checkpoint(tmp_path, 30, sha="before", math=resume.math_config({**conf, "max_steps": 10}))
    with pytest.raises(entry.TrainError, match=r"schedule's length changed \(max_steps 10 -> 30\)") as e:
        resume.decide_resume(writer, origin, conf)
    assert "resume_schedule=stretch" in str(e.value) and "learning rate continues on the new curve" in str(e.value)
    assert resume.decide_resume(writer, origin, {**conf, "resume_schedule": "stretch"}).step == 30
    # stretch does not excuse another math key
    make_checkpoint(tmp_path, 40, sha="before", math=resume.math_config({**conf, "max_steps": 10, "seed": 1}))
    with pytest.raises(entry.TrainError, match="seed 1 -> 42"):
        resume.decide_resume(writer, origin, {**conf, "resume_schedule": "stretch"})


# ----------------------------------------------------------------------------- fast: refused input

def assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, show(proc)
    assert proc.stderr.lstrip().startswith("error:") or "\nerror:" in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    for needle in needles:
        assert needle in proc.stderr, show(proc)


def no_outputs(run_dir: Path) -> None:
    assert not (run_dir / "draft_model_weights.pth").exists()
    assert not (run_dir / "stage_complete.json").exists()


def test_wrong_type_override_is_refused_before_the_model_loads(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    t0 = time.time()
    # the target path is broken too: a check that ran after loading it would report the target
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", "max_steps=abc",
                  "precision=fp64", "model_name_or_path=/nonexistent")
    assert_refused(proc, "max_steps must be a number, got 'abc'", "precision = 'fp64' is not one of")
    assert "nonexistent" not in proc.stderr
    assert time.time() - t0 < 60
    no_outputs(tmp_path / "runs" / "base")
    # Hydra left no folders or logs behind (output_subdir null, run.dir '.', no job log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf"]


def test_package_header_after_a_comment_is_explained(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    exp = conf / "exp" / "base.yaml"
    exp.write_text("# a title first\n" + exp.read_text())
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base")
    assert_refused(proc, "`# @package _global_` must be its first line")


def test_unknown_key_in_the_stage_file_gets_a_suggestion(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    exp = conf / "exp" / "base.yaml"
    exp.write_text(exp.read_text().replace("learning_rate:", "learning_rat:"))
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base")
    assert_refused(proc, "learning_rat: unknown key (did you mean learning_rate?)")


@pytest.mark.skipif(torch_cuda(), reason="checks the refusal on a machine without CUDA")
def test_fused_kernels_without_a_gpu_fail_loudly(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", "kernels=fused", "precision=bf16")
    assert_refused(proc, "kernels = fused but no CUDA device", "kernels=auto")
    no_outputs(tmp_path / "runs" / "base")
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", "kernels=fused", "precision=fp32")
    assert_refused(proc, "kernels = fused needs precision bf16 or fp16")


def test_missing_data_file_is_refused(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"train_file={tmp_path}/nope.jsonl")
    assert_refused(proc, "train_file", "nope.jsonl")
    no_outputs(tmp_path / "runs" / "base")


def test_record_without_expected_fields_is_refused_with_its_line(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat sees the dog ."}\n{"title": "no text here"}\n')
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"train_file={bad}")
    assert_refused(proc, "bad.jsonl:2", "missing field 'text'")
    no_outputs(tmp_path / "runs" / "base")


def test_target_that_is_not_a_causal_lm_is_refused(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    enc = tmp_path / "encoder"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"model_name_or_path={enc}")
    assert_refused(proc, "not a causal language model")
    no_outputs(tmp_path / "runs" / "base")


def fresh_draft_state(target: str):
    import torch
    from transformers import AutoConfig

    from longspec.model.glide import DraftConfig, GlideDraft

    torch.manual_seed(0)
    return GlideDraft(DraftConfig.from_target_config(AutoConfig.from_pretrained(target))).state_dict()


class _Payload:
    """Unpickling this runs `touch <marker>`: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_draft_is_refused_and_nothing_runs(tiny, tmp_path):
    import torch

    conf = write_project(tmp_path, tiny)
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pth"
    state = dict(fresh_draft_state(tiny["target"]))
    state["__payload__"] = _Payload(marker)
    torch.save(state, evil)
    with open(evil, "rb") as f:                      # the payload really is in the file
        assert b"system" in f.read()
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"draft_model_name_or_path={evil}")
    assert_refused(proc, "evil.pth", "nothing from it was executed")
    assert not marker.exists()
    no_outputs(tmp_path / "runs" / "base")


def test_truncated_draft_is_refused(tiny, tmp_path):
    import torch

    conf = write_project(tmp_path, tiny)
    good = tmp_path / "good.pth"
    torch.save(fresh_draft_state(tiny["target"]), good)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"draft_model_name_or_path={cut}")
    assert_refused(proc, "cut.pth", "corrupt or truncated")
    no_outputs(tmp_path / "runs" / "base")


def test_draft_with_wrong_shapes_is_refused_naming_key_and_shapes(tiny, tmp_path):
    import torch

    conf = write_project(tmp_path, tiny)
    state = dict(fresh_draft_state(tiny["target"]))
    state["mlp.up_proj.weight"] = torch.zeros(7, 3)
    wrong = tmp_path / "wrong.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(wrong))
    proc = direct(tmp_path, "--config-dir", str(conf), "+exp=base", f"draft_model_name_or_path={wrong}")
    assert_refused(proc, "mlp.up_proj.weight", "(7, 3)")
    no_outputs(tmp_path / "runs" / "base")


# ----------------------------------------------------------------------------- slow: real launches

@pytest.mark.slow
def test_stage1_one_rank_zero1_trains_and_fills_the_run_folder(base_run):
    proc, run = base_run["proc"], base_run["run"]
    assert proc.returncode == 0, show(proc)
    assert "exits successfully" in proc.stdout + proc.stderr

    steps = steps_of(run)
    assert sorted(steps) == list(range(1, BASE_STEPS + 1))
    for rec in steps.values():
        assert set(rec) == {"step", "total_steps", "loss", "llm_loss", "lr", "tokens_per_s", "elapsed_s", "time"}
        assert rec["total_steps"] == BASE_STEPS and rec["tokens_per_s"] > 0
    losses = [steps[s]["loss"] for s in sorted(steps)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first 5 {first:.3f}, last 5 {last:.3f}"

    kinds = [e["event"] for e in events_of(run)]
    assert kinds[0] == "start" and kinds[-1] == "end"
    # the kernels actually used are on record (and in the rank-0 log): the reference path on CPU
    assert events_of(run)[0]["kernels"] == {"attention": "sdpa", "linear_cross_entropy": "chunked",
                                            "target_attention": "sdpa", "tf32": "off"}
    assert "[base] kernels (auto): attention sdpa (target sdpa), loss chunked, tf32 off" in proc.stdout
    ckpt_events = [e["step"] for e in events_of(run) if e["event"] == "checkpoint"]
    assert ckpt_events == list(range(BASE_SAVE, BASE_STEPS + 1, BASE_SAVE))
    # save_total_limit 2: the two newest complete checkpoints stay
    kept = runfolder.RunDir(run).checkpoints()
    assert [c.step for c in kept] == [BASE_STEPS - BASE_SAVE, BASE_STEPS]
    for c in kept:
        assert (c.path / "draft_model_weights.pth").is_file() and (c.path / "ds").is_dir()

    from longspec.model.weights import load_draft_state
    from longspec.files.atomic import sha256_file

    done = json.loads((run / "stage_complete.json").read_text())
    assert done["stage"] == "base" and done["steps"] == BASE_STEPS and done["draft_sha256"] is None
    assert done["sha256"] == sha256_file(run / "draft_model_weights.pth")
    assert done["final_loss"] == pytest.approx(losses[-1])
    exp = base_run["conf"] / "exp" / "base.yaml"
    assert done["config_sha256"] == runfolder.config_fingerprint(exp, [])
    # the math keys it records are the front end's composition of the stage file: `status` keeps
    # the stage done after an edit of keys that do not change training, and names a math key otherwise
    from longspec.project.hydracompose import compose_stage
    from longspec.project.mathkeys import math_config

    composed = compose_stage(exp, [])
    assert composed.ok and done["math"] == math_config(composed.data)
    assert done["math"]["learning_rate"] == 3.0e-3 and "logging_steps" not in done["math"]
    assert (run / "draft_model_weights.safetensors").is_file()
    state = load_draft_state(run / "draft_model_weights.pth")
    assert set(state) == set(fresh_draft_state(done["target"]))
    assert all(t.device.type == "cpu" for t in state.values())

    import yaml

    resolved = yaml.safe_load((run / "training_config.yaml").read_text())
    assert resolved["learning_rate"] == 3.0e-3
    assert resolved["ds_cfg"]["scheduler"]["params"]["total_num_steps"] == BASE_STEPS
    assert resolved["ds_cfg"]["optimizer"]["params"]["lr"] == 3.0e-3
    assert_simtau(run, list(range(0, BASE_STEPS + 1, BASE_SAVE)))
    # the rank-0 progress line
    assert re.search(rf"\[base\] step {BASE_STEPS}/{BASE_STEPS} loss \d+\.\d+ .* tok/s ETA", proc.stdout)
    # nothing stray next to the project (Hydra run dirs, logs)
    assert sorted(p.name for p in base_run["root"].iterdir()) == ["conf", "runs"]


@pytest.mark.slow
def test_completed_stage_is_not_retrained(base_run):
    run = base_run["run"]
    assert base_run["proc"].returncode == 0, show(base_run["proc"])
    before = (run / "metrics.jsonl").read_bytes()
    weights_mtime = (run / "draft_model_weights.pth").stat().st_mtime_ns
    proc = direct(base_run["root"], "--config-dir", str(base_run["conf"]), "+exp=base")
    assert proc.returncode == 0, show(proc)
    assert "already complete" in proc.stdout
    assert (run / "metrics.jsonl").read_bytes() == before
    assert (run / "draft_model_weights.pth").stat().st_mtime_ns == weights_mtime


@pytest.mark.slow
def test_kill_9_mid_stage_then_resume_ends_like_an_uninterrupted_run(base_run, tiny, tmp_path):
    assert base_run["proc"].returncode == 0, show(base_run["proc"])
    conf = write_project(tmp_path, tiny)
    run = tmp_path / "runs" / "base"
    argv = launch_argv(conf, "base", 1)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(argv, cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.time() + LAUNCH_TIMEOUT
        try:
            while time.time() < deadline and first.poll() is None:
                ckpts = [e["step"] for e in events_of(run) if e["event"] == "checkpoint"] if run.exists() else []
                if ckpts and max(steps_of(run), default=0) >= BASE_SAVE + 2:
                    break
                time.sleep(0.05)  # steps are fast here: a slow poll can miss the whole stage
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    killed_at = max(steps_of(run))
    assert BASE_SAVE + 2 <= killed_at < BASE_STEPS
    no_outputs(run)
    heldout_before = (run / "heldout.json").read_bytes()
    best_before = runfolder.RunDir(run).best()
    assert best_before is not None

    proc = launch(conf, "base", 1)
    assert proc.returncode == 0, show(proc)
    resumes = [e for e in events_of(run) if e["event"] == "resume"]
    assert len(resumes) == 1
    resumed_at = resumes[0]["step"]
    assert resumed_at % BASE_SAVE == 0 and resumed_at <= killed_at
    done = json.loads((run / "stage_complete.json").read_text())
    reference = json.loads((base_run["run"] / "stage_complete.json").read_text())
    assert done["steps"] == reference["steps"] == BASE_STEPS
    assert done["config_sha256"] == runfolder.config_fingerprint(conf / "exp" / "base.yaml", [])

    # the held-out set is the same file, and best/ was kept (beaten only by a higher tau) unless it
    # came from a step after the checkpoint resumed from: then it went, and the resumed draft was measured
    assert (run / "heldout.json").read_bytes() == heldout_before == (base_run["run"] / "heldout.json").read_bytes()
    recs = runfolder.read_metrics(run / "metrics.jsonl").simtau
    best = runfolder.RunDir(run).best()
    if best_before["step"] <= resumed_at:
        assert best["tau"] >= best_before["tau"] and best["tau"] == max(r["tau"] for r in recs)
        if best["step"] == best_before["step"]:
            assert best == best_before
    else:
        assert "dropped" in proc.stdout and best["step"] >= resumed_at
    # the continuations were made once (or read from the host's shared cache: the base run's), before
    # the kill, and read back by the resumed run from its run folder
    firsts = [r for r in recs if "continuations_s" in r]
    assert len(firsts) == 2 and (firsts[0]["continuations_made"] or firsts[0]["continuations_cached"])
    assert not firsts[1]["continuations_made"] and firsts[1]["continuations_cached"] == 0
    ref = {r["step"]: r["tau"] for r in runfolder.read_metrics(base_run["run"] / "metrics.jsonl").simtau}
    assert {r["step"]: r["tau"] for r in recs if r["step"] > resumed_at} == pytest.approx(
        {s: t for s, t in ref.items() if s > resumed_at}, abs=2e-3)
    # the steps after the resume see the same batches, positions and optimizer state
    ours, theirs = steps_of(run), steps_of(base_run["run"])
    for s in range(resumed_at + 1, BASE_STEPS + 1):
        assert ours[s]["loss"] == pytest.approx(theirs[s]["loss"], rel=1e-3, abs=1e-3), s
        assert ours[s]["lr"] == pytest.approx(theirs[s]["lr"], rel=1e-6)


@pytest.mark.slow
def test_a_longer_max_steps_resumes_with_the_stretched_schedule_and_never_for_logging(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    run = tmp_path / "runs" / "base"
    args = ("--config-dir", str(conf), "+exp=base")
    short = direct(tmp_path, *args, "max_steps=2")               # ends with checkpoint-2, lr decayed to its end
    assert short.returncode == 0, show(short)
    ckpt = run / "checkpoint-2"
    assert (ckpt / "checkpoint.json").is_file()

    # a longer schedule, with saving and kernel keys changed too: refused, the checkpoint kept
    longer = ("max_steps=4", "save_total_limit=3", "kernels=reference")
    refused = direct(tmp_path, *args, *longer)
    assert_refused(refused, "schedule's length changed", "max_steps 2 -> 4", "resume_schedule=stretch", "force=true")
    assert (ckpt / "checkpoint.json").is_file()

    resumed = direct(tmp_path, *args, *longer, "resume_schedule=stretch")
    assert resumed.returncode == 0, show(resumed)
    assert "schedule stretched" in resumed.stdout
    resumes = [e for e in events_of(run) if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [2] and resumes[0]["total_steps"] == 4
    assert json.loads((run / "stage_complete.json").read_text())["steps"] == 4
    steps = steps_of(run)
    assert steps[2]["total_steps"] == 2 and steps[3]["total_steps"] == steps[4]["total_steps"] == 4
    # the learning rate continues on the longer curve: back up from the short run's end, then decaying
    assert steps[3]["lr"] > steps[2]["lr"] and steps[3]["lr"] > steps[4]["lr"]


@pytest.mark.slow
def test_tau_while_training_stays_within_its_share_and_a_rerun_reuses_the_continuations(tiny, tmp_path):
    conf = write_project(tmp_path, tiny)
    run = tmp_path / "runs" / "base"
    cache = {"LONGSPEC_CACHE_DIR": str(tmp_path / "cache")}     # the host's shared cache, fresh
    args = ("--config-dir", str(conf), "+exp=base", "eval_steps=1")
    spaced = direct(tmp_path, *args, "max_steps=6", "eval_share=0.001", extra_env=cache)   # a walk outweighs 1000 steps
    assert spaced.returncode == 0, show(spaced)
    assert "stays within 0% of the stage's time (eval_share" in spaced.stdout
    # the first evaluation (continuations, the target over the held-out rows) is earned back first:
    # none between the stage's two, its start and its end
    assert re.search(r"tau at step 1 deferred: tau took [\d.]+ s of the stage's [\d.]+ s so far, over its 0%",
                     spaced.stdout), show(spaced)
    recs = runfolder.read_metrics(run / "metrics.jsonl").simtau
    assert [r["step"] for r in recs] == [0, 6]
    assert recs[0]["continuations_made"] is True and recs[0]["continuations_cached"] == 0
    assert 0 < recs[-1]["share"] < 1
    assert "tau while training took" in spaced.stdout
    made = json.loads((run / "continuations.json").read_text())
    (shared,) = (tmp_path / "cache" / "continuations").iterdir()
    assert sorted(f.stem for f in shared.glob("*.json")) == sorted({p["key"] for p in made["prompts"]})
    # another run folder, the same stage: every continuation read from the shared cache, none made,
    # and the same tau at step 0 (the same fresh draft on the same prompts)
    other = direct(tmp_path, *args, "max_steps=6", "eval_share=0.001", f"output_dir={tmp_path / 'other'}",
                   extra_env=cache)
    assert other.returncode == 0, show(other)
    first = runfolder.read_metrics(tmp_path / "other" / "metrics.jsonl").simtau[0]
    assert not first["continuations_made"] and first["continuations_cached"] == first["prompts"] == len(made["prompts"])
    assert first["tau"] == recs[0]["tau"]
    # another max_steps, every step as set: the continuations are read back, not made again
    rerun = direct(tmp_path, *args, "max_steps=8", "eval_share=0", "force=true", extra_env=cache)
    assert rerun.returncode == 0, show(rerun)
    assert "every 1 steps (eval_share 0: as set)" in rerun.stdout
    recs = runfolder.read_metrics(run / "metrics.jsonl").simtau
    assert [r["step"] for r in recs][-9:] == list(range(9))
    first = [r for r in recs if "continuations_s" in r][-1]
    assert first["continuations_reused"] > 0
    again = json.loads((run / "continuations.json").read_text())
    shared = {p["key"]: p["tokens"] for p in made["prompts"]}
    assert all(p["tokens"] == shared[p["key"]] for p in again["prompts"] if p["key"] in shared)


@pytest.mark.slow
def test_stage2_two_ranks_zero3_offload_chains_from_stage1_and_every_rank_exits_0(base_run, tiny, tmp_path):
    """A two-rank ZeRO-3 run on gloo aborted at exit ("terminate called without an active
    exception", -6) unless the process group is torn down; each rank must exit 0."""
    assert base_run["proc"].returncode == 0, show(base_run["proc"])
    stage1 = base_run["run"] / "draft_model_weights.pth"
    from tests.hubfiles import write_saved_dataset

    records = [json.loads(line) for line in Path(tiny["data"]["long"]).read_text().splitlines() if line.strip()]
    saved = write_saved_dataset(records, tmp_path / "long_saved")    # the stage's data as save_to_disk wrote it
    conf = write_project(tmp_path, tiny, draft=str(stage1), data={"long": saved})
    proc = launch(conf, "long", 2, extra_env={"LONGSPEC_CACHE_DIR": str(tmp_path / "cache")})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, show(proc)
    assert len(re.findall(r"Process \d+ exits successfully", out)) == 2, show(proc)
    # both ranks start on a missing prepared cache: one tokenizes, the other uses what it built
    assert len(re.findall(r"prepare \(rank \d\): tokenizing", out)) == 1, show(proc)
    assert len(list((tmp_path / "cache" / "prepared").glob("*/manifest.json"))) == 1
    assert "terminate called" not in out and "exits with return code" not in out
    # DeepSpeed's CPU comm op made a 66 MB shared-memory buffer per rank; none is left in /dev/shm
    assert shm_left(proc) == []

    # each rank built the target and the draft already partitioned: about half of each, never all
    built = re.findall(r"rank (\d+): ZeRO-3 partitioned at load: target ([\d,]+) of ([\d,]+) bytes, "
                       r"draft ([\d,]+) of ([\d,]+) bytes", proc.stdout)
    assert sorted(int(b[0]) for b in built) == [0, 1], show(proc)
    for _, *figures in built:
        t_held, t_whole, d_held, d_whole = (int(f.replace(",", "")) for f in figures)
        assert_half(t_held, t_whole)
        assert_half(d_held, d_whole)

    run = tmp_path / "runs" / "long"
    done = json.loads((run / "stage_complete.json").read_text())
    stage1_done = json.loads((base_run["run"] / "stage_complete.json").read_text())
    assert done["stage"] == "long" and done["steps"] == 4
    assert done["draft_sha256"] == stage1_done["sha256"]          # the chain is recorded
    assert sorted(steps_of(run)) == [1, 2, 3, 4]
    # simulated tau under ZeRO-3 on two ranks: both took part, counts reduced; step 0 is stage 1's draft
    assert_simtau(run, [0, 2, 4])
    start = [e for e in events_of(run) if e["event"] == "start"][0]
    assert start["world_size"] == 2

    from longspec.model.weights import load_draft_state

    # gathered under ZeRO-3: full shapes, the same keys as stage 1, and training moved them
    final, initial = load_draft_state(run / "draft_model_weights.pth"), load_draft_state(stage1)
    assert {k: tuple(v.shape) for k, v in final.items()} == {k: tuple(v.shape) for k, v in initial.items()}
    assert any(not (final[k] == initial[k]).all() for k in final)


def assert_simtau(run: Path, steps: list[int]) -> list[dict]:
    """Tau records at `steps`, walked over eval's default prompts (every rank's share counted), the
    continuations made once, and best/ = the best of them."""
    recs = runfolder.read_metrics(run / "metrics.jsonl").simtau
    assert [r["step"] for r in recs] == steps
    held = json.loads((run / "heldout.json").read_text())
    assert 0 < held["tokens"] <= 1024 and held["records"] == len(held["lengths"])
    conts = json.loads((run / "continuations.json").read_text())
    for r in recs:
        assert r["prompts"] == len(conts["prompts"]) > 0 and r["blocks"] >= r["prompts"]
        assert len(r["alpha"]) == r["gamma"] == 4 and all(0 <= a <= 1 for a in r["alpha"])
        assert 1 <= r["tau"] <= 5 and sum(b["prompts"] for b in r["by_length"]) == r["prompts"]
    assert recs[0]["continuations_made"] or recs[0]["continuations_cached"] == recs[0]["prompts"]   # made once
    assert all("continuations_s" not in r for r in recs[1:])
    for c in conts["prompts"]:
        assert len(c["tokens"]) == c["max_new"] + 4 and 1 <= c["end"] <= c["max_new"]
    best = runfolder.RunDir(run).best()
    top = max(recs, key=lambda r: r["tau"])
    assert best is not None and (best["step"], best["tau"]) == (top["step"], top["tau"])
    assert [r["step"] for r in recs if r["best"]][-1] == top["step"]
    return recs


def assert_half(held: int, whole: int, world: int = 2) -> None:
    """A rank holds its 1/world share of the parameter bytes (plus a little partition padding)."""
    assert whole > 0 and whole / world <= held <= whole / world * 1.02, (held, whole)


ZERO3_BUILD = """
import json, sys
import torch, deepspeed
from longspec.model.weights import gather_draft_state
from longspec.model.glide import build_glide
from longspec.model.zero import parameter_bytes

target, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.distributed.barrier()
from longspec.training.rank import unlink_shm_buffer
unlink_shm_buffer(rank)   # as the trainer does
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3}}
torch.manual_seed(0)
plain = build_glide(target, sliding_window=8, dtype=torch.float32)
torch.manual_seed(0)
model = build_glide(target, sliding_window=8, dtype=torch.float32, zero3_config=ds)
record = {"plain": parameter_bytes(plain.target), "target": parameter_bytes(model.target),
          "draft": parameter_bytes(model.draft),
          "draft_dtype": str(model.draft.self_attn.q_proj.weight.dtype),
          "partitioned": [n for n, p in model.named_parameters() if hasattr(p, "ds_id")],
          "names": [n for n, _ in model.named_parameters()]}
for name in ("target", "draft"):
    whole, ref = gather_draft_state(getattr(model, name)), getattr(plain, name).state_dict()
    record[name + "_differs"] = sorted(k for k in ref if k not in whole or not torch.equal(ref[k], whole[k]))
# whole copies (what the tau evaluation runs on): the plain build's values, not partitioned
from longspec.measure.chainwalk import greedy_batch
from longspec.model.zero import meta_shell, whole_copy
cpu = torch.device("cpu")
hf = model.target.model
copies = {"target": (whole_copy(hf, meta_shell(lambda: type(hf)(hf.config)), cpu), plain.target.model),
          "draft": (whole_copy(model.draft, meta_shell(lambda: type(model.draft)(model.draft.config)), cpu),
                    plain.draft)}
for name, (copy, ref) in copies.items():
    got, want = copy.state_dict(), ref.state_dict()
    record[name + "_copy_differs"] = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    record[name + "_copy_partitioned"] = [n for n, p in copy.named_parameters() if hasattr(p, "ds_id")]
ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
# the copy's non-persistent buffers and attributes (rotary tables) too, which a state_dict leaves out
record["greedy_same"] = greedy_batch(plain.target.model, ids, 8, cpu) == greedy_batch(copies["target"][0], ids, 8, cpu)
# trained under ZeRO-3 (every parameter partitioned, lm_head included): the plain model's losses
# and draft gradients
from deepspeed.utils import safe_get_full_grad
from longspec.training.positions import anchor_offset_position_ids
g = torch.Generator().manual_seed(0)
B, T = 2, 24
tok = torch.randint(0, plain.target.lm_head.weight.shape[0], (B, T), generator=g)
labels = tok.clone()
labels[:, :3] = -100                                   # a masked prompt
pos = anchor_offset_position_ids(T, B, anchors=4, max_offset=5000, generator=g)
ref = plain(tok, labels, pos, 2)
ref["loss"].backward()
ref_grads = {n: p.grad for n, p in plain.draft.named_parameters() if p.requires_grad}
cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
       "zero_allow_untested_optimizer": True}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.trainable_parameters(), lr=1e-3),
                                  config=cfg)
w = model.target.lm_head.weight
record["lm_head_partitioned"] = hasattr(w, "ds_id") and w.numel() == 0
res = engine(tok, labels, pos, 2)
record["loss_diff"] = [abs(res[k].item() - ref[k].item()) for k in ("loss", "llm_loss")]
engine.backward(res["loss"])
record["grad_diff"] = max((safe_get_full_grad(p) - ref_grads[n]).abs().max().item()
                          for n, p in model.draft.named_parameters() if p.requires_grad)
engine.step()
with open(f"{out}.{rank}.json", "w") as f:
    json.dump(record, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_zero3_build_partitions_target_and_draft_on_each_rank_with_unchanged_values(tiny, tmp_path):
    """Under ZeRO-3 build_glide partitions while it builds: each of 2 ranks holds half of the
    target's and the draft's parameter bytes, and gathered they equal a plain build (the target's
    weights loaded, the draft's seeded init applied); so do the whole copies the tau evaluation
    runs on (longspec.model.zero.whole_copy), which decode the same greedy tokens. Wrapped by
    deepspeed.initialize (lm_head partitioned too), it gives the plain model's losses and draft
    gradients."""
    script = tmp_path / "zero3_build.py"
    script.write_text(ZERO3_BUILD)
    out = tmp_path / "built"
    proc = subprocess.run([DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(script),
                           tiny["target"], str(out)], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, show(proc)
    assert shm_left(proc) == []
    for i in (0, 1):
        r = json.loads(Path(f"{out}.{i}.json").read_text())
        assert r["partitioned"] == r["names"]                  # every parameter, target and draft
        assert r["plain"][0] == r["plain"][1] == r["target"][1]  # without ZeRO-3: the whole target
        assert_half(*r["target"])
        assert_half(*r["draft"])
        assert r["target_differs"] == [] and r["draft_differs"] == []
        assert r["target_copy_differs"] == r["draft_copy_differs"] == [] and r["greedy_same"] is True
        assert r["target_copy_partitioned"] == r["draft_copy_partitioned"] == []
        assert r["draft_dtype"] == "torch.float32"
        assert r["lm_head_partitioned"] is True                # else the checks below prove nothing
        assert max(r["loss_diff"]) < 1e-5 and r["grad_diff"] < 1e-5, (r["loss_diff"], r["grad_diff"])


@pytest.mark.slow
def test_tau_while_training_is_evals_default_chain_tau(base_run):
    """The trainer's tau at its last step is what `eval` measures for the final draft by default
    (same prompts, buckets, limits, stop tokens, continuations), and eval finds the trainer's
    continuations made from the same prompts and equal to its own greedy output."""
    assert base_run["proc"].returncode == 0, show(base_run["proc"])
    run = base_run["run"]
    proc = subprocess.run([PY, "-m", "longspec.evaluate", str(run), "--no-write", "--json"],
                          capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, show(proc)
    ev = json.loads(proc.stdout.strip().splitlines()[-1])
    last = runfolder.RunDir(run).last_simtau_record()
    assert last["step"] == BASE_STEPS and last["prompts"] == ev["prompts"]
    assert last["tau"] == pytest.approx(ev["tau"], abs=2e-3), (last, ev["by_length"])
    assert [(b["length"], b["prompts"]) for b in last["by_length"]] == [(b["length"], b["prompts"]) for b in ev["by_length"]]
    assert [b["tau"] for b in last["by_length"]] == pytest.approx([b["chain"]["tau"] for b in ev["by_length"]], abs=2e-3)
    assert ev["continuations"] == {"file": "continuations.json", "same_digest": True, "prompts": ev["prompts"],
                                   "same_greedy_output": ev["prompts"]}


def test_importing_the_trainer_loads_no_torch_before_the_stop_signal_watcher():
    # main() installs the watcher (SIGTERM blocked, taken by one thread) before torch starts its
    # threads; a module-level torch import anywhere on train's import path would break that.
    code = "import sys, longspec.train; print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("module", ["longspec.nodelaunch", "longspec.nodectl"])
def test_the_node_tools_load_no_torch_through_a_package_face(module):
    """nodelaunch and nodectl run on every node of a multi-node run (over ssh, under sbatch) and must
    start at once: longspec.training.preempt reaches them through longspec/training/__init__.py."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
