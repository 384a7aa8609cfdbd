"""`longspec monitor --once [--json]`: a summary for CI logs, no terminal, documented exit codes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from longspec_cli.app import app as cli
from tests.tui import fixtures as F

runner = CliRunner()


def test_once_json_of_a_running_pipeline(running):
    r = runner.invoke(cli, ["monitor", str(running), "--once", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["project"] == "demo" and d["current"] == "long"
    states = {s["name"]: s["state"] for s in d["stages"]}
    assert states == {"base": "done", "long": "running", "longcot": "pending"}
    long = d["stages"][1]
    assert (long["step"], long["total_steps"]) == (120, 400) and long["loss"] == F.step_record(120, 400, 1)["loss"]
    assert d["alerts"] == [] and "long is running" in d["next"]


def test_once_text_and_exit_1_on_a_dead_run(running):
    info = json.loads((running / "runs/long/run.json").read_text())
    info.update(pid=F.DEAD_PID, proc_start=F.DEAD_START)
    (running / "runs/long/run.json").write_text(json.dumps(info))
    r = runner.invoke(cli, ["monitor", str(running), "--once"])
    assert r.exit_code == 1
    assert "long     failed" in r.output and f"ERROR: long: training process {F.DEAD_PID} is gone" in r.output


def test_once_nonfinite_loss_stays_strict_json(running):
    with open(running / "runs/long/metrics.jsonl", "a") as f:
        f.write('{"step": 121, "total_steps": 400, "loss": NaN, "llm_loss": Infinity, "lr": 1e-5}\n')
    r = runner.invoke(cli, ["monitor", str(running), "--once", "--json"])
    assert r.exit_code == 1
    d = json.loads(r.output)  # NaN became null: strict JSON for CI tools
    assert d["stages"][1]["loss"] is None and d["alerts"][0]["kind"] == "nonfinite_loss"


def test_once_without_runs(fresh):
    r = runner.invoke(cli, ["monitor", str(fresh), "--once"])
    assert r.exit_code == 0 and "no runs yet" in r.output and "would start base" in r.output


def test_usage_errors(tmp_path, running):
    assert runner.invoke(cli, ["monitor", str(tmp_path / "nope"), "--once"]).exit_code == 2
    assert runner.invoke(cli, ["monitor", str(running), "--json"]).exit_code == 2
    r = runner.invoke(cli, ["monitor", str(running)])  # no terminal here
    assert r.exit_code == 2 and "--once" in r.output


def test_malformed_manifest_is_exit_3(tmp_path):
    (tmp_path / "longspec.yaml").write_text("name: [unclosed\n")
    assert runner.invoke(cli, ["monitor", str(tmp_path), "--once"]).exit_code == 3


def test_stage_panel_shows_the_tree_tau_next_to_the_chain_tau():
    from longspec_cli.tui.views import StageView
    from longspec_cli.tui.widgets.stage_panel import _rows

    st = StageView(name="base", state="done", output_dir="runs/base", draft_from=None, tau=2.31, tree_tau=3.47)
    assert ("tau", "2.31", "tree tau", "3.47") in _rows(st)
    plain = StageView(name="base", state="done", output_dir="runs/base", draft_from=None)
    assert not any(row[0] == "tau" for row in _rows(plain))          # not measured: no row


def test_once_shows_chain_and_tree_tau_from_a_current_eval_json(running):
    sha = json.loads((running / "runs/base/stage_complete.json").read_text())["sha256"]
    methods = {"chain": {"method": "chain", "tau": 2.4, "speedup": 1.5}, "tree": {"method": "tree", "tau": 3.9}}
    (running / "runs/base/eval.json").write_text(json.dumps(
        {"stage": "base", "tau": 2.4, "gamma": 4, "lossless": True, "draft_sha256": sha, "methods": methods}))
    d = json.loads(runner.invoke(cli, ["monitor", str(running), "--once", "--json"]).output)
    assert (d["stages"][0]["tau"], d["stages"][0]["tree_tau"]) == (2.4, 3.9)
    text = runner.invoke(cli, ["monitor", str(running), "--once"]).output
    assert "tree tau" in text and "2.40  3.90" in text
