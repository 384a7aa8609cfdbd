"""Target families beyond the reference's Qwen2 / Llama, end to end, and the one refusal sentence.

Per new family (qwen3, mistral), one build shared by the session: a tiny random target made from
the family's transformers config (the tiny preset's tokenizer and data beside it; nothing is
downloaded), then the user's path through the CLI: `init --target` reads it, `run` trains the
base stage for 2 steps with DeepSpeed on CPU, `next-stage` chains the draft into the long stage
(deep check: the draft loads against the target), `eval` decodes losslessly against the target's
own greedy output and `export --format hf` round-trips.

The unit-level checks of every family (forward, backward, the target's K/V, losslessness of
speculative decoding, export layout) run through the `family` fixture of conftest.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project.targets import SUPPORTED_FAMILIES, refusal
from tests.cli.conftest import panel_text
from tests.trainer.conftest import FAMILIES, tiny_config

REPO = Path(__file__).resolve().parents[2]
NEW_FAMILIES = ("qwen3", "mistral")
POSITIONS = 2048          # the tiny targets' limit: the long stage's 32768 tokens get capped
runner = CliRunner()


def env() -> dict:
    e = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])
    return e


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, as a user runs it (run/eval/export start their own processes)."""
    return subprocess.run([sys.executable, "-m", "longspec_cli", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def show(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def json_tail(text: str) -> dict:
    return json.loads(text[text.index("{"):])


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict:
    """The tiny preset's tokenizer and stage data (cached build)."""
    from longspec.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-assets"), family="qwen2")


def save_random_target(family: str, tiny: dict, dest: Path) -> Path:
    """A random-init tiny ``family`` target with the tiny tokenizer, saved as a HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["target"])
    cfg = tiny_config(family, vocab_size=len(tok), max_position_embeddings=POSITIONS,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(dest)
    for f in Path(tiny["target"]).iterdir():                 # tokenizer files and chat template only
        if f.name not in ("config.json", "generation_config.json", "model.safetensors", "tiny.json"):
            shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="session", params=NEW_FAMILIES)
def family_project(request, tiny_assets, tmp_path_factory) -> dict:
    """One build per family: its target, `init --target` of a two-stage project, and the base
    stage trained for 2 steps by `longspec run` (DeepSpeed, one CPU rank)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"fam-{family}")
    target = save_random_target(family, tiny_assets, root / "target")
    proj = root / "proj"
    data = tiny_assets["data"]
    base = root / "base.jsonl"                 # 2 steps x 2 records trained, the rest held out for eval
    base.write_text("".join(Path(data["base"]).read_text().splitlines(keepends=True)[:12]))
    res = runner.invoke(app, ["init", str(proj), "--target", str(target), "--stages", "base,long", "--gpus", "1",
                              "--data", f"base={base}", "--data", f"long={data['long']}",
                              "--no-input", "--json"])
    assert res.exit_code == 0, res.output
    init = json_tail(res.output)
    run = cli("run", str(proj), "base", "--quiet", "max_steps=2", "save_steps=2", "per_gpu_train_batch_size=2",
              "gradient_accumulation_steps=1", "global_batch_size=2", "data.max_seq_length=64",
              "ds_cfg.zero_optimization.offload_optimizer.pin_memory=false")
    return {"family": family, "root": proj, "target": target, "init": init, "run": run}


@pytest.mark.slow
def test_new_family_from_init_to_export(family_project, tmp_path):
    p = family_project
    family, proj = p["family"], p["root"]
    from longspec.files import yamlio

    # init read the target: family, position cap with its note, precision, chat template
    notes = "\n".join(p["init"]["notes"])
    assert f"{family} family, {POSITIONS} positions" in notes and "precision fp32" in notes
    assert f"long: max_seq_length capped at the target's {POSITIONS} positions (stage default 32768)" in notes
    assert "chat template (chat_template.jinja)" in notes
    long_text = (proj / "conf/exp/long.yaml").read_text()
    long = yamlio.to_plain(yamlio.load_mapping(proj / "conf/exp/long.yaml").data)
    assert long["data"]["max_seq_length"] == POSITIONS and long["precision"] == "fp32"
    assert f"# capped at the target's {POSITIONS} positions" in long_text
    assert long["positions"]["max_offset"] == POSITIONS - 1200          # offsets stay inside the limit
    assert "# Chats render with the target's chat template" in long_text

    # run: DeepSpeed trained 2 steps and finished the stage
    assert p["run"].returncode == 0, show(p["run"])
    done = json.loads((proj / "runs/base/stage_complete.json").read_text())
    assert done["steps"] == 2 and done["final_loss"] > 0

    # next-stage: the long stage now starts from base's draft (deep check against the target)
    chain = cli("next-stage", str(proj), "--deep", "--json", timeout=300)
    assert chain.returncode == 0, show(chain)
    doc = json_tail(chain.stdout)
    assert doc["changed"] and doc["draft_sha256"] == done["sha256"]
    long = yamlio.to_plain(yamlio.load_mapping(proj / "conf/exp/long.yaml").data)
    assert Path(long["draft_model_name_or_path"]).resolve() == (proj / "runs/base" / done["weights"]).resolve()

    # eval: speculative decoding equals the target's own greedy decoding, token for token
    ev = cli("eval", str(proj), "base", "--num-prompts", "2", "--max-new-tokens", "12", "--json", timeout=600)
    assert ev.returncode == 0, show(ev)
    r = json_tail(ev.stdout)["results"][0]
    assert r["lossless"] is True and 1.0 <= r["tau"] <= 5.0
    assert r["prompts"] == sum(b["prompts"] for b in r["by_length"]) and all(b["prompts"] <= 2 for b in r["by_length"])

    # export --format hf: the family's architecture, tensors identical after the round trip
    out = tmp_path / "hf"
    ex = cli("export", str(proj), "--stage", "base", "--format", "hf", "--out", str(out), "--json", timeout=300)
    assert ex.returncode == 0, show(ex)
    assert json_tail(ex.stdout)["verified"] is True
    import torch

    from longspec.model.weights import load_draft_state

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [f"{'Qwen3' if family == 'qwen3' else 'Mistral'}GlideDecoderLayer"]
    assert cfg["model_type"] == family and cfg["attention_bias"] is False
    src, back = load_draft_state(proj / "runs/base" / done["weights"]), load_draft_state(out)
    assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src)
    assert any(k.endswith("q_norm.weight") for k in back) is (family == "qwen3")


# ----------------------------------------------------------------------------- refusal

def test_registry_and_the_pure_list_agree():
    from longspec.model.families import FAMILIES as REGISTRY

    assert tuple(REGISTRY) == SUPPORTED_FAMILIES == FAMILIES


def test_unsupported_family_gets_one_sentence_from_init_validate_and_trainer(tmp_path, tiny_assets):
    """A real causal LM of another family (GPT-2): the same sentence from all three."""
    from transformers import GPT2Config

    target = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(target)
    sentence = refusal("gpt2", None)
    assert sentence.count(". ") == 0 and sentence.endswith(".")          # one sentence
    assert all(f in sentence for f in SUPPORTED_FAMILIES)

    res = runner.invoke(app, ["init", str(tmp_path / "p"), "--target", str(target), "--no-input"])
    assert res.exit_code == 1 and not (tmp_path / "p").exists()
    assert panel_text(res.output) == f"error {sentence}", res.output

    ok = tmp_path / "ok"
    shutil.copytree(tiny_assets["target"], ok)
    res = runner.invoke(app, ["init", str(tmp_path / "proj"), "--target", str(ok), "--stages", "base",
                              "--data", f"base={tiny_assets['data']['base']}", "--gpus", "1", "--no-input"])
    assert res.exit_code == 0, res.output
    for f in (tmp_path / "proj/conf/exp/base.yaml", tmp_path / "proj/longspec.yaml"):
        f.write_text(f.read_text().replace(str(ok), str(target)))
    res = runner.invoke(app, ["validate", str(tmp_path / "proj"), "--json"])
    assert res.exit_code == 1
    problems = json_tail(res.output)["problems"]
    assert [p["message"] for p in problems if p["key"] == "model_name_or_path"] == [f"model_name_or_path {target}: {sentence}"]

    proc = subprocess.run([sys.executable, "-m", "longspec.train", "--config-dir", str(tmp_path / "proj/conf"),
                           "+exp=base"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and sentence in " ".join((proc.stdout + proc.stderr).split()), show(proc)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "proj/runs/base/stage_complete.json").exists()
