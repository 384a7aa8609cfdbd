"""Bad-input sweep regressions: inputs that once ended in a traceback now give a panel and a documented code."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app

from .conftest import finish_stage, no_traceback, panel_text

runner = CliRunner()

DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # nested past Python's recursion limit


@pytest.mark.parametrize("verb", [["status"], ["next-stage", "--dry-run"], ["monitor", "--once"], ["stop"]])
def test_output_dir_that_is_a_file_exits_3_naming_the_line(project, verb):
    manifest = project.root / "longspec.yaml"
    manifest.write_text(manifest.read_text().replace("output_dir: runs/base", "output_dir: longspec.yaml"))
    before = manifest.read_bytes()
    res = runner.invoke(app, [verb[0], str(project.root), *verb[1:]])
    no_traceback(res)
    assert res.exit_code == 3, res.output
    assert "is a file, not a folder" in panel_text(res.output)
    assert manifest.read_bytes() == before


@pytest.mark.parametrize("key,old", [("output_dir", "output_dir: runs/base"), ("config", "config: conf/exp/base.yaml"),
                                     ("target", "target: assets/target")])
def test_nul_character_in_a_manifest_path_exits_3(project, key, old):
    manifest = project.root / "longspec.yaml"
    manifest.write_text(manifest.read_text().replace(old, f'{key}: "x\\0y"'))
    res = runner.invoke(app, ["status", str(project.root)])
    no_traceback(res)
    assert res.exit_code == 3, res.output
    assert "NUL" in panel_text(res.output)


def test_deeply_nested_stage_complete_is_a_reason_not_a_crash(project, drafts):
    finish_stage(project, "base", drafts["0"])
    (project.out("base") / "stage_complete.json").write_bytes(DEEP_JSON)
    res = runner.invoke(app, ["status", str(project.root), "--json"])
    no_traceback(res)
    assert res.exit_code == 0, res.output
    base = {s["name"]: s for s in json.loads(res.output)["stages"]}["base"]
    assert base["state"] != "done"
    assert any("stage_complete.json" in r for r in base["reasons"])


@pytest.mark.parametrize("verb", [["status", "--json"], ["monitor", "--once", "--json"]])
def test_deeply_nested_metrics_line_is_skipped(project, drafts, verb):
    """A metrics line nested past the recursion limit is a malformed line: skipped and counted, the
    stage still done (it was finished before the line was appended)."""
    finish_stage(project, "base", drafts["0"])
    with open(project.out("base") / "metrics.jsonl", "ab") as f:
        f.write(DEEP_JSON + b"\n")
    res = runner.invoke(app, [verb[0], str(project.root), *verb[1:]])
    no_traceback(res)
    assert res.exit_code == 0, res.output
    base = {s["name"]: s for s in json.loads(res.output)["stages"]}["base"]
    assert base["state"] == "done", base
    if verb[0] == "monitor":
        assert base["skipped_lines"] == 1, base
