"""Peak memory and time of kernels.linear_cross_entropy vs naive logits + F.cross_entropy.

    .venv/bin/python bench/bench_linear_ce.py                 # 8192 tokens, H 512, V 32000, fp32
    .venv/bin/python bench/bench_linear_ce.py --chunks 256 512 1024 2048 --repeats 5

Each variant runs forward + backward in its own fresh process, so peak memory is that process's
own: on CPU the peak resident set (ru_maxrss) minus the resident set once the inputs exist; on
CUDA torch.cuda.max_memory_allocated minus the inputs. Time is the median of --repeats runs after
one warm-up, as wall time and as process CPU time (steadier on a shared machine).
Goal: >= 5x less memory than naive at <= 1.1x its time.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_one(variant: str, chunk: int, tokens: int, hidden: int, vocab: int, repeats: int,
            weight_grad: bool, device: str) -> dict:
    """Runs inside the child process."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    from longspec.model import kernels

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_(weight_grad)
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[: tokens // 10] = -100

    def step():
        if variant == "naive":
            loss = F.cross_entropy(h @ w.T, y, ignore_index=-100)
        else:
            loss = kernels.linear_cross_entropy(h, w, y, chunk_size=chunk, impl="chunked")
        loss.backward()
        h.grad = None
        w.grad = None
        return loss

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    step()                                                      # warm-up
    times, cpu_times = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": variant, "chunk": chunk, "peak_mb": peak / 2**20, "time_s": statistics.median(times),
            "cpu_s": statistics.median(cpu_times)}


def spawn(args, variant: str, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--chunk", str(chunk), "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--repeats", str(args.repeats),
           "--device", args.device] + (["--weight-grad"] if args.weight_grad else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunks", type=int, nargs="+", default=[None])
    p.add_argument("--weight-grad", action="store_true", help="also compute the (normally frozen) weight's gradient")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.chunk, args.tokens, args.hidden, args.vocab, args.repeats,
                                 args.weight_grad, args.device)))
        return

    sys.path.insert(0, str(ROOT))
    from longspec.model.kernels import DEFAULT_CE_CHUNK

    chunks = [c or DEFAULT_CE_CHUNK for c in args.chunks]
    print(f"linear_cross_entropy fwd+bwd: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}, fp32, "
          f"{args.device}, weight grad {'on' if args.weight_grad else 'off'}, median of {args.repeats}")
    naive = spawn(args, "naive", 0)
    print(f"{'variant':<16}{'peak MB':>10}{'wall s':>10}{'cpu s':>10}{'mem x':>8}{'wall x':>8}{'cpu x':>8}")
    print(f"{'naive':<16}{naive['peak_mb']:>10.1f}{naive['time_s']:>10.3f}{naive['cpu_s']:>10.3f}"
          f"{1:>8.1f}{1:>8.2f}{1:>8.2f}")
    for chunk in chunks:
        r = spawn(args, "chunked", chunk)
        print(f"{'chunked ' + str(chunk):<16}{r['peak_mb']:>10.1f}{r['time_s']:>10.3f}{r['cpu_s']:>10.3f}"
              f"{naive['peak_mb'] / max(r['peak_mb'], 1e-9):>8.1f}{r['time_s'] / naive['time_s']:>8.2f}"
              f"{r['cpu_s'] / max(naive['cpu_s'], 1e-9):>8.2f}")


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
