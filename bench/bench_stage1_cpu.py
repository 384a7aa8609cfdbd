"""Tiny stage-1 training speed on CPU: steps/s and tokens/s of `deepspeed --module longspec.train`.

    .venv/bin/python bench/bench_stage1_cpu.py [--steps 20] [--batch 8] [--seq 128] [--ranks 1]
        [--zero 1] [--precision fp32|bf16] [--no-offload] [--keep DIR]

Builds the tiny preset (cached after the first time), writes a one-stage project into a temp
folder, launches DeepSpeed with DS_ACCELERATOR=cpu and reads the run's metrics.jsonl. Steady-state
figures leave out the first step (graph warm-up); start-up is launch -> first step record.
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGE = """\
# @package _global_
defaults:
  - /deepspeed@ds_cfg: bench
  - _self_
stage: base
model_name_or_path: {target}
train_file: {data}
output_dir: {out}
precision: {precision}
data: {{collator: short_text, max_seq_length: {seq}}}
learning_rate: 3.0e-3
per_gpu_train_batch_size: {batch}
gradient_accumulation_steps: 1
max_steps: {steps}
save_steps: {steps}
save_total_limit: 1
"""
DEEPSPEED = """\
train_micro_batch_size_per_gpu: ${{per_gpu_train_batch_size}}
gradient_accumulation_steps: ${{gradient_accumulation_steps}}
gradient_clipping: ${{max_grad_norm}}
optimizer:
  type: AdamW
  params:
    lr: ${{learning_rate}}
    betas: ${{adam_betas}}
scheduler:
  type: WarmupCosineLR
  params:
    warmup_type: linear
zero_optimization:
  stage: {zero}
{offload}"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--no-offload", action="store_true", help="no optimizer offload (torch AdamW)")
    ap.add_argument("--keep", help="write the project here and keep it (default: a temp folder)")
    args = ap.parse_args()

    from longspec.tiny import build_tiny
    from longspec.runs.runfolder import read_metrics

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-stage1-"))
    try:
        tiny = build_tiny(root / "tiny", force=True)
        conf = root / "conf"
        (conf / "exp").mkdir(parents=True, exist_ok=True)
        (conf / "deepspeed").mkdir(exist_ok=True)
        out = root / "runs" / "base"
        shutil.rmtree(out, ignore_errors=True)
        offload = "" if args.no_offload else "  offload_optimizer: {device: cpu}\n"
        (conf / "deepspeed" / "bench.yaml").write_text(DEEPSPEED.format(zero=args.zero, offload=offload))
        (conf / "exp" / "base.yaml").write_text(STAGE.format(
            target=tiny["target"], data=tiny["data"]["base"], out=out, precision=args.precision,
            seq=args.seq, batch=args.batch, steps=args.steps))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(port),
                "--num_gpus", str(args.ranks), "--module", "longspec.train",
                "--config-dir", str(conf), "+exp=base"]
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
        t0 = time.time()
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
            print(f"error: the training run failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        steps = read_metrics(out / "metrics.jsonl").steps
        steady = steps[1:]
        span = steady[-1]["time"] - steps[0]["time"]
        steps_per_s = len(steady) / span
        # each record's rate covers the time since the previous record: weight it by that time
        windows = [(b["time"] - a["time"], b["tokens_per_s"]) for a, b in zip(steps, steps[1:])]
        tokens_per_s = sum(dt * tps for dt, tps in windows) / sum(dt for dt, _ in windows)
        startup = steps[0]["time"] - t0
        cpus = os.cpu_count()
        load = os.getloadavg()[0]
        rows = [("steps", args.steps), ("ranks x batch x seq", f"{args.ranks} x {args.batch} x {args.seq}"),
                ("ZeRO / precision / offload", f"{args.zero} / {args.precision} / {not args.no_offload}"),
                ("steps/s (steady)", f"{steps_per_s:.3f}"), ("tokens/s (steady, all ranks)", f"{tokens_per_s:,.0f}"),
                ("start-up to first step (s)", f"{startup:.1f}"), ("wall (s)", f"{wall:.1f}"),
                ("first / last loss", f"{steps[0]['loss']:.3f} / {steps[-1]['loss']:.3f}"),
                ("CPUs / load average", f"{cpus} / {load:.1f}")]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        print(json.dumps({"steps_per_s": round(steps_per_s, 4), "tokens_per_s": round(tokens_per_s, 1),
                          "startup_s": round(startup, 2), "wall_s": round(wall, 2), "steps": args.steps,
                          "ranks": args.ranks, "batch": args.batch, "seq": args.seq, "zero": args.zero,
                          "precision": args.precision, "offload": not args.no_offload,
                          "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
                          "cpus": cpus, "loadavg": round(load, 2)}))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
