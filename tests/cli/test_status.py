"""`longspec status`: states from contract-true run folders, the next action, the JSON schema, exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.machine import liveness

from .conftest import (BAD_YAML, finish_chain, finish_stage, no_traceback, panel_text, write_checkpoint,
                       write_metrics)

runner = CliRunner()


def _status(project) -> dict[str, dict]:
    res = runner.invoke(app, ["status", str(project.root), "--json"])
    assert res.exit_code == 0, res.output
    return {s["name"]: s for s in json.loads(res.output)["stages"]}


def _run_json(out, pid, proc_start, **extra):
    out.mkdir(parents=True, exist_ok=True)
    info = {"pid": pid, "pgid": pid, "host": socket.gethostname(), "argv": ["deepspeed"],
            "started_at": "2024-01-01T00:00:00Z", "proc_start": proc_start, **extra}
    (out / "run.json").write_text(json.dumps(info))


def test_fresh_project_is_all_pending_and_run_would_start_base(project):
    s = _status(project)
    assert [s[n]["state"] for n in ("base", "long", "longcot")] == ["pending"] * 3
    assert s["base"]["next_action"] == "start"
    assert s["long"]["next_action"] == "wait for base"
    res = runner.invoke(app, ["status", str(project.root)])
    assert res.exit_code == 0
    assert "pending" in res.output and "would start base" in res.output


def test_finished_chain_is_done_with_loss_steps_and_draft_paths(project, drafts):
    finish_chain(project, drafts)
    s = _status(project)
    for name in ("base", "long", "longcot"):
        assert s[name]["state"] == "done", s[name]
        assert s[name]["next_action"] == "skip (done)"
        assert s[name]["steps"] == 40 and s[name]["total_steps"] == 40
        assert s[name]["last_loss"] == pytest.approx(4.6)
        assert s[name]["draft_weights"] == str(project.weights(name))
        assert s[name]["sha256"] == project.sha(name)
    assert s["long"]["draft_model_name_or_path"] == str(project.weights("base"))
    assert s["base"]["draft_model_name_or_path"] is None
    assert s["longcot"]["draft_from"] == "long"
    res = runner.invoke(app, ["status", str(project.root)])
    assert "every stage is done" in res.output


def test_editing_a_config_makes_that_stage_and_later_ones_stale(project, drafts):
    finish_chain(project, drafts)
    cfg = project.config("long")
    cfg.write_text(cfg.read_text().replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-4"))
    s = _status(project)
    assert s["base"]["state"] == "done"
    assert s["long"]["state"] == "stale" and "config changed" in " ".join(s["long"]["reasons"])
    assert s["long"]["next_action"] == "re-run (stale)"
    assert s["longcot"]["state"] == "stale" and "upstream stage long is stale" in s["longcot"]["reasons"]
    res = runner.invoke(app, ["status", str(project.root)])
    assert "would re-run long" in res.output


def test_an_edit_of_keys_that_do_not_change_training_leaves_the_stage_done(project, drafts):
    finish_stage(project, "base", drafts["0"], math=True)
    cfg = project.config("base")
    text = cfg.read_text()
    cfg.write_text(text + "# a comment\nlogging_steps: 7\nsave_total_limit: 1\neval_steps: 3\n")
    s = _status(project)["base"]
    assert s["state"] == "done" and s["next_action"] == "skip (done)"
    assert any("do not change what is trained" in r for r in s["reasons"]), s["reasons"]

    cfg.write_text(text.replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-4") + "logging_steps: 7\n")
    s = _status(project)["base"]
    assert s["state"] == "stale" and "config changed since the run (base.yaml: learning_rate)" in s["reasons"]


def test_a_run_that_recorded_no_math_keys_is_stale_after_any_edit(project, drafts):
    finish_stage(project, "base", drafts["0"])  # stage_complete.json of an older trainer: no `math`
    cfg = project.config("base")
    cfg.write_text(cfg.read_text() + "logging_steps: 7\n")
    s = _status(project)["base"]
    assert s["state"] == "stale" and "config changed since the run (base.yaml)" in s["reasons"]


def test_overrides_recorded_in_run_json_are_part_of_the_fingerprint(project, drafts):
    finish_stage(project, "base", drafts["0"], overrides=["max_steps=40", "output_dir=/elsewhere"])
    assert _status(project)["base"]["state"] == "done"
    info = json.loads((project.out("base") / "run.json").read_text())
    info["overrides"] = ["max_steps=80"]
    (project.out("base") / "run.json").write_text(json.dumps(info))
    assert _status(project)["base"]["state"] == "stale"


def test_rerunning_an_upstream_stage_makes_the_downstream_stale(project, drafts):
    finish_chain(project, drafts)
    # base is run again and produces another draft; long was trained from the old one
    finish_stage(project, "base", drafts["2"])
    s = _status(project)
    assert s["base"]["state"] == "done"
    assert s["long"]["state"] == "stale"
    assert "different draft than base" in " ".join(s["long"]["reasons"])
    assert s["longcot"]["state"] == "stale"


def test_a_downstream_stage_trained_without_the_upstream_draft_is_stale(project, drafts):
    finish_stage(project, "base", drafts["0"])
    finish_stage(project, "long", drafts["1"], draft_sha256=None)
    assert _status(project)["long"]["state"] == "stale"


def test_running_is_a_live_process_with_the_recorded_start_time(project, drafts):
    finish_stage(project, "base", drafts["0"])
    out = project.out("long")
    write_metrics(out, 12, 100, end=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _run_json(out, child.pid, liveness.proc_start_time(child.pid))
        s = _status(project)
        assert s["long"]["state"] == "running"
        assert s["long"]["next_action"] == "wait (running)"
        assert (s["long"]["steps"], s["long"]["total_steps"]) == (12, 100)
        res = runner.invoke(app, ["status", str(project.root)])
        assert "long is running" in res.output and "12/100" in res.output
    finally:
        child.kill()
        child.wait()
    # the process is gone and never wrote stage_complete.json
    s = _status(project)
    assert s["long"]["state"] == "failed" and s["long"]["next_action"] == "re-run (failed)"
    assert "is gone" in " ".join(s["long"]["reasons"])


def test_a_reused_pid_is_not_taken_as_the_run(project):
    # our own pid is alive, but it is not the process that started at proc_start
    me = os.getpid()
    start = liveness.proc_start_time(me)
    _run_json(project.out("base"), me, start - 1 if isinstance(start, int) else start - 5.0)
    assert _status(project)["base"]["state"] == "failed"
    _run_json(project.out("base"), me, start)
    assert _status(project)["base"]["state"] == "running"


def test_error_event_means_failed_and_checkpoints_mean_resume(project, drafts):
    out = project.out("base")
    write_metrics(out, 250, 1000, error="CUDA out of memory")
    assert _status(project)["base"]["state"] == "failed"
    assert _status(project)["base"]["next_action"] == "re-run (failed)"
    write_checkpoint(out, 100)
    write_checkpoint(out, 200)
    write_checkpoint(out, 250, complete=False)
    s = _status(project)["base"]
    assert s["state"] == "failed" and s["next_action"] == "resume from step 200" and s["resume_step"] == 200
    assert "CUDA out of memory" in " ".join(s["reasons"])


def test_pending_with_complete_checkpoints_resumes_from_the_last(project):
    out = project.out("base")
    write_metrics(out, 150, 1000, end=False)
    write_checkpoint(out, 100)
    write_checkpoint(out, 150, complete=False)
    s = _status(project)["base"]
    assert s["state"] == "pending" and s["next_action"] == "resume from step 100"
    res = runner.invoke(app, ["status", str(project.root)])
    assert "resume base from step 100" in res.output


def test_weights_not_matching_stage_complete_are_not_done(project, drafts):
    finish_stage(project, "base", drafts["0"])
    w = project.weights("base")
    w.write_bytes(w.read_bytes()[:-10])  # truncated
    s = _status(project)
    assert s["base"]["state"] == "failed" and "do not match" in " ".join(s["base"]["reasons"])
    w.unlink()
    assert "missing" in " ".join(_status(project)["base"]["reasons"])


def test_malformed_stage_complete_and_metrics_are_reported_not_fatal(project, drafts):
    out = project.out("base")
    write_metrics(out, 5, 10, end=False, extra_lines=["{oops"])
    (out / "stage_complete.json").write_text("{truncated")
    s = _status(project)["base"]
    assert s["state"] == "pending" and s["steps"] == 5
    assert any("stage_complete.json" in r for r in s["reasons"])


def test_json_schema(project, drafts):
    finish_stage(project, "base", drafts["0"])
    res = runner.invoke(app, ["status", str(project.root), "--json"])
    doc = json.loads(res.output)
    assert set(doc) >= {"stages"}
    want = {"name": str, "config": str, "output_dir": str, "state": str, "next_action": str}
    nullable = {"draft_from": str, "draft_model_name_or_path": str, "draft_weights": str, "sha256": str,
                "steps": int, "total_steps": int, "last_loss": float}
    for st in doc["stages"]:
        for k, t in want.items():
            assert isinstance(st[k], t), (k, st)
        for k, t in nullable.items():
            assert k in st and (st[k] is None or isinstance(st[k], t)), (k, st)
        assert st["state"] in ("pending", "running", "done", "failed", "stale")


def test_unreadable_stage_config_is_a_note_not_a_crash(project):
    project.config("long").write_text("a: [unclosed\n")
    res = runner.invoke(app, ["status", str(project.root), "--json"])
    assert res.exit_code == 0
    long = {s["name"]: s for s in json.loads(res.output)["stages"]}["long"]
    assert long["draft_model_name_or_path"] is None
    assert any("config unreadable" in r for r in long["reasons"])


def test_missing_project_exits_2_and_bad_manifest_exits_3(project, tmp_path):
    res = runner.invoke(app, ["status", str(tmp_path / "nope")])
    assert res.exit_code == 2
    no_traceback(res)
    (project.root / "longspec.yaml").write_text("stages:\n  - {name: a, config: a.yaml}\n")
    res = runner.invoke(app, ["status", str(project.root)])
    assert res.exit_code == 3 and "output_dir" in res.output
    no_traceback(res)


@pytest.mark.parametrize("name", list(BAD_YAML))
def test_bad_manifest_inputs_exit_3_without_traceback(tmp_path, name):
    raw, needle = BAD_YAML[name]
    (tmp_path / "longspec.yaml").write_bytes(raw)
    res = runner.invoke(app, ["status", str(tmp_path)])
    assert res.exit_code == 3, (name, res.output)
    no_traceback(res)
    assert needle in panel_text(res.output), res.output


def test_help_has_examples():
    res = runner.invoke(app, ["status", "--help"])
    assert res.exit_code == 0 and "Examples" in res.output and "--json" in res.output


HYGIENE = r"""
import sys
from pathlib import Path
import longspec_cli.app
from typer.testing import CliRunner
runner = CliRunner()
proj = sys.argv[1]
codes = [runner.invoke(longspec_cli.app.app, ["--help"]).exit_code]
after_help = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf"))
assert not after_help, after_help  # `longspec --help` imports no Hydra (lazy imports)
codes += [runner.invoke(longspec_cli.app.app, args).exit_code for args in (
    ["status", proj], ["status", proj, "--json"], ["next-stage", proj, "--dry-run"],
    ["next-stage", proj, "--json"], ["status", "--help"], ["next-stage", "--help"])]
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("torch", "deepspeed", "transformers", "textual"))
print(codes, heavy)
assert codes == [0] * 7, codes
assert not heavy, heavy
"""


def test_status_and_next_stage_never_import_the_heavy_stack(project, drafts):
    """The CLI process loads none of torch/deepspeed/transformers/textual, even when the deep check
    runs (it runs in its own subprocess); Hydra composes the stages, but `--help` does not load it."""
    finish_stage(project, "base", drafts["0"])
    res = subprocess.run([sys.executable, "-c", HYGIENE, str(project.root)], capture_output=True, text=True,
                         timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[0, 0, 0, 0, 0, 0, 0] []" in res.stdout


def test_failed_reason_says_stopped_or_exit_code(project):
    _run_json(project.out("base"), 999_999_999, 1, interrupted=True, returncode=-2)
    assert "stopped" in " ".join(_status(project)["base"]["reasons"])
    _run_json(project.out("base"), 999_999_999, 1, returncode=4)
    assert "exited with code 4" in " ".join(_status(project)["base"]["reasons"])


def test_a_stage_not_yet_pointed_at_its_upstream_draft_says_so(project, drafts):
    finish_stage(project, "base", drafts["0"])
    assert any("next-stage" in r for r in _status(project)["long"]["reasons"])
    assert runner.invoke(app, ["next-stage", str(project.root), "--no-deep"]).exit_code == 0
    long = _status(project)["long"]
    assert long["draft_model_name_or_path"] == str(project.weights("base"))
    assert not any("next-stage" in r for r in long["reasons"])


def test_tau_shows_only_when_eval_was_measured_on_the_current_draft(project, drafts):
    finish_chain(project, drafts)
    ev = {"stage": "base", "tau": 2.31, "gamma": 4, "lossless": True, "speedup": 1.8,
          "draft_sha256": project.sha("base")}
    (project.out("base") / "eval.json").write_text(json.dumps(ev))
    (project.out("long") / "eval.json").write_text(json.dumps({**ev, "stage": "long", "draft_sha256": "0" * 64}))
    s = _status(project)
    assert s["base"]["tau"] == pytest.approx(2.31) and s["base"]["speedup"] == pytest.approx(1.8)
    assert s["long"]["tau"] is None
    assert any("another draft" in r for r in s["long"]["reasons"])
    assert s["longcot"]["tau"] is None and s["longcot"]["reasons"] == []
    res = runner.invoke(app, ["status", str(project.root)])
    assert "2.31" in res.output and "x1.80" in res.output
    assert s["base"]["tree_tau"] is None                      # an older eval.json: chain only, still read


def test_status_shows_the_tree_tau_next_to_the_chain_tau(project, drafts):
    finish_chain(project, drafts)
    methods = {"chain": {"method": "chain", "tau": 2.31, "speedup": 1.8, "gamma": 4},
               "tree": {"method": "tree", "tau": 3.47, "speedup": 2.25, "tree_shape": [4, 16, 16, 16, 16]}}
    ev = {"stage": "base", "tau": 2.31, "gamma": 4, "lossless": True, "speedup": 1.8, "method": "chain",
          "methods": methods, "draft_sha256": project.sha("base")}
    (project.out("base") / "eval.json").write_text(json.dumps(ev))
    s = _status(project)
    assert s["base"]["tau"] == pytest.approx(2.31) and s["base"]["tree_tau"] == pytest.approx(3.47)
    res = runner.invoke(app, ["status", str(project.root)])
    assert "tree" in res.output and "3.47" in res.output and "x2.25" in res.output and "2.31" in res.output


def test_status_shows_tau_by_prompt_length_beside_the_input_draft(project, drafts):
    finish_chain(project, drafts)
    bucket = lambda n, tau, base: {"length": n, "prompts": 4, "chain": {"tau": tau}, "baseline": {"tau": base}}  # noqa: E731
    ev = {"stage": "long", "tau": 2.41, "gamma": 4, "lossless": True, "method": "chain",
          "draft_sha256": project.sha("long"),
          "by_length": [bucket(256, 2.30, 1.88), bucket(1024, 2.51, 1.74), {"length": 4096, "prompts": 0}]}
    (project.out("long") / "eval.json").write_text(json.dumps(ev))
    out = runner.invoke(app, ["status", str(project.root)], terminal_width=200).output
    assert "long: tau by prompt length 256 2.30 (input draft 1.88), 1k 2.51 (input draft 1.74)" in out, out
    assert "base: tau by prompt length" not in out and "4k" not in out
