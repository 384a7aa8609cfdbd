"""Wall time of `longspec demo` (tiny preset, three chained stages) on this machine.

    .venv/bin/python bench/bench_demo.py [--dir DIR] [--gpus N] [--again] [--no-fresh]

Runs the demo into a fresh folder and prints the total wall, the part spent in each stage's
DeepSpeed process (run.json started_unix/ended_unix) and the rest (init, tiny assets, chaining
with its load check, validation). --again runs it a second time: every stage is skipped.
The first DeepSpeed run on a machine may also build DeepSpeed's ops; run once to warm up.

Then the quality table: tau of every stage's draft on that stage's held-out prompts (eval.json,
written by the demo) next to the tau of its input draft on the same prompts (eval.json's
baseline: the previous stage's draft), and the gain. Stage 1 starts from a fresh draft, which
the demo does not keep: unless --no-fresh, the same fresh initialisation (the trainer's seed)
is rebuilt here and decoded on stage 1's prompts (an extra eval, outside the timed part).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--again", action="store_true")
    ap.add_argument("--no-fresh", action="store_true", help="skip measuring stage 1's fresh input draft")
    a = ap.parse_args()
    d = a.dir or Path(tempfile.mkdtemp(prefix="ls-demo-")) / "demo"
    if d.exists():
        shutil.rmtree(d)
    cmd = [sys.executable, "-m", "longspec_cli", "demo", str(d), "--quiet"]
    if a.gpus:
        cmd += ["--gpus", str(a.gpus)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        sys.exit(f"demo failed with exit code {proc.returncode}")
    stage_s = {}
    for st in ("base", "long", "longcot"):
        info = json.loads((d / "runs" / st / "run.json").read_text())
        stage_s[st] = info["ended_unix"] - info["started_unix"]
    print(f"longspec demo wall: {wall:.1f} s ({wall / 60:.2f} min)")
    print("  DeepSpeed processes: " + ", ".join(f"{k} {v:.1f} s" for k, v in stage_s.items())
          + f" (sum {sum(stage_s.values()):.1f} s)")
    print(f"  everything else (init + tiny assets + chaining + checks): {wall - sum(stage_s.values()):.1f} s")
    quality_table(d, fresh=not a.no_fresh)
    if a.again:
        t0 = time.perf_counter()
        again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        print(f"second run (all stages skipped): {time.perf_counter() - t0:.1f} s, exit {again.returncode}")


def fresh_draft_tau(d: Path) -> float | None:
    """tau of the trainer's fresh initialisation on stage 1's held-out prompts."""
    import torch
    import yaml

    from longspec.model.weights import save_draft
    from longspec.model.glide import DraftConfig, GlideDraft
    from transformers import AutoConfig

    run = d / "runs" / "base"
    conf = yaml.safe_load((run / "training_config.yaml").read_text())
    torch.manual_seed(conf["seed"])                       # as longspec.train builds a fresh draft
    draft = GlideDraft(DraftConfig.from_target_config(AutoConfig.from_pretrained(conf["model_name_or_path"]),
                                                      conf["draft"]["sliding_window"]))
    out = Path(tempfile.mkdtemp(prefix="ls-fresh-"))
    weights = save_draft({k: v.detach().clone() for k, v in draft.state_dict().items()}, out)
    proc = subprocess.run([sys.executable, "-m", "longspec.evaluate", str(run), "--baseline-draft", str(weights),
                           "--no-write", "--json"], capture_output=True, text=True, cwd=ROOT)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        print(f"(fresh-draft eval failed: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(proc.stdout)["baseline"]["tau"]


def quality_table(d: Path, fresh: bool) -> None:
    rows = []
    for st, source in (("base", "fresh init"), ("long", "base"), ("longcot", "long")):
        path = d / "runs" / st / "eval.json"
        if not path.is_file():
            rows.append((st, None, source, None))
            continue
        ev = json.loads(path.read_text())
        base_tau = (ev.get("baseline") or {}).get("tau")
        if st == "base" and fresh:
            base_tau = fresh_draft_tau(d)
        rows.append((st, ev.get("tau"), source, base_tau))
    print(f"\n{'stage':<9}{'tau':>7}  {'input draft':<12}{'its tau':>8}{'gain':>9}   (same held-out prompts)")
    for st, tau, source, base_tau in rows:
        gain = f"{(tau / base_tau - 1) * 100:+.1f}%" if tau and base_tau else "-"
        print(f"{st:<9}{tau if tau is not None else float('nan'):>7.2f}  {source:<12}"
              f"{base_tau if base_tau is not None else float('nan'):>8.2f}{gain:>9}")


if __name__ == "__main__":
    main()
