"""Simulated tau while training: agreement with `eval`'s chain tau, checkpoint ranking, and cost.

    .venv/bin/python bench/bench_simtau.py [--dir DIR] [--skip-cost] [--together] [--gamma 4]

1. Agreement. Runs the tiny demo pipeline (`longspec demo --no-eval`, default settings: every
   stage records simulated tau at step 0, every eval_steps and at the end). For each stage, the
   held-out records (heldout.json: records [start, start + records) of the stage's train_file,
   which the trainer never drew) are written as a prompts file, and `python -m longspec.evaluate`
   decodes them (greedy chain, --gamma) with each draft the stage has on disk at a step that has
   a simulated-tau record: the input draft (step 0, the upstream's final draft; stage 1 starts
   fresh and keeps none), the kept checkpoints and the final draft. Printed: simulated tau /
   eval tau per draft (ratio), and whether the two rank the drafts of a stage in the same order.
2. Cost. The same pipeline again with eval_steps=0 (no evaluation, no best/); per stage the
   trainer's own wall time (the `end` event's elapsed_s) with and without, their ratio, and the
   evaluation's share measured inside the run (sum of the records' eval_s over the rest). The
   machine's load moves the first ratio; the second does not depend on a second run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STAGES = ("base", "long", "longcot")


def start(d: Path, *overrides: str) -> subprocess.Popen:
    """`longspec init --preset tiny` then `longspec run --all` (started, not waited for)."""
    if d.exists():
        shutil.rmtree(d)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "longspec_cli", "init", str(d), "--preset", "tiny", "--no-input"],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    return subprocess.Popen([sys.executable, "-m", "longspec_cli", "run", str(d), "--all", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{out[-3000:]}")


def demo(d: Path, *overrides: str) -> None:
    wait(start(d, *overrides))


def records(run: Path) -> dict[int, dict]:
    from longspec_cli.core import runfolder

    return {r["step"]: r for r in runfolder.read_metrics(run / runfolder.METRICS).simtau}


def heldout_prompts(run: Path, out: Path) -> int:
    """The held-out records of the stage, as a --prompts file (training records: rendered and cut as the trainer does)."""
    import yaml

    from longspec.data import read_records

    h = json.loads((run / "heldout.json").read_text())
    conf = yaml.safe_load((run / "training_config.yaml").read_text())
    recs = [rec for i, (_, rec) in enumerate(read_records(Path(conf["train_file"]), "error"))
            if h["start"] <= i < h["start"] + h["records"]]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return len(recs)


def eval_tau(run: Path, draft: Path, prompts: Path, n: int, gamma: int) -> float:
    proc = subprocess.run([sys.executable, "-m", "longspec.evaluate", str(run), "--draft", str(draft),
                           "--prompts", str(prompts), "--num-prompts", str(n), "--gamma", str(gamma),
                           "--no-write", "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if proc.returncode not in (0, 1):
        sys.exit(f"eval failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["methods"]["chain"]["tau"]


def drafts(d: Path, stage: str) -> dict[int, Path]:
    """step -> draft file of the stage: the input draft (step 0), kept checkpoints, the final draft."""
    run = d / "runs" / stage
    done = json.loads((run / "stage_complete.json").read_text())
    out = {}
    prev = STAGES[STAGES.index(stage) - 1] if stage != "base" else None
    if prev:
        out[0] = d / "runs" / prev / "draft_model_weights.pth"
    for c in sorted(run.glob("checkpoint-*")):
        if (c / "checkpoint.json").is_file():
            out[int(c.name.split("-")[1])] = c / "draft_model_weights.pth"
    out[done["steps"]] = run / "draft_model_weights.pth"
    return out


def agreement(d: Path, gamma: int) -> None:
    print(f"agreement: simulated tau (held-out records, teacher-forced) vs eval's greedy chain tau (gamma {gamma}), "
          "same held-out records as prompts")
    print(f"{'stage':8} {'step':>5} {'sim tau':>8} {'eval tau':>9} {'ratio':>6}")
    ratios, same_order = [], []
    for stage in STAGES:
        run = d / "runs" / stage
        rec = records(run)
        prompts = run.parent / f"{stage}-heldout.jsonl"
        n = heldout_prompts(run, prompts)
        rows = []
        for step, path in sorted(drafts(d, stage).items()):
            if step not in rec:
                continue
            ev = eval_tau(run, path, prompts, n, gamma)
            rows.append((step, rec[step]["tau"], ev))
            print(f"{stage:8} {step:>5} {rec[step]['tau']:>8.3f} {ev:>9.3f} {rec[step]['tau'] / ev:>6.3f}")
        final = rows[-1]
        ratios.append((stage, final[1] / final[2]))
        by_sim = [r[0] for r in sorted(rows, key=lambda r: r[1])]
        by_eval = [r[0] for r in sorted(rows, key=lambda r: r[2])]
        same_order.append((stage, by_sim == by_eval, by_sim, by_eval))
    for stage, ratio in ratios:
        print(f"  {stage}: final draft simulated/eval tau ratio {ratio:.3f}")
    for stage, same, a, b in same_order:
        print(f"  {stage}: drafts by simulated tau {a}, by eval tau {b}: {'same order' if same else 'DIFFERENT order'}")


def stage_costs(d: Path) -> dict[str, tuple[float, float]]:
    """stage -> (trainer wall s from the end event, seconds inside simulated-tau evaluations)."""
    from longspec_cli.core import runfolder

    out = {}
    for stage in STAGES:
        log = runfolder.read_metrics(d / "runs" / stage / runfolder.METRICS)
        end = [e for e in log.events if e.get("event") == "end"][-1]
        out[stage] = (float(end["elapsed_s"]), sum(float(r.get("eval_s", 0)) for r in log.simtau))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--together", action="store_true",
                    help="run the eval_steps=0 pipeline at the same time as the default one (a loaded machine "
                         "then slows both alike)")
    a = ap.parse_args()
    base = a.dir or Path(tempfile.mkdtemp(prefix="ls-simtau-"))
    on, off = base / "on", base / "off"
    second = start(off, "eval_steps=0") if a.together and not a.skip_cost else None
    demo(on)
    if second is not None:
        wait(second)
    agreement(on, a.gamma)
    with_eval = stage_costs(on)
    print("cost (trainer wall s of each stage, `end` event):")
    if not a.skip_cost:
        if second is None:
            demo(off, "eval_steps=0")
        without = stage_costs(off)
    for stage in STAGES:
        wall, inside = with_eval[stage]
        line = f"  {stage:8} with eval {wall:7.1f} s, of which evaluating {inside:5.1f} s: +{inside / (wall - inside):.1%}"
        if not a.skip_cost:
            w0 = without[stage][0]
            line += f"; eval_steps=0 {w0:7.1f} s, ratio {wall / w0:.3f}"
        print(line)
    total, inside = sum(w for w, _ in with_eval.values()), sum(i for _, i in with_eval.values())
    print(f"  all stages: evaluation adds {inside / (total - inside):.1%} to the trainer's wall time"
          + ("" if a.skip_cost else f"; wall ratio on/off {total / sum(w for w, _ in without.values()):.3f}"))


if __name__ == "__main__":
    main()
