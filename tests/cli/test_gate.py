"""`longspec run --gate P` / `--eval`: evaluate each stage as it finishes, stop on a tau drop.

Fast tier: the --gate argument checks, and the gate over finished stages (stand-in run folders
with eval.json files measured on their current drafts: skipped and not measured again; made
non-current: the real evaluator runs). Slow tier: the tiny preset trained for real, a `long`
stage that wrecks its draft fails the gate against `base`'s draft, and `longcot` never starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import needs
from tests.cli.test_run import cli, cpu_env, finish, flat, scaffold

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("base", "long", "longcot")


def summary_rows(stdout: str) -> dict[str, list[str]]:
    """The summary table's rows by stage (columns as in execute.SUMMARY_HEADER; results may be two words)."""
    rows = {}
    for line in stdout.splitlines():
        words = line.split()
        if words and words[0] in STAGES and len(words) >= 9 and words[1] in ("skip", "start", "rerun", "resume"):
            rows[words[0]] = words
    return rows


# ------------------------------------------------------------------------------- the argument

@pytest.mark.parametrize("value, words", [("-1", "must be a number >= 0"), ("nan", "must be a number >= 0"),
                                          ("101", "at most 100"), ("ten", "is not a valid float")])
def test_gate_must_be_a_percentage(tmp_path, value, words):
    proj = scaffold(tmp_path)
    res = cli("run", str(proj), "--all", f"--gate={value}", env=cpu_env())
    assert res.returncode == 2, res.stdout + res.stderr
    assert words in flat(res.stderr) and "Traceback" not in res.stderr
    assert not (proj / "runs").exists()  # refused before anything started


def test_gate_and_eval_do_not_go_with_slurm(tmp_path):
    proj = scaffold(tmp_path)
    for flag in ("--gate=5", "--eval"):
        res = cli("run", str(proj), "--all", "--slurm", flag, env=cpu_env())
        assert res.returncode == 2 and "do not go with --slurm" in flat(res.stderr), res.stderr
    assert not (proj / "longspec.sbatch").exists()


def test_dry_run_with_gate_shows_the_eval_command_per_stage(tmp_path):
    proj = scaffold(tmp_path)
    res = cli("run", str(proj), "--all", "--dry-run", "--gate", "10", env=cpu_env())
    assert res.returncode == 0, res.stderr
    then = [line for line in res.stdout.splitlines() if line.startswith("# then:")]
    assert len(then) == 3 and all("-m longspec.evaluate" in t and "tau >= 90%" in t for t in then)
    assert f"--baseline-draft {proj / 'runs' / 'base' / 'draft_model_weights.pth'} --baseline-stage base" in then[1]
    assert "--baseline-draft" not in then[0]


# ------------------------------------------------------- the gate over finished stand-in stages

def write_eval(spec, tau: float, *, baseline: tuple[str, float] | None = None, lossless: bool = True,
               sha: str | None = None) -> Path:
    """An eval.json as longspec.evaluate writes it, measured on the stage's final draft."""
    weights = spec.output_dir / "draft_model_weights.pth"
    obj = {"stage": spec.name, "tau": tau, "speedup": round(tau / 1.5, 4), "gamma": 4, "lossless": lossless,
           "prompts": 8, "max_new_tokens": 64,
           "draft_sha256": sha or hashlib.sha256(weights.read_bytes()).hexdigest()}
    if baseline is not None:
        obj["baseline"] = {"stage": baseline[0], "tau": baseline[1], "lossless": True,
                           "draft_sha256": baseline_sha(spec.output_dir.parent / baseline[0])}
    path = spec.output_dir / "eval.json"
    path.write_text(json.dumps(obj))
    return path


def baseline_sha(run: Path) -> str:
    return hashlib.sha256((run / "draft_model_weights.pth").read_bytes()).hexdigest()


@pytest.fixture()
def finished(tmp_path):
    """A tiny-preset project whose three stages are done (stand-in drafts) with current eval.json files:
    long's tau 2.0 against base's draft 2.5 on the same prompts (-20%)."""
    from longspec.project.manifest import load_manifest

    proj = scaffold(tmp_path)
    base, long, longcot = load_manifest(proj).stages
    sha_base = finish(base)
    sha_long = finish(long, draft_sha=sha_base)
    finish(longcot, draft_sha=sha_long)
    write_eval(base, 2.5)
    write_eval(long, 2.0, baseline=("base", 2.5))
    write_eval(longcot, 2.1, baseline=("long", 2.0))
    return proj, {s.name: s for s in (base, long, longcot)}


def test_gate_stops_at_the_stage_whose_tau_drops_too_far(finished):
    proj, specs = finished
    before = {s: (spec.output_dir / "eval.json").stat().st_mtime_ns for s, spec in specs.items()}
    res = cli("run", str(proj), "--all", "--gate", "10", env=cpu_env())
    assert res.returncode == 1, res.stdout + res.stderr
    err = flat(res.stderr)
    assert "stage long failed the quality gate (--gate 10): tau 2.000 vs previous 2.500 (-20.0%)" in err
    assert "the next stage was not started" in err and f"longspec eval {proj} long" in err
    rows = summary_rows(res.stdout)
    assert rows["base"][:3] == ["base", "skip", "skipped"]
    assert rows["long"][2:4] == ["gate", "failed"] and rows["longcot"][2:4] == ["not", "run"]
    assert rows["base"][-4:-1] == ["2.50", "1.67", "-"] and rows["long"][-4:-1] == ["2.00", "1.33", "-"]  # tau, speed-up, tree tau
    assert "long: failed the quality gate" in res.stdout
    # every eval.json was current: none was measured again (a stand-in draft could not be measured)
    assert "not measured again" in res.stdout and "evaluating" not in res.stdout
    assert {s: (spec.output_dir / "eval.json").stat().st_mtime_ns for s, spec in specs.items()} == before


def test_a_wider_gate_passes_every_stage_and_eval_alone_never_stops(finished):
    proj, _ = finished
    res = cli("run", str(proj), "--all", "--gate", "25", env=cpu_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("gate (--gate 25) passed") == 3
    assert "nothing to do" in res.stdout
    res = cli("run", str(proj), "--all", "--eval", env=cpu_env())
    assert res.returncode == 0 and "gate" not in res.stdout, res.stdout + res.stderr
    assert [r[-4] for r in summary_rows(res.stdout).values()] == ["2.50", "2.00", "2.10"]


def test_a_lossy_stage_fails_even_a_100_percent_gate(finished):
    proj, specs = finished
    write_eval(specs["long"], 2.4, baseline=("base", 2.5), lossless=False)
    res = cli("run", str(proj), "--all", "--gate", "100", env=cpu_env())
    assert res.returncode == 1 and "not lossless" in flat(res.stderr), res.stdout + res.stderr


def test_a_non_current_eval_json_is_measured_again_by_the_real_evaluator(finished):
    """long's eval.json names another draft: `run --gate` runs longspec.evaluate on it, which
    refuses the stand-in weights; under --gate that stops the pipeline with its message."""
    needs.module("torch")
    proj, specs = finished
    write_eval(specs["long"], 2.4, baseline=("base", 2.5), sha="0" * 64)
    res = cli("run", str(proj), "--all", "--gate", "10", "--quiet", env=cpu_env(), timeout=600)
    assert "== long: evaluating" in res.stdout and "-m longspec.evaluate" in res.stdout, res.stdout
    assert "== base: eval.json is current" in res.stdout
    assert res.returncode == 1, res.stdout + res.stderr
    assert "stage long: evaluation failed, so the gate cannot pass" in flat(res.stderr)
    assert "Traceback" not in res.stderr
    rows = summary_rows(res.stdout)
    assert rows["long"][2:4] == ["eval", "failed"] and rows["longcot"][2:4] == ["not", "run"]
    # without --gate the same failure is a warning and the pipeline goes on
    res = cli("run", str(proj), "--all", "--eval", "--quiet", env=cpu_env(), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "warning: long: evaluation failed" in res.stderr
    assert summary_rows(res.stdout)["long"][-4] == "-"  # no tau for a draft that was not measured


# ------------------------------------------------------------------ slow tier: the real trainer

def set_keys(config: Path, **keys) -> None:
    """Set top-level scalar keys of a stage file (their old lines dropped, the new ones appended)."""
    lines = [l for l in config.read_text().splitlines() if l.split(":", 1)[0] not in keys]
    config.write_text("\n".join(lines + [f"{k}: {v}" for k, v in keys.items()]) + "\n")


@pytest.mark.slow
def test_a_wrecked_long_stage_fails_the_gate_and_longcot_never_starts(tmp_path):
    from tests.cli.test_run import tiny_project

    proj = tiny_project(tmp_path)
    set_keys(proj / "conf" / "exp" / "base.yaml", max_steps=60, save_steps=60)
    set_keys(proj / "conf" / "exp" / "long.yaml", max_steps=6, save_steps=6, learning_rate=1.0)
    args = [sys.executable, "-m", "longspec_cli", "run", str(proj), "--all", "--gate", "10", "--quiet"]
    res = subprocess.run(args, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    runs = proj / "runs"
    ev = {s: json.loads((runs / s / "eval.json").read_text()) for s in ("base", "long")}
    done = {s: json.loads((runs / s / "stage_complete.json").read_text()) for s in ("base", "long")}
    # each eval.json measured the stage's own final draft; long's baseline is base's final draft
    assert ev["base"]["draft_sha256"] == done["base"]["sha256"] and "baseline" not in ev["base"]
    assert ev["long"]["draft_sha256"] == done["long"]["sha256"]
    assert ev["long"]["baseline"]["draft_sha256"] == done["base"]["sha256"]
    assert ev["long"]["lossless"] and ev["long"]["tau"] < 0.9 * ev["long"]["baseline"]["tau"]
    assert not (runs / "longcot").exists()
    err = flat(res.stderr)
    assert "stage long failed the quality gate (--gate 10)" in err and f"longspec eval {proj} long" in err
    longest = max(b["length"] for b in ev["long"]["by_length"])          # judged where it was trained
    assert f"{longest}-token bucket" in err and longest == 512
    rows = summary_rows(res.stdout)
    assert rows["long"][2:4] == ["gate", "failed"] and rows["longcot"][2:4] == ["not", "run"]
    assert float(rows["long"][-4]) == pytest.approx(ev["long"]["tau"], abs=0.005)

    # again: base and long are done with current eval.json files: nothing trains, nothing is measured
    stamps = {s: ev[s]["time"] for s in ev}
    again = subprocess.run(args, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "evaluating" not in again.stdout, again.stdout + again.stderr
    assert {s: json.loads((runs / s / "eval.json").read_text())["time"] for s in ev} == stamps
    assert not (runs / "longcot").exists()
