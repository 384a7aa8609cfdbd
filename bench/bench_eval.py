"""Chain against tree speculative decoding per stage of a longspec project, e.g. the tiny preset demo.

    python bench/bench_eval.py DIR [--gamma 4] [--tree-shape 4 16 16 16 16] [--num-prompts 8]
                                   [--max-new-tokens 64] [--temperature 0]
    python bench/bench_eval.py DIR --init --train     # make a tiny project, train it, then measure

For every finished stage it runs `python -m longspec.evaluate RUN --method chain --method tree
--no-write` once (the same code `longspec eval` uses; both methods decode the same prompts and
eval.json is left alone) and prints, per stage: chain tau, tree tau, their ratio, the tokens/s of
plain, chain and tree decoding, and the tree/chain tokens/s ratio. tau (tokens per target
forward) is the figure that transfers to real targets; on a CPU the tiny target costs about as
much per forward as one draft step, so the tokens/s here say little about a GPU (and the
machine may be shared: read the ratios, not the absolute figures).
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
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--tree-shape", type=int, nargs="+", default=[4, 16, 16, 16, 16])
    ap.add_argument("--temperature", type=float, default=0.0)
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
    shape = "-".join(map(str, args.tree_shape))
    print(f"chain gamma {args.gamma} vs tree {shape}, temperature {args.temperature:g}, "
          f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens")
    print(f"{'stage':8} {'ctx':>5} {'chain tau':>9} {'tree tau':>9} {'tau ratio':>9} {'plain tok/s':>11} "
          f"{'chain tok/s':>11} {'tree tok/s':>10} {'tree/chain tok/s':>16} {'lossless':>8} {'wall s':>6}")
    for st in stages:
        t0 = time.time()
        p = sh([sys.executable, "-m", "longspec.evaluate", st.output_dir, "--stage", st.name,
                "--method", "chain", "--method", "tree", "--gamma", str(args.gamma),
                "--tree-shape", *map(str, args.tree_shape), "--temperature", str(args.temperature),
                "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                "--no-write", "--json"])
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(f"{st.name:8} failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
            continue
        if "error" in r:
            print(f"{st.name:8} {r['error']}")
            continue
        c, t = r["methods"]["chain"], r["methods"]["tree"]
        print(f"{st.name:8} {r['context_tokens']:>5} {c['tau']:>9.2f} {t['tau']:>9.2f} {t['tau'] / c['tau']:>8.2f}x "
              f"{c['target_tokens_per_s']:>11.1f} {c['spec_tokens_per_s']:>11.1f} {t['spec_tokens_per_s']:>10.1f} "
              f"{t['spec_tokens_per_s'] / max(c['spec_tokens_per_s'], 1e-9):>15.2f}x {str(r['lossless']):>8} "
              f"{time.time() - t0:>6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
