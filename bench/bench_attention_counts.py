"""What one GLIDE training step costs in host syncs, attention calls and attention shapes, per length.

    python bench/bench_attention_counts.py                       # CPU, tiny target, 256 .. 4096 tokens
    python bench/bench_attention_counts.py --seq 512 2048 --json out.json

Counted below autograd by a TorchDispatchMode over one forward + backward of the training model
(target, draft, both losses): host syncs (``aten._local_scalar_dense``: every .item(), bool(),
int() of a tensor), attention kernel calls (SDPA / FlexAttention, forward and backward) and their
distinct (query, key) shapes, and the ladder's rung per call (longspec.model.attention.CHOSEN).
Host syncs and distinct shapes must not grow with the length. On the CPU's reference path the
windowed self-attention is cut into query chunks by a memory bound (SCORE_BUDGET), so its calls
grow, all of one shape but the last; the lagged cross-attention (no window, no padding) is one
call of SDPA's causal path at any length (on CUDA both take the fused rung, without chunks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def count_step(model, seq: int, vocab: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from longspec.model import attention

    class Counts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.syncs, self.calls, self.shapes = 0, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if "_local_scalar_dense" in name:
                self.syncs += 1
            if ("scaled_dot_product" in name or "flex_attention" in name) and "backward" not in name:
                self.calls += 1
                self.shapes.add((name.split(".")[0], tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    before = attention.CHOSEN.copy()
    with Counts() as c:
        out = model(ids, ids, cross_lag=2)
        out["loss"].backward()
    model.zero_grad(set_to_none=True)
    return {"seq_len": seq, "host_syncs": c.syncs, "attention_kernel_calls": c.calls,
            "distinct_attention_shapes": len(c.shapes), "rungs": dict(attention.CHOSEN - before)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    from gpu_check import TINY, build_target
    from longspec.model.glide import build_glide

    torch.set_num_threads(1)
    model = build_glide(build_target(TINY, "cpu", torch.float32), sliding_window=a.window, dtype=torch.float32)
    rows = [count_step(model, seq, TINY["vocab_size"]) for seq in a.seq]
    print(f"{'tokens':>7} {'host syncs':>10} {'attn calls':>10} {'shapes':>6}  rungs")
    for r in rows:
        print(f"{r['seq_len']:>7} {r['host_syncs']:>10} {r['attention_kernel_calls']:>10} "
              f"{r['distinct_attention_shapes']:>6}  {r['rungs']}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
