"""Tau and speed-up per stage (and per gamma) of a longspec project, e.g. the tiny preset.

    python bench/bench_eval.py DIR [--gammas 1,2,4] [--num-prompts 8] [--max-new-tokens 64]
    python bench/bench_eval.py DIR --init --train     # make a tiny project, train it, then measure

For every finished stage and every gamma it runs `python -m longspec.evaluate RUN --no-write`
(the same code `longspec eval` uses; eval.json is left alone) and prints one row:
tau (tokens per target forward), speculative and plain decode tokens/s, speed-up, lossless.
On a CPU the tiny target costs about as much per forward as one draft step, so the speed-up
stays below 1 there whatever tau is: tau is the figure that transfers to real targets.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sh(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--gammas", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--init", action="store_true", help="longspec init PROJECT --preset tiny first")
    ap.add_argument("--train", action="store_true", help="longspec run PROJECT --all first")
    args = ap.parse_args()
    cli = [sys.executable, "-m", "longspec_cli"]
    if args.init:
        p = sh([*cli, "init", str(args.project), "--preset", "tiny", "--no-input"])
        print(p.stdout.strip() or p.stderr.strip())
    if args.train:
        t0 = time.time()
        p = sh([*cli, "run", str(args.project), "--all", "--quiet"])
        print(f"longspec run --all: exit {p.returncode} in {time.time() - t0:.0f}s")

    from longspec_cli.core.manifest import load_manifest
    from longspec_cli.core.status import project_status

    stages = [s for s in project_status(load_manifest(args.project)) if s.state in ("done", "stale")]
    if not stages:
        print("no finished stage to measure")
        return 1
    gammas = [int(g) for g in args.gammas.split(",")]
    print(f"{'stage':8} {'gamma':>5} {'tau':>6} {'spec tok/s':>11} {'target tok/s':>13} {'speed-up':>9} "
          f"{'ctx':>5} {'lossless':>9} {'wall s':>7}")
    for st in stages:
        for g in gammas:
            t0 = time.time()
            p = sh([sys.executable, "-m", "longspec.evaluate", st.output_dir, "--stage", st.name, "--gamma", str(g),
                    "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                    "--no-write", "--json"])
            try:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                print(f"{st.name:8} {g:>5}  failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
                continue
            if "error" in r:
                print(f"{st.name:8} {g:>5}  {r['error']}")
                continue
            print(f"{st.name:8} {g:>5} {r['tau']:>6.2f} {r['spec_tokens_per_s']:>11.1f} {r['target_tokens_per_s']:>13.1f} "
                  f"{r['speedup']:>8.2f}x {r['context_tokens']:>5} {str(r['lossless']):>9} {time.time() - t0:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
