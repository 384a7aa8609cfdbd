"""Sequence parallelism: peak memory per rank and step time at SP 1 and SP 2, and the preflight's
estimate for 8B and 32B targets past 32k.

    python bench/bench_sp.py --out sp.json                       # CPU: SP 1 vs 2 at 4k and 16k tokens
    python bench/bench_sp.py --out sp.json --seq 65536 --device cuda --dims qwen7b   # a GPU (gpu_check.sh)
    python bench/bench_sp.py --estimate-only --out est.json      # the table only (no torch)

Measured part: one GLIDE training step (the frozen target's forward, the draft's forward and
backward, both losses; no optimizer) on a random-weight Qwen2-shaped target, launched with
torchrun on 1 rank (SP 1, the whole sequence) and on 2 ranks (SP 2, half each, DeepSpeed's
Ulysses hook, longspec.model.seqpar); one launch per SP runs every length in turn. Peak memory
per rank, each length on its own: on CUDA torch.cuda.max_memory_allocated, on the CPU the peak
RSS (VmHWM, reset through /proc/self/clear_refs before each length) above the RSS before its
first step, both the largest over the ranks. On the CPU the ranks run with glibc's mmap threshold
at 64 KiB (MALLOC_MMAP_THRESHOLD_): a freed tensor leaves the RSS at once, so the peak RSS follows
the live tensors (with the default, adaptive threshold it read about twice as much, and the same
growth per token at SP 1 and SP 2). `per_token`: the growth of that peak per added token between
consecutive lengths, the sequence's share of a rank; SP 2 should hold half of it. Step time: the
median of --steps timed steps. On one GPU both SP 2 ranks share it (gloo, whose all-to-all copies
through host memory): the memory figure holds, the time does not. On the CPU the draft's attention
takes the reference path (chunked SDPA with a boolean mask; every chunk's scores within
attention.SCORE_BUDGET, checkpointed in training).

Estimated part: longspec.machine.memory.estimate (bf16, ZeRO-3 + optimizer offload, flash-attn,
micro batch 1) for Llama-3.1-8B and QwQ-32B at 64k and 128k tokens on 8 GPUs of 141 and 80 GiB:
the peak per GPU at SP 1, 2, 4, 8 and the smallest SP that fits 95% of the GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import hostmem  # noqa: E402

DIMS = {
    # small enough for 2 shared CPU cores at 16k tokens; heads divisible by 2
    "small": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                  num_hidden_layers=4, vocab_size=4096, max_position_embeddings=131072),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                   num_hidden_layers=28, vocab_size=152064, max_position_embeddings=131072),
}



def rank_failure(text: str, keep: int = 1500) -> str:
    """A rank's own traceback (its last line says what failed), not the launcher's that follows it."""
    lines = text.splitlines()
    own = [i for i, line in enumerate(lines) if line.startswith("Traceback") or "[rank" in line and "Traceback" in line]
    if own:
        end = next((j for j in range(own[0] + 1, len(lines)) if lines[j] and not lines[j][0].isspace()
                    and not lines[j].startswith(("Traceback", "During handling"))), len(lines) - 1)
        return "\n".join(lines[own[0]:end + 1])[-keep:]
    return text[-keep:]

def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dims", choices=sorted(DIMS), default="small")
    ap.add_argument("--layers", type=int, help="target layers (default: the dims')")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- one rank

def worker(a: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if a.device == "cuda" else "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from longspec.model import seqpar
    from longspec.model.glide import GlideDraft, GlideModel, DraftConfig

    world = int(os.environ["WORLD_SIZE"])
    shared_gpu = a.device == "cuda" and torch.cuda.device_count() < world
    deepspeed.init_distributed(dist_backend="gloo" if a.device == "cpu" or shared_gpu else "nccl")
    rank = dist.get_rank()
    if a.device == "cpu":     # DeepSpeed's CPU comm op never removes its shared-memory buffer
        from longspec.training.rank import unlink_shm_buffer

        dist.barrier()
        unlink_shm_buffer(rank)
    dev = torch.device("cpu")
    if a.device == "cuda":
        dev = torch.device("cuda", 0 if shared_gpu else int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    dims = dict(DIMS[a.dims], **({"num_hidden_layers": a.layers} if a.layers else {}))
    cfg = Qwen2Config(**dims, use_cache=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        target = Qwen2ForCausalLM(cfg).to(dtype).eval()
        draft = GlideDraft(DraftConfig.from_target_config(cfg, a.window)).to(dtype)
    model = GlideModel(target, draft)
    if world > 1:
        _, model.sp = seqpar.register_target(target, world, 1)
    results = []
    for T in a.seq:
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g).to(dev)
        times = []
        if a.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            gc.collect()
            hostmem.reset_peak()
            base = hostmem.rss()
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            out = model(input_ids=ids, labels=ids, cross_lag=1)
            out["loss"].backward()
            for p in draft.parameters():
                p.grad = None
            if a.device == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        loss = out["loss"].detach().float().clone()
        del out
        peak = (torch.cuda.max_memory_allocated() if a.device == "cuda" else hostmem.peak()) - base
        dist.all_reduce(loss)
        row = torch.tensor([peak, statistics.median(times)], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        results.append({"seq_len": T, "sp": world, "peak_bytes_per_rank": max(int(r[0]) for r in rows),
                        "step_s": max(float(r[1]) for r in rows), "loss": float(loss)})
    if rank == 0:
        Path(os.environ["BENCH_SP_OUT"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(a: argparse.Namespace, ranks: int, out: Path) -> list[dict]:
    """One torchrun of `ranks` ranks over every length: a row per length (or one error row)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(port), str(Path(__file__).resolve()), "--worker", "--out", str(out), "--dims", a.dims,
            "--device", a.device, "--steps", str(a.steps), "--warmup", str(a.warmup), "--window", str(a.window),
            "--seq", *map(str, a.seq)] + (["--layers", str(a.layers)] if a.layers else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), BENCH_SP_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    if a.device == "cpu":
        env.update(hostmem.MMAP_ENV)                # freed tensors leave the RSS: its peak follows them
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return [{"seq_len": a.seq[0], "sp": ranks, "error": f"over {a.timeout} s"}]
    if proc.returncode != 0:
        return [{"seq_len": a.seq[0], "sp": ranks, "error": f"rc {proc.returncode}: {rank_failure(proc.stderr or proc.stdout)}"}]
    return json.loads(out.read_text())


def per_token(runs: list[dict]) -> list[dict]:
    """The peak's growth per added token between consecutive lengths of one SP."""
    runs = sorted((r for r in runs if "error" not in r), key=lambda r: r["seq_len"])
    return [{"from": x["seq_len"], "to": y["seq_len"], "bytes_per_token":
             round((y["peak_bytes_per_rank"] - x["peak_bytes_per_rank"]) / (y["seq_len"] - x["seq_len"]))}
            for x, y in zip(runs, runs[1:])]


# ----------------------------------------------------------------------------- estimates

def estimates() -> list[dict]:
    from dataclasses import replace

    from longspec.project import presets
    from longspec.machine import memory as M

    rows = []
    for name in ("llama3.1-8b-instruct", "qwq-32b-preview"):
        p = presets.get_preset(name)
        size = M.ModelSize.from_mapping({**p.size, "family": p.family})
        for T in (65536, 131072):
            shape = M.StageShape(size=size, precision="bf16", zero_stage=3, offload_optimizer=True, seq_len=T,
                                 micro_batch=1, world_size=8, flash=True)
            peaks = {sp: M.estimate(replace(shape, sequence_parallel=sp)).peak for sp in (1, 2, 4, 8)}
            for gib in (141, 80):
                cap = gib * M.GiB
                fits = [sp for sp, b in peaks.items() if b <= 0.95 * cap]
                rows.append({"target": name, "seq_len": T, "gpu_gib": gib, "gpus": 8,
                             "peak_gib": {sp: round(b / M.GiB, 1) for sp, b in peaks.items()},
                             "smallest_sp_that_fits": min(fits) if fits else None})
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        worker(a)
        return 0
    report: dict = {"estimates": estimates()}
    for r in report["estimates"]:
        print(f"estimate {r['target']:<22} {r['seq_len']:>6} tokens, 8 x {r['gpu_gib']} GiB: "
              + ", ".join(f"SP{sp} {g} GiB" for sp, g in r["peak_gib"].items())
              + f" -> smallest SP that fits: {r['smallest_sp_that_fits']}")
    if not a.estimate_only:
        report.update(device=a.device, dims=a.dims, layers=a.layers, window=a.window, runs=[], ratios=[],
                      per_token={})
        by_sp = {}
        for sp in (1, 2):
            t0 = time.time()
            by_sp[sp] = launch(a, sp, a.out.with_suffix(f".sp{sp}.json"))
            report["runs"] += by_sp[sp]
            for r in by_sp[sp]:
                print(f"SP {sp}, {r['seq_len']} tokens: {r}", flush=True)
            print(f"SP {sp}: {time.time() - t0:.0f} s wall", flush=True)
        for T in a.seq:
            x, y = ({r["seq_len"]: r for r in by_sp[sp] if "error" not in r}.get(T) for sp in (1, 2))
            if x and y:
                report["ratios"].append({
                    "seq_len": T, "peak_per_rank_sp2_over_sp1": round(y["peak_bytes_per_rank"] / x["peak_bytes_per_rank"], 3),
                    "step_time_sp2_over_sp1": round(y["step_s"] / x["step_s"], 3), "loss_diff": abs(x["loss"] - y["loss"])})
                r = report["ratios"][-1]
                print(f"{T} tokens: peak per rank SP2/SP1 {r['peak_per_rank_sp2_over_sp1']}, "
                      f"step time SP2/SP1 {r['step_time_sp2_over_sp1']}, |loss diff| {r['loss_diff']:.2e}")
        report["per_token"] = {sp: per_token(by_sp[sp]) for sp in (1, 2)}
        for one, two in zip(*report["per_token"].values()):
            print(f"{one['from']} -> {one['to']} tokens: peak per rank grows {one['bytes_per_token'] / 1024:.1f} KiB "
                  f"per token at SP 1, {two['bytes_per_token'] / 1024:.1f} KiB at SP 2 "
                  f"({two['bytes_per_token'] / max(1, one['bytes_per_token']):.2f})")
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0 if a.estimate_only or len(report["ratios"]) == len(a.seq) else 1


if __name__ == "__main__":
    sys.exit(main())
