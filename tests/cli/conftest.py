"""Fixtures for status / next-stage: a three-stage project written by hand per docs/DESIGN.md, and
run folders that keep the run-folder contract (metrics.jsonl, checkpoints, stage_complete.json
naming the sha256 of a real torch-saved draft).

The drafts are made once per session in a subprocess (so this test process never imports torch).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from longspec.runs.runfolder import config_fingerprint

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None

# A tiny qwen2 config.json: enough for longspec.model.glide.DraftConfig.from_target_config.
TINY_TARGET_CONFIG = {
    "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "hidden_act": "silu", "vocab_size": 64,
}

_MAKE_DRAFTS = r"""
import json, sys, torch
from pathlib import Path
out = Path(sys.argv[1])
for i in range(3):
    torch.manual_seed(i)
    torch.save({"w": torch.randn(4, 4), "b": torch.randn(4)}, out / f"plain{i}.pth")
from types import SimpleNamespace
from longspec.model.glide import DraftConfig, GlideDraft
cfg = DraftConfig.from_target_config(SimpleNamespace(**json.loads(sys.argv[2])))
torch.manual_seed(0)
torch.save(GlideDraft(cfg).state_dict(), out / "glide.pth")
"""


def _fake_drafts(out: Path) -> None:
    """Without torch: distinct byte strings stand in for drafts (the deep check is off then)."""
    for i in range(3):
        (out / f"plain{i}.pth").write_bytes(b"PK\x03\x04 fake draft %d " % i + os.urandom(64))


@pytest.fixture(scope="session")
def drafts(tmp_path_factory) -> dict[str, bytes]:
    """{"0","1","2": distinct loadable drafts; "glide": a draft that fits TINY_TARGET_CONFIG (torch only)}."""
    out = tmp_path_factory.mktemp("drafts")
    if HAS_TORCH:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", _MAKE_DRAFTS, str(out), json.dumps(TINY_TARGET_CONFIG)],
                       check=True, env=env, capture_output=True, timeout=300)
    else:
        _fake_drafts(out)
    got = {str(i): (out / f"plain{i}.pth").read_bytes() for i in range(3)}
    if (out / "glide.pth").exists():
        got["glide"] = (out / "glide.pth").read_bytes()
    return got


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """The sha256 / deep-check caches go to this test's folder, never to ~/.cache."""
    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / ".cache"))


STAGE_YAML = """\
# @package _global_
# python -m longspec.train --config-dir {root}/conf +exp={name}
defaults:
  - /deepspeed@ds_cfg: zero1_offload_cosine
  - _self_

stage: {name}
model_name_or_path: {target}   # the frozen target
draft_model_name_or_path: null
train_file: {root}/data/{name}.jsonl
output_dir: {root}/runs/{name}
precision: bf16
data:
  collator: short_text
  max_seq_length: 1024
learning_rate: 5.0e-4
adam_betas: [0.9, 0.95]
"""

MANIFEST = """\
# longspec project manifest
name: demo
preset: null
variant: sinkpi-slicing
target: assets/target
launch: {gpus: 1, nodes: 1, hostfile: null}
stages:
  - {name: base,    config: conf/exp/base.yaml,    output_dir: runs/base,    draft_from: null}
  - {name: long,    config: conf/exp/long.yaml,    output_dir: runs/long,    draft_from: base}
  - {name: longcot, config: conf/exp/longcot.yaml, output_dir: runs/longcot, draft_from: long}
"""

STAGES = ("base", "long", "longcot")
UPSTREAM = {"base": None, "long": "base", "longcot": "long"}


@dataclass
class Project:
    root: Path

    def config(self, stage: str) -> Path:
        return self.root / "conf" / "exp" / f"{stage}.yaml"

    def out(self, stage: str) -> Path:
        return self.root / "runs" / stage

    def weights(self, stage: str) -> Path:
        return self.out(stage) / "draft_model_weights.pth"

    @property
    def target(self) -> Path:
        return self.root / "assets" / "target"

    def sha(self, stage: str) -> str:
        return hashlib.sha256(self.weights(stage).read_bytes()).hexdigest()

    def set_draft_key(self, stage: str, value: str) -> None:
        p = self.config(stage)
        p.write_text(p.read_text().replace("draft_model_name_or_path: null", f"draft_model_name_or_path: {value}"))


@pytest.fixture
def project(tmp_path) -> Project:
    root = tmp_path / "proj"
    (root / "conf" / "exp").mkdir(parents=True)
    (root / "conf" / "deepspeed").mkdir()
    (root / "conf" / "deepspeed" / "zero1_offload_cosine.yaml").write_text("zero_optimization:\n  stage: 1\n")
    (root / "assets" / "target").mkdir(parents=True)
    (root / "longspec.yaml").write_text(MANIFEST)
    for name in STAGES:
        (root / "conf" / "exp" / f"{name}.yaml").write_text(
            STAGE_YAML.format(root=root, name=name, target=root / "assets" / "target"))
    return Project(root)


def write_metrics(out: Path, steps: int, total: int, *, end: bool = True, error: str | None = None,
                  extra_lines: list[str] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t = 1_700_000_000.0
    lines = [json.dumps({"event": "start", "step": 0, "time": t, "total_steps": total})]
    for s in range(1, steps + 1):
        lines.append(json.dumps({"step": s, "total_steps": total, "loss": 5.0 - s / 100, "llm_loss": 2.0,
                                 "lr": 1e-4, "tokens_per_s": 1000.0, "elapsed_s": s * 1.0, "time": t + s}))
    if error:
        lines.append(json.dumps({"event": "error", "step": steps, "time": t + steps, "message": error}))
    elif end:
        lines.append(json.dumps({"event": "end", "step": steps, "time": t + steps}))
    lines.extend(extra_lines)
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def write_checkpoint(out: Path, step: int, complete: bool = True, weights: bytes = b"x") -> Path:
    ck = out / f"checkpoint-{step}"
    (ck / "ds").mkdir(parents=True, exist_ok=True)
    (ck / "draft_model_weights.pth").write_bytes(weights)
    if complete:
        (ck / "checkpoint.json").write_text(json.dumps({"step": step, "time": time.time()}))
    return ck


def finish_stage(project: Project, stage: str, weights: bytes, *, steps: int = 40,
                 draft_sha256: str | None = "auto", overrides: list[str] | None = None,
                 math: bool = False) -> dict:
    """A contract-true finished run folder: metrics, a checkpoint, weights, stage_complete.json.

    draft_sha256="auto": the upstream stage's current final sha256 (what a chained run records).
    math: record the math keys as the trainer does (of the stage composed now; the slow trainer
    test checks that the trainer's own record equals this composition's).
    """
    out = project.out(stage)
    write_metrics(out, steps, steps)
    write_checkpoint(out, steps, weights=weights)
    project.weights(stage).write_bytes(weights)
    if draft_sha256 == "auto":
        up = UPSTREAM[stage]
        draft_sha256 = project.sha(up) if up else None
    if overrides is not None:
        (out / "run.json").write_text(json.dumps({"pid": 999_999_999, "pgid": 999_999_999,
                                                  "host": socket.gethostname(), "argv": [],
                                                  "started_at": "2024-01-01T00:00:00Z", "proc_start": 1,
                                                  "overrides": overrides}))
    complete = {
        "stage": stage, "steps": steps, "final_loss": 5.0 - steps / 100, "sha256": project.sha(stage),
        "target": str(project.target), "config_sha256": config_fingerprint(project.config(stage), overrides or []),
        "draft_sha256": draft_sha256, "finished_at": "2024-01-01T00:00:00Z", "weights": "draft_model_weights.pth",
    }
    if math:
        from longspec.project.hydracompose import compose_stage, stage_overrides
        from longspec.project.mathkeys import math_config

        composed = compose_stage(project.config(stage), stage_overrides(out, overrides or []))
        assert composed.ok, composed.problems
        complete["math"] = math_config(composed.data)
    (out / "stage_complete.json").write_text(json.dumps(complete, indent=2))
    return complete


def finish_chain(project: Project, drafts: dict[str, bytes], upto: str = "longcot") -> None:
    """Finish stages in order up to `upto`, pointing each config at its upstream's draft first."""
    for i, stage in enumerate(STAGES):
        up = UPSTREAM[stage]
        if up:
            project.set_draft_key(stage, str(project.weights(up)))
        finish_stage(project, stage, drafts[str(i)])
        if stage == upto:
            return


def no_traceback(result) -> None:
    text = (result.output or "") + (getattr(result, "stderr", "") or "")
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def panel_text(output: str) -> str:
    """The words of an error panel, with its border and line wrapping removed."""
    for ch in "│╭╮╰╯─":
        output = output.replace(ch, " ")
    return " ".join(output.split())


# Files that are not usable YAML: (bytes, words the error must contain). Exit 3 everywhere.
BAD_YAML = {
    "malformed": (b"stages: [unclosed\n", "YAML syntax error"),
    "tabs": (b"stages:\n\t- {name: a}\n", "tab used for indentation"),
    "list root": (b"- a\n- b\n", "the top level is a list"),
    "empty": (b"", "empty file"),
    "binary": (b"\x00\x01\x02PK", "binary file"),
    "non-utf8": (b"name: caf\xe9\nstages: []\n", "not UTF-8 text"),
    "duplicate keys": (b"name: a\nname: b\nstages: []\n", "duplicate key"),
    "alias bomb": (b"a: &a [x, x, x, x, x, x, x, x, x, x]\n" + b"".join(
        b"%s: &%s [*%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s]\n" % ((bytes([c]),) * 2 + (bytes([c - 1]),) * 10)
        for c in range(ord("b"), ord("j"))), "aliases expand to over"),
    "self-referencing alias": (b"a: &a [1, *a]\n", "self-referencing alias"),
}
