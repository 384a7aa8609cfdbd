"""`longspec eval` / `longspec export` and the quality gate (longspec.runs.quality).

The CLI never imports torch: refusals are checked in-process; the slow tests run the real
subprocesses on a tiny-preset project whose base stage is finished per the run-folder contract
(a draft for the real tiny target, training_config.yaml, stage_complete.json with the weights'
sha256 and the config fingerprint), so `status` calls it done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests import needs
from longspec_cli.app import app
from longspec.runs.quality import EvalFileError, eval_is_current, gate_check, gate_stage, read_eval
from longspec_cli.launch.trainer import evaluate_argv

from .conftest import HAS_TORCH, finish_stage, no_traceback, panel_text

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


# ----------------------------------------------------------------------------- the gate rule

@pytest.mark.parametrize("prev, cur, pct, ok", [
    (3.0, 3.0, 5, True),          # unchanged
    (3.0, 3.4, 5, True),          # better
    (3.0, 2.9, 5, True),          # -3.3%: within 5%
    (3.0, 2.85, 5, True),         # exactly at the floor
    (3.0, 2.84, 5, False),        # just below the floor
    (3.0, 2.2, 30, True),         # 30%: floor 2.1
    (3.0, 2.09, 30, False),
    (2.5, 2.4999, 0, False),      # pct 0: any drop fails
    (2.5, 0.0, 100, True),        # pct 100: never fails
    (None, 1.1, 5, True),         # first stage: nothing to compare with
    (0.0, 0.0, 5, True),
])
def test_gate_rule(prev, cur, pct, ok):
    got, message = gate_check(prev, cur, pct)
    assert got is ok
    assert f"{cur:.3f}" in message
    if prev is not None and not ok:
        assert "below the previous stage" in message


@pytest.mark.parametrize("args", [(3.0, 2.0, -1), (3.0, 2.0, 101), (3.0, -1.0, 5), (-2.0, 1.0, 5),
                                  (3.0, float("nan"), 5), (3.0, 2.0, True)])
def test_gate_rejects_nonsense(args):
    with pytest.raises(ValueError):
        gate_check(*args)


def test_read_eval(tmp_path):
    assert read_eval(tmp_path) is None
    p = tmp_path / "eval.json"
    p.write_text("{not json")
    with pytest.raises(EvalFileError, match="not valid JSON"):
        read_eval(tmp_path)
    p.write_text(json.dumps({"stage": "base", "tau": 2.1, "gamma": 4}))
    with pytest.raises(EvalFileError, match="missing lossless"):
        read_eval(tmp_path)
    p.write_text(json.dumps({"stage": "base", "tau": "2.1", "gamma": 4, "lossless": True}))
    with pytest.raises(EvalFileError, match="tau"):
        read_eval(tmp_path)
    p.write_text(json.dumps({"stage": "base", "tau": 2.1, "gamma": 4, "lossless": True, "draft_sha256": "ab"}))
    ev = read_eval(tmp_path)
    assert ev["tau"] == 2.1 and eval_is_current(ev, "ab") and not eval_is_current(ev, "cd")
    assert not eval_is_current(ev, None)


def _eval_json(folder: Path, tau: float, lossless: bool = True, sha: str = "s") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eval.json").write_text(json.dumps({"stage": folder.name, "tau": tau, "gamma": 4,
                                                  "lossless": lossless, "draft_sha256": sha}))
    return folder


def test_gate_stage_reads_both_eval_files(tmp_path):
    base, long = _eval_json(tmp_path / "base", 2.4), tmp_path / "long"
    assert gate_stage(long, base, 10) == (False, f"no eval.json in {long}: evaluate the stage first")
    _eval_json(long, 2.3)
    assert gate_stage(long, base, 10)[0] is True
    assert gate_stage(long, base, 1)[0] is False                         # -4.2% > 1%
    assert gate_stage(long, None, 1)[0] is True                          # first stage
    assert gate_stage(long, base, 1, prev_sha256="other")[0] is True     # base measured on another draft: ignored
    ok, msg = gate_stage(long, base, 10, cur_sha256="other")
    assert not ok and "another draft" in msg
    _eval_json(long, 2.4, lossless=False)
    ok, msg = gate_stage(long, base, 10)
    assert not ok and "not lossless" in msg
    (long / "eval.json").write_text("[]")
    assert gate_stage(long, base, 10)[0] is False
    # a baseline measured on the stage's own prompts wins over the upstream's own eval.json
    (long / "eval.json").write_text(json.dumps({"stage": "long", "tau": 1.3, "gamma": 4, "lossless": True,
                                                "baseline": {"tau": 1.25, "draft_sha256": "s"}}))
    ok, msg = gate_stage(long, base, 10)                                 # vs 2.4 it would fail (-46%)
    assert ok and "same prompts" in msg and "1.250" in msg
    ok, msg = gate_stage(long, base, 10, prev_sha256="x")               # no tau of draft x anywhere
    assert ok and "no previous stage" in msg


def test_evaluate_argv_is_the_evaluate_module(tmp_path):
    argv = evaluate_argv(tmp_path / "runs" / "base", "base", gamma=3, prompts="p.jsonl")
    assert argv[0] == sys.executable and argv[1:4] == ["-m", "longspec.evaluate", str(tmp_path / "runs" / "base")]
    assert argv[argv.index("--gamma") + 1] == "3" and argv[-2:] == ["--prompts", "p.jsonl"] and "--json" in argv


# ----------------------------------------------------------------------------- refusals (no torch here)

def test_eval_refuses_a_stage_without_finished_draft(project):
    res = runner.invoke(app, ["eval", str(project.root), "long"])
    assert res.exit_code == 1
    no_traceback(res)
    assert "stage long has no finished draft (state: pending)" in panel_text(res.output)


def test_eval_with_nothing_finished_says_so(project):
    res = runner.invoke(app, ["eval", str(project.root)])
    assert res.exit_code == 1
    assert "no stage has a finished draft yet" in panel_text(res.output)


def test_eval_usage_errors(project, tmp_path):
    res = runner.invoke(app, ["eval", str(project.root), "bsae"])
    assert res.exit_code == 2 and "did you mean" in panel_text(res.output).lower()
    res = runner.invoke(app, ["eval", str(project.root), "--prompts", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2 and "no such file" in panel_text(res.output)
    res = runner.invoke(app, ["eval", str(tmp_path / "missing")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["eval", str(project.root), "--gamma", "0"])
    assert res.exit_code == 2
    for bad in (["--method", "beam"], ["--tree-shape", "0"], ["--tree-shape", "4,x"], ["--temperature", "-1"],
                ["--bench", "mmlu:x"], ["--bench", "aime:"], ["--bench", "aime:a", "--prompts", str(tmp_path)]):
        res = runner.invoke(app, ["eval", str(project.root), *bad])
        assert res.exit_code == 2, (bad, res.output)
        no_traceback(res)


def test_tree_shape_values_are_not_stage_names(project):
    """`--tree-shape 4 16 16`: the values after the first arrive as positional arguments."""
    from longspec_cli.launch.evalrun import parse_shape

    assert parse_shape(["4", "16", "16"]) == parse_shape(["4 16,16"]) == (4, 16, 16)
    res = runner.invoke(app, ["eval", str(project.root), "base", "--tree-shape", "4", "16", "16"])
    assert res.exit_code == 1 and "stage base has no finished draft" in panel_text(res.output)


def test_evaluate_argv_passes_methods_shape_and_temperature(tmp_path):
    argv = evaluate_argv(tmp_path, "base", methods=("chain", "tree"), tree_shape=(2, 4), temperature=0.5)
    joined = " ".join(argv)
    assert "--method chain --method tree" in joined and "--tree-shape 2 4" in joined and "--temperature 0.5" in joined
    assert "--max-new-tokens" not in joined and "--lengths" not in joined      # the evaluator's defaults
    argv = evaluate_argv(tmp_path, "long", lengths="1k,4k", bench="longbench:/d", prompt_tokens=(0, 9000))
    joined = " ".join(argv)
    assert "--lengths 1k,4k --bench longbench:/d --min-prompt-tokens 0 --max-prompt-tokens 9000" in joined


def test_the_gate_compares_the_longest_bucket_with_prompts(tmp_path):
    from longspec.runs.quality import length_rows

    def bucket(n, prompts, tau, base):
        return {"length": n, "prompts": prompts, "chain": {"tau": tau}, "baseline": {"tau": base}}

    long = tmp_path / "long"
    long.mkdir()
    ev = {"stage": "long", "tau": 2.0, "gamma": 4, "lossless": True, "method": "chain",
          "baseline": {"tau": 1.5, "draft_sha256": "s"},
          "by_length": [bucket(256, 8, 1.6, 2.0), bucket(512, 4, 2.5, 1.4), bucket(1024, 0, 0.0, 0.0)]}
    (long / "eval.json").write_text(json.dumps(ev))
    ok, msg = gate_stage(long, None, 10)
    assert ok and "512-token bucket: 4 prompts" in msg and "tau 2.500 vs previous 1.400" in msg
    assert [r["label"] for r in length_rows(ev)] == ["256", "512"]                 # empty buckets left out
    ev["by_length"][1] = bucket(512, 4, 1.2, 1.4)                                # worse where it was trained
    (long / "eval.json").write_text(json.dumps(ev))
    ok, msg = gate_stage(long, None, 10)
    assert not ok and "512-token bucket" in msg


def test_export_refusals(project, drafts):
    res = runner.invoke(app, ["export", str(project.root), "--stage", "base", "--format", "hf"])
    assert res.exit_code == 1 and "no finished draft" in panel_text(res.output)
    res = runner.invoke(app, ["export", str(project.root), "--format", "onnx"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["export", str(project.root), "--format", "safetensors", "--out", "x.bin"])
    assert res.exit_code == 2 and ".safetensors" in panel_text(res.output)
    finish_stage(project, "base", drafts["0"])            # done per status; the export itself needs torch
    res = runner.invoke(app, ["export", str(project.root), "--stage", "long", "--format", "hf"])
    assert res.exit_code == 1 and "stage long has no finished draft" in panel_text(res.output)


def test_cli_modules_never_import_torch():
    code = ("import sys, longspec_cli.app, longspec_cli.commands.eval, longspec_cli.commands.export, longspec_cli.commands.regenerate, "
            "longspec.runs.quality; bad = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- a finished tiny stage (slow)

_FINISH = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoConfig
from longspec.model.weights import save_draft
from longspec.model.glide import DraftConfig, GlideDraft
from longspec.files.atomic import sha256_file
from longspec.runs.runfolder import config_fingerprint
stage, collator, seed, target, out, exp, train_file, upstream_sha = sys.argv[1:9]
target, out, exp = Path(target), Path(out), Path(exp)
torch.manual_seed(int(seed))
draft = GlideDraft(DraftConfig.from_target_config(AutoConfig.from_pretrained(target), sliding_window=32))
pth = save_draft(draft.state_dict(), out)
(out / "training_config.yaml").write_text(
    f"stage: {stage}\nmodel_name_or_path: {target}\ntrain_file: {train_file}\noutput_dir: {out}\nprecision: fp32\n"
    f"data:\n  collator: {collator}\n  max_seq_length: 48\ndraft:\n  sliding_window: 32\n")
(out / "stage_complete.json").write_text(json.dumps({
    "stage": stage, "steps": 1, "final_loss": 5.0, "sha256": sha256_file(pth), "target": str(target),
    "config_sha256": config_fingerprint(exp, []), "draft_sha256": upstream_sha or None,
    "finished_at": "2024-01-01T00:00:00Z", "weights": pth.name}))
print(sha256_file(pth))
"""


@pytest.fixture(scope="module")
def tiny_project(tmp_path_factory):
    """A tiny-preset project whose base and long stages are finished (random drafts), longcot pending."""
    if not HAS_TORCH:
        needs.unavailable("torch + transformers are not installed")
    root = tmp_path_factory.mktemp("tiny") / "proj"
    res = runner.invoke(app, ["init", str(root), "--preset", "tiny", "--no-input"])
    assert res.exit_code == 0, res.output
    from longspec.files import yamlio
    from longspec.project.manifest import load_manifest

    m = load_manifest(root)
    sha = ""
    for name, collator, seed in (("base", "short_text", "0"), ("long", "long_data", "1")):
        spec = m.stage(name)
        conf = yamlio.to_plain(yamlio.load_mapping(spec.config).data)
        proc = subprocess.run([sys.executable, "-c", _FINISH, name, collator, seed, conf["model_name_or_path"],
                               str(spec.output_dir), str(spec.config), conf["train_file"], sha],
                              check=True, cwd=ROOT, timeout=600, capture_output=True, text=True)
        sha = proc.stdout.strip().splitlines()[-1]
    return root, m.stage("base").output_dir


@pytest.mark.slow
def test_eval_on_a_finished_tiny_stage(tiny_project):
    root, out = tiny_project
    res = runner.invoke(app, ["eval", str(root), "--json"])     # the default measurement: eval.json
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    r, long = doc["results"]
    assert r["lengths"] == [24, 48] and [b["length"] for b in r["by_length"]] == [24, 48]   # max_seq_length 48
    assert all(b["prompts"] >= 1 and b["chain"]["tau"] >= 1 and b["tree"]["tau"] >= 1 for b in r["by_length"])
    assert all(p["bucket"] == p["prompt_tokens"] and p["stopped"] in ("eos", "limit") and p["record"].startswith(
        "base.jsonl:") for p in r["per_prompt"])                                    # documents cut at each length
    assert [b["length"] for b in long["by_length"]] == [24, 48] and all("baseline" in b for b in long["by_length"])
    assert doc["lossless"] is True and doc["skipped"] == [{"stage": "longcot", "state": "pending"}]
    assert "baseline" not in r                                  # base has no upstream stage
    assert long["stage"] == "long" and long["lossless"] is True and long["baseline"]["stage"] == "base"
    assert long["baseline"]["lossless"] is True and 1.0 <= long["baseline"]["tau"] <= 5.0
    assert long["baseline"]["draft_sha256"] == json.loads((out / "stage_complete.json").read_text())["sha256"]
    ok, message = gate_stage(out.parent / "long", out, 100)      # the gate reads what eval wrote
    assert ok and "same prompts" in message
    assert r["stage"] == "base" and r["lossless"] is True and r["prompts"] == len(r["per_prompt"]) and r["gamma"] == 4
    assert 1.0 <= r["tau"] <= 5.0 and r["spec_tokens_per_s"] > 0 and r["target_tokens_per_s"] > 0
    assert r["context_tokens_max"] <= 48 and r["max_new_tokens"] == 32 and r["eval_json"] == str(out / "eval.json")   # the default measurement
    ev = read_eval(out)                                         # what the gate reads
    stage_sha = json.loads((out / "stage_complete.json").read_text())["sha256"]
    assert eval_is_current(ev, stage_sha)
    for key in ("stage", "tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup", "gamma", "prompts",
                "max_new_tokens", "context_tokens", "lossless", "draft_sha256", "time", "method", "temperature"):
        assert key in ev, key
    # both methods by default, on the same prompts; the chain is the headline (what the gate reads)
    chain, tree = ev["methods"]["chain"], ev["methods"]["tree"]
    assert ev["method"] == "chain" and ev["tau"] == chain["tau"] and ev["temperature"] == 0
    assert tree["tree_shape"] == [4, 16, 16, 16, 16] and tree["lossless"] is True and 1.0 <= tree["tau"] <= 6.0
    assert tree["target_tokens_per_s"] == chain["target_tokens_per_s"] and tree["speedup"] > 0
    assert ev["backend"] == {"draft_attention": "sdpa", "tree_verify": "exact"}    # CPU fp32: no flash-attn

    table = runner.invoke(app, ["eval", str(root), "base", "--num-prompts", "1", "--max-new-tokens", "8",
                                "--gamma", "2", "--method", "tree", "--tree-shape", "2", "3", "2"])
    assert table.exit_code == 0, table.output
    assert "base" in table.output and "yes" in table.output and "2-3-2" in table.output
    assert "tau by context length" in table.output and "input draft" in table.output
    assert "long" not in table.output.split("input draft")[-1]  # only the stage asked for
    assert json.loads((out / "eval.json").read_text())["method"] == "chain"   # the default one is kept
    other = out / "eval-gamma2-tree2-3-2-max8-num1.json"          # other settings: their own file
    ev = json.loads(other.read_text())
    assert ev["method"] == "tree" and ev["tree_shape"] == [2, 3, 2] and list(ev["methods"]) == ["tree"]
    status = runner.invoke(app, ["status", str(root), "--json"])
    base_st = next(s for s in json.loads(status.output)["stages"] if s["name"] == "base")
    assert other.name in base_st["eval_results"] and [b["length"] for b in base_st["tau_by_length"]] == [24, 48]

    sampled = runner.invoke(app, ["eval", str(root), "base", "--num-prompts", "1", "--max-new-tokens", "6",
                                  "--method", "chain", "--temperature", "0.8", "--json"])
    assert sampled.exit_code == 0, sampled.output
    doc = json.loads(sampled.output[sampled.output.index("{"):])
    assert doc["lossless"] is None and doc["results"][0]["temperature"] == 0.8
    sampled_file = Path(doc["results"][0]["eval_json"])
    assert sampled_file.name.startswith("eval-t0.8") and json.loads((out / "eval.json").read_text())["temperature"] == 0
    alone = out.parent / "sampled"
    alone.mkdir()
    (alone / "eval.json").write_text(sampled_file.read_text())
    ok, message = gate_stage(alone, None, 5)                    # a sampled eval.json cannot pass the gate
    assert not ok and "sampling" in message


@pytest.mark.slow
def test_eval_with_a_prompts_file(tiny_project, tmp_path):
    root, out = tiny_project
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("count from 5 : 5 6 7") + "\n" + json.dumps({"prompt": "fact : the age of"}) + "\n")
    res = runner.invoke(app, ["eval", str(root), "base", "--prompts", str(prompts), "--max-new-tokens", "10",
                              "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output[res.output.index("{"):])["results"][0]
    assert r["prompts"] == 2 and r["prompt_source"] == str(prompts) and r["lossless"] is True
    assert Path(r["eval_json"]).name == "eval-prompts-p-max10.json" and [p["record"] for p in r["per_prompt"]] == \
        ["p.jsonl:1", "p.jsonl:2"]


@pytest.mark.slow
def test_eval_on_the_papers_benchmarks_from_local_files(tiny_project, tmp_path):
    from tests.hubfiles import write_aime_parquet, zip_longbench
    from tests.trainer.test_eval_prompts import write_longbench

    root, out = tiny_project
    long_eval = (out.parent / "long" / "eval.json").read_bytes() if (out.parent / "long" / "eval.json").exists() else None
    folder = write_longbench(tmp_path / "LongBench", tasks=("gov_report", "qmsum", "lcc"), n=2, words=30)
    zipped = zip_longbench(folder, tmp_path / "data.zip")                  # LongBench's data.zip as downloaded
    res = runner.invoke(app, ["eval", str(root), "long", "--bench", f"longbench:{zipped}", "--min-prompt-tokens", "0",
                              "--max-new-tokens", "8", "--lengths", "128,256,1k", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output[res.output.index("{"):])["results"][0]
    assert r["bench"] == "longbench" and r["lossless"] is True and set(r["methods"]) == {"chain", "tree"}
    assert [t["task"] for t in r["by_task"]] == ["gov_report", "qmsum", "lcc"]
    assert all(t["prompts"] == 2 and t["chain"]["tau"] >= 1 and t["tree"]["tau"] >= 1 and "baseline" in t
               for t in r["by_task"])
    assert sum(b["prompts"] for b in r["by_length"]) == 6 and Path(r["eval_json"]).name.startswith("eval-longbench")
    now = (out.parent / "long" / "eval.json")
    assert (now.read_bytes() if now.exists() else None) == long_eval                 # eval.json left alone

    problems = [f"add the numbers {i} , {i + 3} ." for i in range(3)]
    parquet = write_aime_parquet(tmp_path / "train-00000-of-00001.parquet", problems)   # the AIME set as downloaded
    res = runner.invoke(app, ["eval", str(root), "base", "--bench", f"aime:{parquet}", "--max-new-tokens", "6", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output[res.output.index("{"):])["results"][0]
    assert r["prompts"] == 3 and r["by_task"][0]["task"] == "aime" and r["methods"]["tree"]["lossless"] is True
    assert [p["record"] for p in r["per_prompt"]] == ["aime:60", "aime:61", "aime:62"]
    aime = tmp_path / "aime.jsonl"
    aime.write_text("".join(json.dumps({"problem": t}) + "\n" for t in problems))

    with aime.open("a") as f:
        f.write('{"answer": 7}\n')
    res = runner.invoke(app, ["eval", str(root), "base", "--bench", f"aime:{aime}"])
    assert res.exit_code == 3 and f"{aime}:4: needs a string 'problem' or 'question'" in panel_text(res.output)
    no_traceback(res)
    (folder / "qmsum.jsonl").write_text('{"context": "the fox .", "input": 3}\n')
    res = runner.invoke(app, ["eval", str(root), "long", "--bench", f"longbench:{folder}"])
    assert res.exit_code == 3 and f"{folder / 'qmsum.jsonl'}:1: field 'input' must be a string" in panel_text(res.output)
    res = runner.invoke(app, ["eval", str(root), "long", "--bench", f"longbench:{tmp_path / 'none'}"])
    assert res.exit_code == 2 and "THUDM/LongBench" in panel_text(res.output)


@pytest.mark.slow
def test_export_a_finished_tiny_stage(tiny_project, tmp_path):
    root, out = tiny_project
    res = runner.invoke(app, ["export", str(root), "--format", "hf", "--json"])      # the last finished stage
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    assert doc["stage"] == "long" and doc["verified"] and Path(doc["out"]) == out.parent / "long" / "export" / "long-hf"
    assert sorted(os.listdir(doc["out"])) == ["config.json", "model.safetensors"]
    again = runner.invoke(app, ["export", str(root), "--stage", "long", "--format", "hf"])
    assert again.exit_code == 1 and "already exists" in panel_text(again.output)
    no_traceback(again)
    dest = tmp_path / "base.safetensors"
    res = runner.invoke(app, ["export", str(root), "--stage", "base", "--format", "safetensors", "--out", str(dest)])
    assert res.exit_code == 0, res.output
    assert dest.is_file()
    assert "identical tensors" in res.output


@pytest.mark.slow
def test_one_measuring_process_serves_every_stage_as_its_own_process_would(tiny_project, tmp_path):
    """`longspec run`'s measuring process (`python -m longspec.evaluate --serve`): one process, one
    load of the target, and per stage the very result a process of its own gives; a refused request
    is answered with the module's error and the process goes on serving."""
    from longspec.errors import LongspecError
    from longspec_cli.launch.evalworker import EvalWorker
    from longspec_cli.launch.trainer import run_trainer_json

    root, base = tiny_project
    long, longcot = base.parent / "long", base.parent / "longcot"
    small = ["--num-prompts", "2", "--max-new-tokens", "8", "--method", "chain", "--method", "tree", "--no-write"]
    argv = {"base": evaluate_argv(base, "base") + small,
            "long": evaluate_argv(long, "long", baseline_draft=base / "draft_model_weights.pth",
                                 baseline_stage="base") + small}
    with EvalWorker() as worker:
        served = {"base": worker.measure(argv["base"], show_progress=False)}
        pid = worker.proc.pid
        with pytest.raises(LongspecError) as refused:                  # longcot is not trained
            worker.measure(evaluate_argv(longcot, "longcot") + small, show_progress=False)
        served["long"] = worker.measure(argv["long"], show_progress=False)
        assert worker.proc.pid == pid                                  # the same process throughout
    assert refused.value.exit_code == 2 and "no such run folder" in refused.value.message
    alone = run_trainer_json(argv["long"], show_progress=False)

    def untimed(x):                              # decode times differ between two runs; nothing else may
        if isinstance(x, dict):
            return {k: untimed(v) for k, v in x.items()
                    if "per_s" not in k and k not in ("speedup", "time", "timings")}
        return [untimed(v) for v in x] if isinstance(x, list) else x

    assert untimed(served["long"]) == untimed(alone)
    assert served["long"]["baseline"]["tau"] == alone["baseline"]["tau"] and alone["per_prompt"]
    # where the time went: the process's start is the first measurement's alone; the target loaded once
    assert "process_start" in served["base"]["timings"] and "process_start" not in served["long"]["timings"]
    assert {"model_load", "prompts", "decode_plain", "decode_chain", "decode_tree", "decode_baseline"} <= \
        set(served["long"]["timings"])
