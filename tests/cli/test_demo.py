"""`longspec demo`: the tiny preset end to end, three chained stages, checked by sha256, each
stage measured (tau, speed-up) on its final draft (slow)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_demo_runs_three_chained_stages_and_prints_the_summary(tmp_path):
    demo = tmp_path / "demo"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-m", "longspec_cli", "demo", str(demo), "--max-steps", "3", "--quiet"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {s: demo / "runs" / s for s in ("base", "long", "longcot")}
    done = {s: json.loads((d / "stage_complete.json").read_text()) for s, d in runs.items()}
    # every stage finished its steps and its weights are the file stage_complete.json names
    for s, c in done.items():
        assert c["steps"] == 3 and c["sha256"] == sha256(runs[s] / "draft_model_weights.pth")
    # chaining: each stage trained from the previous stage's final draft, byte for byte
    assert done["base"]["draft_sha256"] is None
    assert done["long"]["draft_sha256"] == done["base"]["sha256"]
    assert done["longcot"]["draft_sha256"] == done["long"]["sha256"]
    for stage, prev in (("long", "base"), ("longcot", "long")):
        text = (demo / "conf" / "exp" / f"{stage}.yaml").read_text()
        assert f"draft_model_name_or_path: {runs[prev] / 'draft_model_weights.pth'}" in text
    # every stage was measured on its own final draft (the upstream's final draft as the baseline)
    ev = {s: json.loads((d / "eval.json").read_text()) for s, d in runs.items()}
    for s, e in ev.items():
        assert e["draft_sha256"] == done[s]["sha256"] and e["lossless"] is True
    assert "baseline" not in ev["base"]
    assert ev["long"]["baseline"]["draft_sha256"] == done["base"]["sha256"]
    assert ev["longcot"]["baseline"]["draft_sha256"] == done["long"]["sha256"]
    # tau by context length: the long stages' two buckets (256 and 512 tokens), each next to the input draft
    for s in ("long", "longcot"):
        assert ev[s]["lengths"] == [256, 512] and ev[s]["by_length"]
        assert all("baseline" in b and b["chain"]["tau"] >= 1.0 for b in ev[s]["by_length"])
    assert ev["base"]["lengths"] == [64, 128]
    assert "tau by context length" in res.stdout
    # the summary table: one row per stage with steps, losses, tokens/s, wall time, tau, speed-up, sha256 prefix
    header = next(line.split() for line in res.stdout.splitlines() if line.split()[:3] == ["stage", "action", "result"])
    assert header == ["stage", "action", "result", "steps", "first", "loss", "last", "loss", "tokens/s", "wall", "s",
                      "sim", "tau", "tau", "speed-up", "tree", "tau", "sha256"]
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()
            if line.split() and line.split()[0] in runs and "done" in line.split()[:3]}
    assert set(rows) == set(runs)
    for s, row in rows.items():
        assert len(row) == 13 and row[3] == "3" and row[-1] == done[s]["sha256"][:16]
        float(row[4]), float(row[5]), float(row[7]), float(row[10])  # first loss, last loss, wall s, speed-up
        last_sim = [json.loads(line) for line in (runs[s] / "metrics.jsonl").read_text().splitlines()
                    if '"simtau"' in line][-1]
        assert float(row[8]) == round(last_sim["tau"], 2) and last_sim["step"] == 3   # the estimate at the last step
        tau = float(row[9])
        assert tau >= 1.0 and tau == round(ev[s]["tau"], 2)  # tokens per target forward: at least the bonus token
        assert float(row[10]) == round(ev[s]["speedup"], 2)
        assert float(row[11]) == round(ev[s]["methods"]["tree"]["tau"], 2)   # the tree's tau next to the chain's
    assert "demo finished in" in res.stdout

    # run again: every stage is skipped, nothing is launched
    again = subprocess.run([sys.executable, "-m", "longspec_cli", "demo", str(demo), "--max-steps", "3", "--quiet"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout.count("skipped") == 3, again.stdout
    assert all(json.loads((d / "stage_complete.json").read_text()) == done[s] for s, d in runs.items())
    # ... and nothing is measured again: each eval.json is current
    assert again.stdout.count("not measured again") == 3 and "evaluating" not in again.stdout, again.stdout
    assert all(json.loads((d / "eval.json").read_text()) == ev[s] for s, d in runs.items())
    taus = [line.split()[-4] for line in again.stdout.splitlines() if line.split()[:1] and line.split()[0] in runs
            and "skipped" in line.split()[:3]]
    assert taus == [f"{ev[s]['tau']:.2f}" for s in runs]  # still shown, from the current eval.json files
    # --no-eval: not even the check
    quick = subprocess.run([sys.executable, "-m", "longspec_cli", "demo", str(demo), "--max-steps", "3", "--quiet",
                            "--no-eval"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert quick.returncode == 0 and "eval.json" not in quick.stdout and "evaluating" not in quick.stdout, quick.stdout


@pytest.mark.slow
def test_demo_regenerate_drops_documents_the_target_ends_at_once_and_trains_every_stage(tmp_path):
    """Two base records the tiny target ends at once after the demo's 32-token context (base records
    237 and 472 in the other answer style: an empty continuation, nothing to train) put among the
    first ones: regeneration leaves them out and counts them, and all three stages train."""
    from longspec.data.synthetic import restyle

    demo = tmp_path / "demo"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cli = [sys.executable, "-m", "longspec_cli"]
    res = subprocess.run([*cli, "init", str(demo), "--preset", "tiny", "--no-input"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = demo / "assets" / "data" / "base.jsonl"
    lines = data.read_text().splitlines()
    ends = [json.dumps(restyle(json.loads(lines[i]), "other")) for i in (237, 472)]
    data.write_text("\n".join(lines[:5] + ends + lines[5:]) + "\n")
    res = subprocess.run([*cli, "demo", str(demo), "--regenerate", "--max-steps", "1", "--no-eval", "--quiet"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "untrainable 2;" in res.stdout
    folder = demo / "data" / "regen" / "base"
    counts = json.loads((folder / "manifest.json").read_text())["counts"]
    assert counts["untrainable"] == 2 and counts["untrainable_ids"] == ["base.jsonl#5", "base.jsonl#6"]
    for stage in ("base", "long", "longcot"):
        assert json.loads((demo / "runs" / stage / "stage_complete.json").read_text())["steps"] == 1
    res = subprocess.run([*cli, "status", str(demo), "--json"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    base = json.loads(res.stdout)["stages"][0]
    assert base["regeneration"]["counts"]["untrainable"] == 2 and base["prepared"]["untrainable"] == 0
    assert any(r.startswith("regenerated 48/48 rows: kept ") and "untrainable 2 (nothing to train within "
               "max_seq_length: base.jsonl#5, base.jsonl#6)" in r for r in base["reasons"]), base["reasons"]
