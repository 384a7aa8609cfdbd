"""What the GLIDE draft keeps for backward, per token, against the memory estimate's term for it.

    .venv/bin/python bench/bench_saved_activations.py [--seq 512 1024] [--dims qwen7b|small]

One forward of the draft (and its loss) under ``torch.autograd.graph.saved_tensors_hooks`` on a
random-weight Qwen2-shaped target with one layer (the draft's shapes follow the target's width,
not its depth), bf16, on the CPU: every tensor autograd saves is counted once by its storage,
parameters left out. Printed per token, by shape, beside longspec.machine.memory's
"draft activations" term, (20 H + 4 kv_dim + 4 I) x bytes per token. On the CPU the attention is
the reference path (one SDPA call per attention at these lengths, its boolean mask included).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIMS = {
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                   vocab_size=152064),
    "small": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=4096),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[512])
    ap.add_argument("--dims", choices=sorted(DIMS), default="qwen7b")
    a = ap.parse_args(argv)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from longspec.model.glide import build_glide

    d = DIMS[a.dims]
    cfg = Qwen2Config(**d, num_hidden_layers=1, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        target = Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model = build_glide(target, sliding_window=512, dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    H, I = d["hidden_size"], d["intermediate_size"]
    kvd = d["num_key_value_heads"] * H // d["num_attention_heads"]
    formula = (20 * H + 4 * kvd + 4 * I) * 2
    for T in a.seq:
        seen: dict[int, int] = {}
        by: collections.Counter = collections.Counter()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen[ptr] = t.untyped_storage().nbytes()
                by[f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"] += seen[ptr]
            return t

        ids = torch.randint(0, d["vocab_size"], (1, T))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, ids, torch.arange(T)[None], cross_lag=2)
        per_token = sum(seen.values()) / T
        print(f"{a.dims}, {T} tokens: saved for backward {per_token / 1e3:.1f} KB per token; the estimate's "
              f"draft activations {formula / 1e3:.1f} KB ({per_token / formula:.2f}x)")
        for what, b in by.most_common(12):
            print(f"    {what:<32} {b / T / 1e3:8.1f} KB/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
