"""One typed view of a composed stage (longspec.project.stageview), the stamped-JSON reader the run
folders' formats share (files.atomic.read_stamped_json), and the one answer to "the draft of this
stage" (runs.stagedraft) that eval, export and serve take."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from longspec.errors import RefusedError
from longspec.files.atomic import read_stamped_json
from longspec.files.yamlio import YamlError
from longspec.project.manifest import load_manifest
from longspec.project.stageview import StageView, default
from longspec.runs.stagedraft import stage_draft, stage_drafts

from .conftest import finish_stage

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "longspec" / "conf" / "config.yaml"


def test_defaults_are_the_trainers_config_yaml():
    conf = YAML(typ="safe").load(CONFIG.read_text(encoding="utf-8"))
    view = StageView.of({})
    assert view.max_seq_length == conf["data"]["max_seq_length"] == default("data.max_seq_length")
    assert (view.precision, view.collator, view.sliding_window) == (
        conf["precision"], conf["data"]["collator"], conf["draft"]["sliding_window"])
    assert view.target is None                    # `???` in config.yaml: no target


def test_a_value_that_fits_the_schema_is_taken_another_reads_as_the_default():
    view = StageView.of({"model_name_or_path": "/t", "precision": "fp32", "data": {"max_seq_length": 4096},
                         "per_gpu_train_batch_size": 3, "kernels": "reference"})
    assert (view.target, view.precision, view.max_seq_length, view.per_gpu_train_batch_size, view.kernels) == (
        "/t", "fp32", 4096, 3, "reference")
    bad = StageView.of({"precision": "fp8", "data": {"max_seq_length": "4096"}, "per_gpu_train_batch_size": True,
                        "draft": {"sliding_window": 0}, "data_extra": 1})
    base = StageView.of({})
    assert (bad.precision, bad.max_seq_length, bad.per_gpu_train_batch_size, bad.sliding_window) == (
        base.precision, base.max_seq_length, base.per_gpu_train_batch_size, base.sliding_window)
    assert StageView.of(None) == base


def test_of_run_reads_the_runs_training_config(tmp_path):
    (tmp_path / "training_config.yaml").write_text("model_name_or_path: /m\ndata:\n  max_seq_length: 2048\n")
    view = StageView.of_run(tmp_path)
    assert (view.target, view.max_seq_length) == ("/m", 2048)
    with pytest.raises(YamlError, match="file not found"):
        StageView.of_run(tmp_path / "none")


def test_max_seq_length_default_is_written_once():
    """Only config.yaml writes max_seq_length's default; the code reads it through the view."""
    pattern = re.compile(r"max_seq_length[\"']\)?\s*(?:,|:|or)\s*1024\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("longspec", "longspec_cli") for p in (ROOT / pkg).rglob("*.py")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []
    for old in ('int(_get(conf, "data.max_seq_length", 1024))', '.get("max_seq_length") or 1024)',
                'DATA_DEFAULTS = {"max_seq_length": 1024}'):                       # the pattern sees the old ways
        assert pattern.search(old), old


def test_read_stamped_json(tmp_path):
    path = tmp_path / "m.json"
    assert read_stamped_json(path, 1) is None                                      # missing
    path.write_text(json.dumps({"format": 1, "rows": 3}))
    assert read_stamped_json(path, 1) == {"format": 1, "rows": 3}
    assert read_stamped_json(path, 2) is None                                      # another layout
    path.write_text("[1, 2]")
    assert read_stamped_json(path, 1) is None
    path.write_text("{not json")
    assert read_stamped_json(path, 1) is None


def test_the_draft_of_a_stage(project, drafts):
    manifest = load_manifest(project.root)
    with pytest.raises(RefusedError, match="no stage has a finished draft yet"):
        stage_draft(manifest)
    finish_stage(project, "base", drafts["0"])
    st = stage_draft(manifest)
    assert st.name == "base" and Path(st.draft_weights) == project.weights("base")
    with pytest.raises(RefusedError, match=r"stage long has no finished draft \(state: pending\)") as e:
        stage_draft(manifest, "long", shown="demo")
    assert e.value.hint == "train it first: longspec run demo long"
    todo, skipped = stage_drafts(manifest, [])
    assert [s.name for s in todo] == ["base"] and [s["stage"] for s in skipped] == ["long", "longcot"]
    with pytest.raises(RefusedError, match="stage long has no finished draft"):
        stage_drafts(manifest, ["base", "long"])
