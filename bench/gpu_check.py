"""GLIDE training step on a GPU: tokens/s, achieved TFLOP/s and peak memory next to the preflight's estimate.

    python bench/gpu_check.py --out step.json                          # CUDA: Qwen2.5-7B shape, 8k-64k
    python bench/gpu_check.py --attention torch_fused --out fused.json # one rung of the attention ladder
    python bench/gpu_check.py --dry-run --out step.json                # CPU: a tiny target (what the tests run)

The target is a random-weight stack shaped like Qwen2.5-7B (28 layers, hidden 3584, 28 heads over
4 KV heads, MLP 18944, vocab 152064; --layers to shorten it), in bf16. One step = the frozen
target's forward, the draft's forward and backward, both losses, and the optimizer step on the
draft. --optimizer deepspeed (the default) steps through a DeepSpeed engine built from the
trainer's own config (longspec/conf/config.yaml through longspec.training.dsconfig: ZeRO-1, no
offload, bf16, torch's fused AdamW, fp32 master weights and moments: what a stage holds on one GPU);
--optimizer adamw is plain torch AdamW on the bf16 draft (no master copy). Each length runs --warmup steps, then
--steps timed ones; a length whose steps pass --length-timeout seconds (or that runs out of
memory) ends the run, the lengths after it are recorded as skipped, with the reason. FLOPs are
counted here (``step_flops``: every matrix product of the target's forward with its attention, the
draft's forward and backward with both attentions, both losses' lm_head products) and divided by
the step time. The estimate is longspec.machine.memory.estimate for the same shape (world 1,
ZeRO-1, or --zero 3, without offload for the DeepSpeed step, the attention kernel actually chosen). Memory is
measured three ways: the caching allocator's peak of live tensors (max_memory_allocated), its
peak reserved (max_memory_reserved: what it holds from the driver), and the device's peak, the
reserved peak plus what the process holds outside the allocator (CUDA context, cuBLAS and NCCL;
the device's used memory less the reserved bytes, read after the steps). The estimate answers
"will it fit", so the JSON's ratio is device peak over estimate. On the CPU (--dry-run) memory is
the peak of live tensor storages over the steps (bench/hostmem.TensorPeak, counted like
max_memory_allocated), against the estimate without the CUDA runtime.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import hostmem  # noqa: E402

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                 num_hidden_layers=28, vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 max_position_embeddings=131072, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-6,
            max_position_embeddings=32768, tie_word_embeddings=False)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  num_hidden_layers=24, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, tie_word_embeddings=True)
TARGETS = {"qwen2.5-7b": QWEN25_7B, "qwen2.5-0.5b": QWEN25_05B, "tiny": TINY}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU (default target tiny: checks the script)")
    ap.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 8192 16384 32768 65536; dry run 64 128)")
    ap.add_argument("--target", choices=sorted(TARGETS), help="the target's shape (default qwen2.5-7b; "
                    "dry run tiny); on the CPU the peak of live tensors is measured against the estimate")
    ap.add_argument("--layers", type=int, help="target layers (default: the shape's)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), help="default bf16 (dry run fp32)")
    ap.add_argument("--zero", type=int, choices=(1, 3), default=1, help="the DeepSpeed engine's ZeRO stage")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per length")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kernels", choices=("auto", "fused", "reference"), default="auto")
    ap.add_argument("--attention", choices=("flash_attn", "torch_fused", "sdpa"), default="flash_attn",
                    help="the attention ladder's top rung (default: all of it)")
    ap.add_argument("--optimizer", choices=("deepspeed", "adamw"), default="deepspeed",
                    help="deepspeed: the trainer's engine (ZeRO-1, fp32 master and moments); adamw: plain "
                         "torch AdamW on the bf16 draft")
    ap.add_argument("--length-timeout", type=float, default=120.0,
                    help="seconds for one length's steps; past it the remaining lengths are skipped")
    return ap.parse_args(argv)


def step_flops(dims: dict, seq: int, window: int) -> float:
    """FLOPs of one GLIDE step (B = 1): 2 per multiply-add of every matrix product, backward = 2x
    forward; causal attention counts its visible half, windowed attention its window."""
    H, I, L, V = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"], dims["vocab_size"]
    nh, kvh = dims["num_attention_heads"], dims["num_key_value_heads"]
    hd = H // nh
    kvd = kvh * hd
    T = seq
    causal = 2 * 2 * nh * hd * T * (T + 1) / 2                     # QK^T and PV over the visible half
    windowed = 2 * 2 * nh * hd * T * min(window + 1, T)
    target = L * (2 * T * (2 * H * H + 2 * H * kvd + 3 * H * I) + causal)
    draft_fwd = 2 * T * (4 * H * H + 2 * H * kvd + 3 * H * I) + windowed + causal
    lm_head = 2 * T * H * V
    return target + 3 * draft_fwd + lm_head + 2 * lm_head       # llm loss (no grad) + draft loss fwd/bwd


def build_target(dims: dict, device, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from longspec.model import kernels

    cfg = Qwen2Config(**dims, attn_implementation=kernels.target_attn_implementation(dtype))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def estimate_bytes(dims: dict, seq: int, window: int, flash: bool, on_cuda: bool, precision: str,
                   zero_stage: int, loss_kernel: str = "chunked") -> float:
    from longspec.machine.memory import ModelSize, StageShape, estimate

    size = ModelSize.from_mapping({**dims, "model_type": "qwen2"})
    shape = StageShape(size=size, precision=precision, zero_stage=zero_stage, offload_optimizer=False,
                       seq_len=seq, micro_batch=1, world_size=1, flash=flash, sliding_window=window,
                       cuda=on_cuda, loss_kernel=loss_kernel)
    return estimate(shape).peak


def deepspeed_engine(model, device, precision: str, zero_stage: int = 1):
    """The draft in a DeepSpeed engine as a one-GPU stage builds it: the trainer's default config
    through longspec.training.dsconfig (ZeRO-1, or 3, without offload: fused torch AdamW, fp32
    master weights and moments on the GPU), torch.distributed bound to this device through
    longspec.model.comm."""
    import socket

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    import deepspeed
    import yaml

    from longspec.model import comm
    from longspec.training import dsconfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm.init(backend)
    deepspeed.init_distributed(dist_backend=backend)
    conf = yaml.safe_load((ROOT / "longspec" / "conf" / "config.yaml").read_text())
    conf.update(per_gpu_train_batch_size=1, gradient_accumulation_steps=1, global_batch_size=None,
                precision=precision, sequence_parallel_size=1,
                ds_cfg={"zero_optimization": {"stage": zero_stage}})
    ds_conf, _ = dsconfig.build_ds_config(conf, world_size=1, total_steps=1000, warmup_steps=10,
                                          on_cpu=device.type != "cuda",
                                          draft_trainable=sum(p.numel() for p in model.trainable_parameters()))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.trainable_parameters(),
                                           config=ds_conf)
    return engine, ds_conf


def run_length(model, seq: int, a: argparse.Namespace, device, engine=None) -> dict:
    import torch

    from longspec.training.positions import anchor_offset_position_ids, sample_cross_lag

    vocab = model.target.config.vocab_size
    gen = torch.Generator().manual_seed(seq)
    opt = None if engine is not None else torch.optim.AdamW(model.trainable_parameters(), lr=1e-5)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tracked = contextlib.nullcontext() if on_cuda else hostmem.TensorPeak()
    times, losses = [], []
    started = time.perf_counter()
    with tracked:      # CPU: live tensor storages over the steps (hostmem.TensorPeak)
        for i in range(a.warmup + a.steps):
            if i and time.perf_counter() - started > a.length_timeout:
                if not times:
                    raise TimeoutError(f"warmup alone took over {a.length_timeout:.0f} s")
                break
            ids = torch.randint(0, vocab, (1, seq), generator=gen)
            pos = anchor_offset_position_ids(seq, 1, anchors=4, max_offset=1000, threshold=1200, generator=gen)
            lag = sample_cross_lag(4, gen)
            if on_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if engine is not None:
                out = engine(ids.to(device), ids.to(device), pos.to(device), cross_lag=lag)
                engine.backward(out["loss"])
                engine.step()
            else:
                out = model(ids.to(device), ids.to(device), pos.to(device), cross_lag=lag)
                out["loss"].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if on_cuda:
                torch.cuda.synchronize(device)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
                losses.append(out["loss"].item())
    if not times:
        raise TimeoutError(f"no timed step within {a.length_timeout:.0f} s")
    step_s = sum(times) / len(times)
    memory = {}
    if on_cuda:
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, total - free - torch.cuda.memory_reserved(device))   # context, cuBLAS, NCCL
        memory = {"peak_bytes": torch.cuda.max_memory_allocated(device),
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                  "outside_allocator_bytes": outside,
                  "device_peak_bytes": torch.cuda.max_memory_reserved(device) + outside}
    else:
        memory = {"tensor_peak_bytes": tracked.peak}
    flops = step_flops(a.dims, seq, a.window)
    return {"seq_len": seq, "step_s": round(step_s, 4), "tokens_per_s": round(seq / step_s, 1),
            "timed_steps": len(times), "step_flops": flops, "tflops_per_s": round(flops / step_s / 1e12, 2),
            "us_per_token": round(step_s / seq * 1e6, 2),
            **memory, "loss": round(losses[-1], 4), "finite": all(map(lambda x: x == x, losses))}


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from longspec.model import attention, kernels
    from longspec.model.glide import build_glide

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.dry_run else "cuda")
    dims = dict(TARGETS[a.target or ("tiny" if a.dry_run else "qwen2.5-7b")])
    if a.layers:
        dims["num_hidden_layers"] = a.layers
    a.dims = dims
    seqs = a.seq or ([64, 128] if a.dry_run else [8192, 16384, 32768, 65536])
    precision = a.precision or ("fp32" if a.dry_run else "bf16")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    kernels.set_mode(a.kernels)
    kernels.set_top_rung(a.attention)
    chosen = kernels.backend(device, dtype)
    t0 = time.perf_counter()
    target = build_target(dims, device, dtype)
    model = build_glide(target, sliding_window=a.window, dtype=dtype).to(device)
    built_s = time.perf_counter() - t0
    flash = chosen["attention"] != "sdpa"            # a fused rung: no mask kept for backward
    counts = {"target_params": sum(p.numel() for p in model.target.parameters()),      # before ZeRO-3
              "draft_trainable_params": sum(p.numel() for p in model.trainable_parameters())}  # partitions them
    engine, ds_conf = deepspeed_engine(model, device, precision, a.zero) if a.optimizer == "deepspeed" else (None, None)
    zero = a.zero if engine is not None else 0
    results, stop = [], None
    for seq in seqs:
        est = estimate_bytes(dims, seq, a.window, flash, device.type == "cuda", precision, zero,
                             chosen["linear_cross_entropy"])
        if stop:
            r = {"seq_len": seq, "skipped": stop}
        else:
            try:
                r = run_length(model, seq, a, device, engine)
            except torch.OutOfMemoryError as e:            # a figure too: the estimate said it fits?
                r = {"seq_len": seq, "error": f"out of memory: {str(e).splitlines()[0]}"}
                stop = f"{seq} tokens ran out of memory"
                torch.cuda.empty_cache()
            except TimeoutError as e:
                r = {"seq_len": seq, "error": f"timeout: {e}"}
                stop = f"{seq} tokens passed --length-timeout"
        r["estimate_bytes"] = int(est)
        if r.get("device_peak_bytes"):
            r["measured_over_estimate"] = round(r["device_peak_bytes"] / est, 3)
            r["allocated_over_estimate"] = round(r["peak_bytes"] / est, 3)
        elif r.get("tensor_peak_bytes"):
            r["measured_over_estimate"] = round(r["tensor_peak_bytes"] / est, 3)
        results.append(r)
        print(json.dumps(r), flush=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": a.dry_run, "torch": torch.__version__, "kernels_mode": a.kernels, "kernels": chosen,
        "attention_top_rung": a.attention, "optimizer": a.optimizer,
        "optimizer_class": type(engine.optimizer).__name__ if engine is not None else "torch.optim.AdamW",
        "zero_optimization": (ds_conf or {}).get("zero_optimization"),
        "engine_reduce_bucket_size": getattr(getattr(engine, "optimizer", None), "reduce_bucket_size", None), "target_attention": model.target.config._attn_implementation,
        "attention_calls": dict(attention.CHOSEN),
        "target_shape": dims, **counts,
        "dtype": str(dtype).replace("torch.", ""), "sliding_window": a.window, "build_s": round(built_s, 2),
        "steps": a.steps, "warmup": a.warmup, "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all("error" not in r and "skipped" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
