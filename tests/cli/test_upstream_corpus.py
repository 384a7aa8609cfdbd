"""`longspec validate` on the upstream LongSpec configs (read-only corpus; copies go to tmp_path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests import needs
from longspec_cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "upstream-longspec"
EXP = CORPUS / "conf" / "exp"

# shared/ lies beside the checkout in CI: there a missing corpus fails the tests instead
pytestmark = pytest.mark.skipif(not EXP.is_dir() and not needs.REQUIRE, reason="upstream corpus not present")

BASE = "qwq_glide_8gpu_slim6b.yaml"
LONG = "qwq_glide_8gpu_slim6b_longv2-32k-zero3_5e-6-ligce-nomask.yaml"
COT = "qwq_glide_8gpu_slim6b_sinkpi-slicing_longv2-32k-zero3_5e-6-ligce-nomask_longcot_5e-6.yaml"
SINK_BASE = "qwq_glide_8gpu_slim6b_sinkpi-slicing.yaml"
SINK_LONG = "qwq_glide_8gpu_slim6b_sinkpi-slicing_longv2-32k-zero3_5e-6-ligce-nomask.yaml"
FORK = "qwq_glide_8gpu_slim6b_sinkpi-slicing_longcot_5e-6.yaml"
STAGE_FILES = [BASE, LONG, COT, SINK_BASE, SINK_LONG, FORK]
CHAINED = [LONG, COT, SINK_LONG, FORK]  # stage 2/3 files: hand-typed `model_name: .../checkpoint-last`
ALL_FILES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.yaml"))


def validate(path: Path, *args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["validate", "--json", str(path), *args])
    assert "Traceback" not in res.output
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def line_of(path: Path, start: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(start))


def hits(rep: dict, needle: str, severity: str = "error") -> list[dict]:
    return [p for p in rep["problems"] + rep["info"] if needle in p["message"] and p["severity"] == severity]


def test_corpus_has_the_files_we_expect():
    assert sorted(p.name for p in EXP.glob("*.yaml")) == sorted(STAGE_FILES)


@pytest.mark.parametrize("rel", ALL_FILES)
def test_every_corpus_file_validates_without_a_traceback(rel):
    for args in ([], ["--strict"]):
        res = runner.invoke(app, ["validate", str(CORPUS / rel), *args])
        assert res.exit_code in (0, 1) and "Traceback" not in res.output, res.output
        assert "checked:" in res.output
    code, rep = validate(CORPUS / rel)
    assert rep["ok"] == (code == 0)


@pytest.mark.parametrize("name", STAGE_FILES)
def test_placeholders_are_errors_with_lines(name):
    code, rep = validate(EXP / name)
    assert code == 1
    ph = hits(rep, "[Your Directory]")
    got = {(p["key"], p["line"]) for p in ph if "placeholder" in p["message"]}
    want = {(k, line_of(EXP / name, k + ":")) for k in ("model_path_prefix", "output_path_prefix", "train_file")}
    assert got == want
    assert all(p["hint"] == "replace the placeholder with your path" for p in ph if "placeholder" in p["message"])


@pytest.mark.parametrize("name", STAGE_FILES)
def test_the_rest_of_the_file_is_still_checked(name):
    _, rep = validate(EXP / name)
    # precision: fp16 + fp16_bfloat16 + ds_cfg fp16 vs the default's bf16 vs torch_dtype bfloat16
    (prec,) = hits(rep, "precision is set in several places")
    for place in ("torch_dtype.dtype: bfloat16", "fp16: True", "fp16_bfloat16: True", "ds_cfg.fp16.enabled: True",
                  "overridden default: deepspeed/train_hybrid_engine_"):
        assert place in prec["message"], place
    assert prec["line"] == line_of(EXP / name, "  fp16:") + 1
    # betas twice: "(0.9, 0.98)" vs [ 0.9, 0.95 ]
    (betas,) = hits(rep, "the same hyper-parameter twice")
    assert "adam_betas = (0.9, 0.98)" in betas["message"] and "[0.9, 0.95]" in betas["message"]
    assert betas["key"] == "ds_cfg.optimizer.params.betas"
    # upstream's string betas: a warning in its own dialect
    assert hits(rep, "adam_betas is the text '(0.9, 0.98)'", "warning")
    # the trainer reads draft_model_name_or_path; no upstream file sets it
    assert hits(rep, "draft_model_name_or_path is read by the trainer", "warning")
    assert rep["files"][0]["dialect"] == "upstream"


@pytest.mark.parametrize("name", CHAINED)
def test_hand_typed_checkpoint_chain(name):
    _, rep = validate(EXP / name)
    (p,) = hits(rep, "points at a previous stage's checkpoint")
    assert "checkpoint-last" in p["message"] and p["key"] == "model_name_or_path"
    assert p["line"] == line_of(EXP / name, "model_name:")  # where the chain was typed
    assert "draft_model_name_or_path" in p["hint"] and "keep model_name_or_path = the target" in p["hint"]


@pytest.mark.parametrize("name", [BASE, SINK_BASE])
def test_base_stages_are_not_chained(name):
    _, rep = validate(EXP / name)
    assert not hits(rep, "checkpoint") and not hits(rep, "lineage fork")
    # ZeRO-1 files carry stage3_* keys: ignored by DeepSpeed, worth a warning
    assert hits(rep, "only apply to ZeRO stage 3 (stage is 1)", "warning")


def test_lineage_fork_of_the_sinkpi_longcot_file():
    _, rep = validate(EXP / FORK)
    (p,) = hits(rep, "lineage fork")
    assert FORK in p["message"] and BASE in p["message"]
    assert "stage 3" in p["message"] and "stage 1" in p["message"] and "skipping stage 2" in p["message"]


@pytest.mark.parametrize("name", [LONG, COT, SINK_LONG])
def test_proper_chains_are_not_forks(name):
    _, rep = validate(EXP / name)
    assert not hits(rep, "lineage fork")


def test_global_batch_and_world_size():
    _, rep = validate(EXP / BASE)
    assert rep["files"][0]["global_batch"] == 2 * 128 * 8
    _, rep = validate(EXP / BASE, "--world-size", "4")
    assert rep["files"][0]["global_batch"] == 2 * 128 * 4
    assert hits(rep, "global batch = 2 per GPU x 128 accumulation x 4 GPUs (--world-size) = 1024", "info")


def test_folder_of_upstream_files():
    code, rep = validate(EXP)
    assert code == 1 and len(rep["files"]) == len(STAGE_FILES)


# ---------------------------------------------------------------- modified copies

@pytest.fixture
def copy(tmp_path: Path) -> Path:
    dst = tmp_path / "train" / "conf"
    shutil.copytree(CORPUS / "conf", dst)
    return dst


def test_fixing_the_placeholders_removes_only_those_problems(copy, tmp_path):
    f = copy / "exp" / BASE
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    f.write_text(f.read_text().replace("[Your Directory]", str(tmp_path)).replace(
        f"{tmp_path}/data/raw_data/SlimPajama-6B/train_data.jsonl", f"{tmp_path}/data/train.jsonl"))
    _, rep = validate(f)
    assert not hits(rep, "holds the placeholder")
    assert hits(rep, "precision is set in several places") and hits(rep, "the same hyper-parameter twice")
    # now the paths are checked on disk: the data file exists, the target folder does not
    assert not [p for p in rep["problems"] if p["key"] == "train_file"]
    assert hits(rep, f"model_name_or_path {tmp_path}/models/QwQ-32B-Preview does not exist")


def test_fixed_precision_and_betas_pass_those_checks(copy):
    f = copy / "exp" / BASE
    text = f.read_text().replace("fp16: True\n", "fp16: False\n").replace(
        "  bf16:\n    enabled: False\n  fp16:\n    enabled: True", "  bf16:\n    enabled: True\n  fp16:\n    enabled: False")
    text = text.replace('adam_betas: "(0.9, 0.98)"', "adam_betas: [0.9, 0.95]")
    f.write_text(text)
    _, rep = validate(f)
    assert not hits(rep, "precision is set") and not hits(rep, "hyper-parameter twice")
    assert not hits(rep, "adam_betas is the text", "warning")


def test_upstream_quoted_learning_rate_and_typo(copy):
    f = copy / "exp" / BASE
    f.write_text(f.read_text().replace("learning_rate: 5e-4\n", 'learnig_rate: "5e-4"\n'))
    _, rep = validate(f)
    (p,) = [p for p in rep["problems"] if p["key"] == "learnig_rate"]
    assert p["severity"] == "error" and p["hint"] == "did you mean `learning_rate`?"
    f.write_text(f.read_text().replace('learnig_rate: "5e-4"\n', 'learning_rate: "5e-4"\n'))
    _, rep = validate(f)
    (p,) = [p for p in rep["problems"] if p["key"] == "learning_rate"]
    assert "remove the quotes" in p["hint"]


def test_upstream_seq_len_beyond_qwq_preview(copy):
    f = copy / "exp" / BASE
    f.write_text(f.read_text().replace("max_seq_length: 1024", "max_seq_length: 65536"))
    _, rep = validate(f)
    (p,) = hits(rep, "exceeds the target's position limit 32768 (QwQ-32B-Preview)")
    assert p["key"] == "collator.max_seq_length"
    assert hits(rep, "a 65536-token stage with ZeRO stage 1", "warning")


def test_missing_deepspeed_default_names_the_files_searched(copy):
    (copy / "deepspeed" / "train_hybrid_engine_zero3_optim_offload_cosine.yaml").unlink()
    _, rep = validate(copy / "exp" / LONG)
    (p,) = [p for p in rep["problems"] if p["key"] == "defaults"]
    assert "train_hybrid_engine_zero3_optim_offload_cosine.yaml" in p["message"]
    assert str(copy / "deepspeed") in p["message"] and p["line"] == 3
