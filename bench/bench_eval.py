"""Chain against tree speculative decoding per stage of a longspec project, by context length,
next to each stage's input draft (the tiny preset demo, or any project).

    python bench/bench_eval.py DIR [--gamma 4] [--tree-shape 4 16 16 16 16] [--num-prompts N]
                                   [--max-new-tokens N] [--lengths 256,512] [--temperature 0]
    python bench/bench_eval.py DIR --init --train     # make a tiny project, train it, then measure

For every finished stage it runs `python -m longspec.evaluate RUN --method chain --method tree
--baseline-draft <the draft_from stage's final draft> --no-write` once (the code `longspec eval`
uses, its default prompts: questions of held-out chats, prefixes of held-out documents; result
files are left alone) and prints, per stage: chain tau, tree tau, their ratio, the tokens/s of
plain, chain and tree decoding; then per stage and length bucket: prompts, chain and tree tau,
the input draft's chain tau on the same prompts and the stage/input-draft ratio; and last, for
every stage with an input draft, whether its chain tau at its longest bucket is above the input
draft's (what LongSpec's long stages are for). tau (tokens per target forward) is the figure
that transfers to real targets; on a CPU the tiny target costs about as much per forward as one
draft step, so the tokens/s here say little about a GPU (and the machine may be shared: read the
ratios, not the absolute figures).
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
    ap.add_argument("--num-prompts", type=int, default=None, help="per length bucket (default: the evaluator's)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the evaluator's, per prompt kind")
    ap.add_argument("--lengths", default=None, help="length buckets, e.g. 256,512 (default: the evaluator's)")
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

    from longspec.project.manifest import load_manifest
    from longspec.runs.quality import baseline_draft, length_label
    from longspec.runs.status import project_status

    manifest = load_manifest(args.project)
    stages = [s for s in project_status(manifest) if s.state in ("done", "stale")]
    if not stages:
        print("no finished stage to measure")
        return 1
    shape = "-".join(map(str, args.tree_shape))
    print(f"chain gamma {args.gamma} vs tree {shape}, temperature {args.temperature:g}, prompts per bucket "
          f"{args.num_prompts or 'default'}, new tokens {args.max_new_tokens or 'default'}")
    print(f"{'stage':8} {'prompts':>7} {'ctx':>5} {'chain tau':>9} {'tree tau':>9} {'tau ratio':>9} {'plain tok/s':>11} "
          f"{'chain tok/s':>11} {'tree tok/s':>10} {'lossless':>8} {'wall s':>6}")
    results = []
    for st in stages:
        t0 = time.time()
        cmd = [sys.executable, "-m", "longspec.evaluate", st.output_dir, "--stage", st.name,
               "--method", "chain", "--method", "tree", "--gamma", str(args.gamma),
               "--tree-shape", *map(str, args.tree_shape), "--temperature", str(args.temperature),
               "--no-write", "--json"]
        for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                            ("--lengths", args.lengths)):
            if value is not None:
                cmd += [flag, str(value)]
        up, up_name = baseline_draft(manifest.previous(st.name))
        if up is not None:
            cmd += ["--baseline-draft", str(up), "--baseline-stage", up_name]
        p = sh(cmd)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(f"{st.name:8} failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
            continue
        if "error" in r:
            print(f"{st.name:8} {r['error']}")
            continue
        c, t = r["methods"]["chain"], r["methods"]["tree"]
        print(f"{st.name:8} {r['prompts']:>7} {r['context_tokens']:>5} {c['tau']:>9.2f} {t['tau']:>9.2f} "
              f"{t['tau'] / c['tau']:>8.2f}x {c['target_tokens_per_s']:>11.1f} {c['spec_tokens_per_s']:>11.1f} "
              f"{t['spec_tokens_per_s']:>10.1f} {str(r['lossless']):>8} {time.time() - t0:>6.0f}")
        results.append(r)
    print(f"\ntau by context length (prompt tokens); input draft = the draft_from stage's final draft, chain")
    print(f"{'stage':8} {'length':>6} {'prompts':>7} {'chain tau':>9} {'tree tau':>9} {'input draft':>11} "
          f"{'stage/input':>11}")
    verdicts = []
    for r in results:
        rows = r.get("by_length") or []
        for b in rows:
            base = b.get("baseline", {}).get("tau")
            shown = "-" if base is None else f"{base:.2f}"
            ratio = "-" if not base else f"{b['chain']['tau'] / base:.2f}x"
            print(f"{r['stage']:8} {length_label(b['length']):>6} {b['prompts']:>7} {b['chain']['tau']:>9.2f} "
                  f"{b['tree']['tau']:>9.2f} {shown:>11} {ratio:>11}")
        if rows and "baseline" in rows[-1]:
            last = rows[-1]
            verdicts.append(f"{r['stage']} at {length_label(last['length'])}: chain tau {last['chain']['tau']:.2f} vs "
                            f"input draft ({r['baseline'].get('stage')}) {last['baseline']['tau']:.2f}: "
                            + ("above" if last["chain"]["tau"] > last["baseline"]["tau"] else "NOT above"))
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
