"""Tau while training against `eval`'s chain tau on the demo, checkpoint ranking, and the cost.

    .venv/bin/python bench/bench_simtau.py [--dir DIR] [--reuse] [--gpus 8 --params 32.8e9 ...]

1. Agreement. Runs the demo (`longspec demo DIR -q`: every stage records its tau at step 0,
   every eval_steps and at the end, and `eval` measures each final draft with the input draft on
   the same prompts into eval.json); --reuse takes a finished DIR as it is. Per stage: the tau at
   the last step against eval.json's chain tau (ratio; goal within 2 %), by length bucket. Then
   every draft of the stage that has a tau record: the input draft (eval.json's `baseline`, step 0;
   stage 1 starts fresh and keeps none), the kept checkpoints, best/ and the final draft, each
   measured by `python -m longspec.evaluate RUN --draft PATH` on the stage's default prompts
   (checked: the same records as eval.json's), and whether both figures rank them alike.
2. Cost: per stage, the seconds in tau evaluations and in making the continuations (metrics.jsonl
   `eval_s`, `continuations_s`) over the trainer's wall time (the `end` event).
3. An estimate for a 32k stage of a 32B target on 8 GPUs under ZeRO-3 (flags set the assumptions):
   eval's default prompts at 32k (6 buckets x 8 prompts, each cut at its bucket length, 1,024 new
   tokens), the continuations once (decoding is bound by ZeRO-3 gathering the target's weights
   each forward: one forward decodes a batch of up to 16 prompts of one length), then each
   evaluation (a teacher-forced target forward over prompt + continuation, compute-bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STAGES = ("base", "long", "longcot")


def demo(d: Path) -> None:
    if d.exists():
        shutil.rmtree(d)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "longspec_cli", "demo", str(d), "-q"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"demo failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def records(run: Path) -> dict[int, dict]:
    from longspec.runs import runfolder

    return {r["step"]: r for r in runfolder.read_metrics(run / runfolder.METRICS).simtau}


def eval_draft(run: Path, draft: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "longspec.evaluate", str(run), "--draft", str(draft),
                           "--no-write", "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        sys.exit(f"eval failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drafts(run: Path) -> dict[int, Path]:
    """step -> draft file of the stage: kept checkpoints, best/, the final draft."""
    from longspec.runs import runfolder

    out = {}
    for c in sorted(run.glob("checkpoint-*")):
        if (c / "checkpoint.json").is_file():
            out[int(c.name.split("-")[1])] = c / "draft_model_weights.pth"
    best = runfolder.RunDir(run).best()
    if best:
        out.setdefault(int(best["step"]), Path(best["weights"]))
    out[json.loads((run / "stage_complete.json").read_text())["steps"]] = run / "draft_model_weights.pth"
    return out


def prompt_keys(ev: dict) -> list:
    return [(p["record"], p["prompt_tokens"]) for p in ev["per_prompt"]]


def agreement(d: Path) -> None:
    print("agreement: tau at each stage's last step vs eval's default chain tau of the final draft (eval.json)")
    for stage in STAGES:
        run = d / "runs" / stage
        ev = json.loads((run / "eval.json").read_text())
        rec = records(run)
        last = rec[max(rec)]
        by_t = {b["length"]: b["tau"] for b in last["by_length"]}
        print(f"  {stage:8} in training {last['tau']:.4f}  eval {ev['tau']:.4f}  ratio {last['tau'] / ev['tau']:.4f}  "
              f"by length: " + ", ".join(f"{b['length']}: {by_t.get(b['length'], float('nan')):.3f} vs "
                                         f"{b['chain']['tau']:.3f}" for b in ev["by_length"])
              + f"  (eval: {ev.get('continuations')})")
    print("ranking: every draft with a tau record, in-training tau vs eval's chain tau on the same prompts")
    print(f"  {'stage':8} {'step':>5} {'in training':>11} {'eval':>7} {'ratio':>6}")
    alike = 0
    for stage in STAGES:
        run = d / "runs" / stage
        ev0 = json.loads((run / "eval.json").read_text())
        rec, rows = records(run), []
        if "baseline" in ev0 and 0 in rec:
            rows.append((0, rec[0]["tau"], ev0["baseline"]["tau"]))
        for step, path in sorted(drafts(run).items()):
            if step not in rec:
                continue
            ev = eval_draft(run, path)
            if prompt_keys(ev) != prompt_keys(ev0):
                sys.exit(f"{stage} step {step}: eval chose other prompts than eval.json's")
            rows.append((step, rec[step]["tau"], ev["tau"]))
        for step, sim, tau in rows:
            print(f"  {stage:8} {step:>5} {sim:>11.4f} {tau:>7.4f} {sim / tau:>6.4f}")
        by_sim = [r[0] for r in sorted(rows, key=lambda r: (r[1], r[0]))]
        by_eval = [r[0] for r in sorted(rows, key=lambda r: (r[2], r[0]))]
        alike += by_sim == by_eval
        print(f"  {stage}: drafts by in-training tau {by_sim}, by eval {by_eval}: "
              + ("same order" if by_sim == by_eval else "DIFFERENT order"))
    print(f"  ranked alike in {alike} of {len(STAGES)} stages")


def stage_cost(run: Path) -> dict:
    """What tau while training cost one finished run: its evaluations' and continuations' seconds
    (metrics.jsonl) over the stage's wall time (run.json's start to end) and the trainer's loop (the
    `end` event's elapsed_s)."""
    from longspec.runs import runfolder

    log = runfolder.read_metrics(run / runfolder.METRICS)
    info = json.loads((run / "run.json").read_text())
    wall = float(info["ended_unix"]) - float(info["started_unix"])
    loop, spent = log.loop_seconds, log.tau_seconds
    co = log.continuations_seconds
    return {"evaluations": len(log.simtau), "steps": [r["step"] for r in log.simtau], "eval_s": spent - co,
            "continuations_s": co, "wall_s": wall, "loop_s": loop, "share_of_stage": spent / wall,
            "share_of_loop": spent / loop, "taus": [round(float(r["tau"]), 4) for r in log.simtau], "log": log}


def cost(d: Path) -> None:
    print("cost (metrics.jsonl: evaluations + continuations; over the stage's wall time, run.json's start to end, "
          "and over the trainer's, the `end` event's elapsed_s):")
    for stage in STAGES:
        c = stage_cost(d / "runs" / stage)
        print(f"  {stage:8} {c['evaluations']} evaluations {c['eval_s']:5.2f} s + continuations "
              f"{c['continuations_s']:5.2f} s: {c['share_of_stage']:.1%} of the stage's {c['wall_s']:5.1f} s, "
              f"{c['share_of_loop']:.1%} of the trainer's {c['loop_s']:5.1f} s")


def estimate(a) -> None:
    from longspec.measure.report import default_lengths
    from longspec.measure.prompts import default_num_prompts

    lengths = default_lengths(a.seq)
    per = {n: default_num_prompts(n, len(lengths)) for n in lengths}
    prompts = sum(per.values())
    new = min(1024, a.seq // 8) + a.gamma
    prompt_tokens = sum(n * k for n, k in per.items())
    flops = 2 * a.params                                          # per token, forward
    gather_s = 2 * a.params / (a.gather_gbs * 1e9)                # bf16 weights gathered once per forward
    compute = a.gpus * a.tflops * 1e12
    # continuations: each rank decodes its share (round-robin) in left-padded batches (chainwalk.decode_batches)
    from types import SimpleNamespace

    from longspec.measure.chainwalk import GEN_BATCH, GEN_TOKENS, decode_batches

    fake = [SimpleNamespace(ids=range(n)) for n, k in per.items() for _ in range(k)]
    plans = [decode_batches(list(range(r, prompts, a.gpus)), fake, new, GEN_BATCH, GEN_TOKENS) for r in range(a.gpus)]
    batches = max(len(p) for p in plans)
    padded = max(sum(len(b) * len(fake[b[0]].ids) for b in p) for p in plans) * a.gpus   # prefill positions
    cont_s = batches * new * gather_s + (padded + prompts * new) * flops / compute
    # a whole copy of the target (longspec.model.zero.whole_copy) when it fits: gathered once, then each decode
    # forward reads the weights from the GPU's own memory
    from longspec.model.zero import WHOLE_SHARE

    free = a.gpu_mem * 2**30 - 2 * a.params / a.gpus - 8 * 2**30       # its shard, the draft's states, a reserve
    whole = 2 * a.params <= WHOLE_SHARE * free
    cont_whole_s = gather_s + batches * new * 2 * a.params / (a.hbm_gbs * 1e9) + (padded + prompts * new) * flops / compute
    if whole:
        cont_per_layer_s, cont_s = cont_s, cont_whole_s
    # one evaluation: teacher-forced forward over prompt + continuation, micro-batches of one row
    ev_tokens = prompt_tokens + prompts * new
    ev_s = ev_tokens * flops / compute + math.ceil(prompts / a.gpus) * gather_s
    # a training step: the frozen target's forward over the global batch (the draft is small)
    step_s = a.gpus * a.seq * flops / compute + gather_s
    evals = a.steps // a.eval_steps + 2
    from longspec.measure.chainwalk import FROZEN_BYTES

    kept = (prompt_tokens + prompts * new) / a.gpus * (2 * a.kv + a.hidden) * 2        # bf16 K/V + embeddings
    later_s = ev_s
    if kept <= FROZEN_BYTES:     # later evaluations: the draft's gamma lags (about one target layer each) alone
        later_s = ev_tokens * a.gamma * flops / a.layers / compute + math.ceil(prompts / a.gpus) * gather_s / a.layers
    ev_all = ev_s + (evals - 1) * later_s
    total = a.steps * step_s
    print(f"estimate, a {a.seq // 1024}k stage of a {a.params / 1e9:.1f}B target on {a.gpus} GPUs (ZeRO-3, "
          f"{a.tflops:.0f} TFLOP/s each, weights gathered at {a.gather_gbs:.0f} GB/s): {prompts} prompts "
          f"({', '.join(f'{n // 1024}k: {k}' for n, k in per.items())}), {new} tokens each")
    if whole:
        print(f"  continuations once: {cont_s / 60:.1f} min on a whole copy of the target ({2 * a.params / 2**30:.0f} GiB "
              f"fits in {WHOLE_SHARE:.0%} of {free / 2**30:.0f} GiB free of {a.gpu_mem:.0f} GiB; gathered once, then "
              f"{batches} decode batches per rank x {new} forwards reading it at {a.hbm_gbs:.0f} GB/s); "
              f"gathered layer by layer it would take {cont_per_layer_s / 60:.1f} min")
    else:
        print(f"  continuations once: {cont_s / 60:.1f} min ({batches} decode batches per rank x {new} forwards x "
              f"{gather_s:.2f} s gathering: a whole copy, {2 * a.params / 2**30:.0f} GiB, needs more than "
              f"{WHOLE_SHARE:.0%} of the {free / 2**30:.0f} GiB free of {a.gpu_mem:.0f} GiB)")
    print(f"  first evaluation: {ev_s:.1f} s ({ev_tokens / 1e3:.0f}k tokens forward)")
    print(f"  the target's outputs of a rank's share: {kept / 2**30:.2f} GiB (kept between evaluations up to "
          f"{FROZEN_BYTES / 2**30:.1f} GiB): later evaluations {later_s:.1f} s each")
    print(f"  a training step ~{step_s:.1f} s; {a.steps} steps with eval_steps={a.eval_steps}: {evals} evaluations "
          f"{ev_all / 60:.1f} min + continuations {cont_s / 60:.1f} min of ~{total / 3600:.1f} h: "
          f"{(ev_all + cont_s) / total:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--reuse", action="store_true", help="measure a finished demo folder (--dir) as it is")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--params", type=float, default=32.8e9)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tflops", type=float, default=400.0, help="achieved bf16 TFLOP/s per GPU")
    ap.add_argument("--gather-gbs", type=float, default=150.0, help="ZeRO-3 all-gather bandwidth per rank, GB/s")
    ap.add_argument("--gpu-mem", type=float, default=141.0, help="GiB per GPU (H200: 141, H100: 80)")
    ap.add_argument("--hbm-gbs", type=float, default=4800.0, help="GPU memory bandwidth, GB/s (H200: 4800)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-steps", type=int, default=100)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=5120, help="the target's hidden size")
    ap.add_argument("--kv", type=int, default=1024, help="the target's key/value heads x head size")
    ap.add_argument("--layers", type=int, default=64, help="the target's layers (the draft is about one)")
    a = ap.parse_args()
    d = a.dir or Path(tempfile.mkdtemp(prefix="ls-simtau-")) / "demo"
    if not a.reuse:
        demo(d)
    agreement(d)
    cost(d)
    estimate(a)


if __name__ == "__main__":
    main()
