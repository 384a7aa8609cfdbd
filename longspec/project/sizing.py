"""Stages sized to the target and the machine: what `longspec init` writes and why.

The recipe (templates/stages.yaml, the presets) is LongSpec's own: a 32B target on 8 GPUs of 80 GB,
a whole epoch per stage. `size_stages` keeps it where the machine fits it and otherwise writes
stages that finish:

  recipe   `--full-size`; a target too large to train on this machine's CPU (the recipe is then
           for the GPUs it will run on: a login node); GPUs the memory estimate
           (longspec.machine.memory) says the recipe fits; declared GPUs (`--gpus`) on a machine
           without any, whose memory nothing here can know.
  gpu      GPUs the recipe does not fit: the per-GPU batch, then the long stages' length, halved
           until the estimate fits; accumulation keeps the recipe's global batch.
  cpu      no GPU and a target a CPU can train: short lengths, small batches, the steps one stage
           takes in about CPU_STAGE_S on this CPU's measured matrix-multiply rate, learning rates
           for a short run, evaluation every fifth of it.

Each choice comes with the lines `init` prints: what was chosen, why, and a rough cost (steps,
tokens, time where a rate was measured). Pure apart from `machine()` (nvidia-smi, the CPU count,
RAM, one timed numpy product) and torch-free.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from longspec.machine.memory import GiB, ModelSize, StageShape, estimate

MIB_BYTES = 1024 ** 2

CPU_STAGE_S = 3600          # a CPU-sized stage's time budget (seconds)
CPU_MAX_PARAMS = 2.0e9      # a larger target is not trained on a CPU: its recipe is written for GPUs
CPU_EFFICIENCY = 1.0        # a training step's FLOP rate over the timed numpy products' (torch's larger products
                            # run faster: a 135M Llama's base step reached 1.24x, its 2,048-token step 1.47x on
                            # an idle 2-core machine; busy, both fall alike), rounded down
GPU_EFFICIENCY = 0.5        # share of a GPU's listed dense bf16 rate a step reaches (rough: the GLIDE step of a
                            # 7B-shaped target reached 548 of the H200's 989 TFLOP/s at 32k on one GPU,
                            # bench/gpu_check.py; ZeRO-3 on several GPUs gathers the target's weights too)
MARGIN = 0.90               # share of a GPU's memory the estimate may fill
MIN_SEQ = 2048              # the long stages are not shortened below this on GPUs
# Per stage on a CPU: (max_seq_length, per-device batch, accumulation, learning rate).
CPU_SHAPES = {"base": (512, 2, 1, 5.0e-4), "long": (2048, 1, 1, 1.0e-4), "longcot": (2048, 1, 1, 1.0e-4)}
CPU_STEPS = (50, 2000)      # a CPU-sized stage's step count stays within these
SIZED_KEYS = ("max_seq_length", "per_gpu_train_batch_size", "gradient_accumulation_steps", "learning_rate",
              "max_steps", "save_steps", "eval_steps", "eval_tokens")


@dataclass(frozen=True)
class Machine:
    gpus: int                       # detected (or declared) GPUs per node
    gpu_mib: int | None             # the smallest one's memory; None: not known here
    cpus: int
    ram_gib: float | None
    gflops: float | None = None     # measured float32 matmul rate of this CPU, None: not measured
    declared: bool = False          # the GPUs come from --gpus, not from this machine
    measure: bool = True            # time a matmul for gflops when a CPU sizing needs it
    gpu_name: str | None = None     # nvidia-smi's name of the smallest GPU (what a GPU step is priced by)

    def text(self) -> str:
        if self.gpus and self.gpu_mib:
            return f"{self.gpus} GPU(s) of {self.gpu_mib / 1024:.0f} GiB"
        if self.gpus:
            return f"{self.gpus} GPU(s) (declared; none here to read their memory)"
        ram = f", {self.ram_gib:.0f} GiB RAM" if self.ram_gib else ""
        rate = f", {self.gflops:.0f} GFLOP/s measured (float32 matmul)" if self.gflops else ""
        return f"no GPU: {self.cpus} CPU cores{ram}{rate}"


@dataclass
class Sizing:
    mode: str                                    # recipe | gpu | cpu
    gpus: int                                    # GPUs per node the stage files are written for
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # per stage: the keys that change
    notes: list[str] = field(default_factory=list)


def machine(env: dict[str, str] | None = None, declared_gpus: int | None = None) -> Machine:
    """This machine: its GPUs (nvidia-smi), CPU cores and RAM (its matmul rate is timed later,
    only when a CPU sizing needs it)."""
    from longspec.machine.gpus import detect_gpus

    found = detect_gpus(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        ram = None
    small = min(found, key=lambda g: g.memory_mib) if found else None
    if small is not None:
        return Machine(declared_gpus or len(found), small.memory_mib, cpus, ram, gpu_name=small.name)
    if declared_gpus:
        return Machine(declared_gpus, None, cpus, ram, declared=True)
    return Machine(0, None, cpus, ram)


def matmul_gflops(n: int = 512, seconds: float = 0.3) -> float | None:
    """This CPU's float32 matrix-multiply rate (GFLOP/s): the products done within about `seconds`
    over the time they took (on a machine shared with other work, what it gets now; the fastest
    single product overstates a busy machine tenfold); None without numpy."""
    try:
        import numpy as np
    except ImportError:
        return None
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a                                                 # warm up the BLAS threads
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        done += 1
    return 2 * n ** 3 * done / (time.perf_counter() - t0) / 1e9


def flops_per_token(size: ModelSize, seq: int) -> float:
    """Training FLOPs per token: the frozen target's forward, the draft block's forward and backward,
    the shared lm_head's forward and input gradient, and causal attention over `seq` tokens."""
    _, trainable = size.draft_params()
    head = size.vocab * size.hidden
    attention = 2 * size.layers * seq * size.q_dim
    return 2 * size.target_params() + 6 * trainable + 4 * head + attention


def _recipe_gpu_fit(stages: dict[str, dict], size: ModelSize | None, m: Machine, precision: str,
                    nodes: int) -> dict[str, float]:
    """Per stage, the estimate's per-GPU peak (bytes) at the recipe's sizes."""
    if size is None:
        return {}
    return {name: estimate(_shape(size, sd, sd["max_seq_length"], sd["per_gpu_train_batch_size"],
                                  m.gpus * nodes, precision)).peak
            for name, sd in stages.items()}


def _shape(size: ModelSize, sd: dict, seq: int, micro: int, world: int, precision: str) -> StageShape:
    zero = 3 if "zero3" in str(sd.get("deepspeed", "")) else 1
    return StageShape(size=size, precision=precision, zero_stage=zero, seq_len=seq, micro_batch=micro,
                      world_size=world, grad_accumulation=int(sd.get("gradient_accumulation_steps", 1)),
                      sequence_parallel=_sp(sd))


def _sp(sd: dict) -> int:
    return int(sd.get("sequence_parallel_size") or 1)


def size_stages(stages: dict[str, dict], size: ModelSize | None, m: Machine, *, precision: str = "bf16",
                nodes: int = 1, full: bool = False, context: int | None = None) -> Sizing:
    """What `init` writes for each stage (`stages`: name -> the recipe's values) on machine `m`."""
    params = size.target_params() if size else None
    why = m.text()
    if full:
        return _priced(Sizing("recipe", m.gpus or 8, notes=[f"sizes: the recipe's (--full-size); machine: {why}"]),
                       stages, size, m, nodes, precision)
    if m.gpus and (m.declared or size is None):
        return _priced(Sizing("recipe", m.gpus, notes=[f"sizes: the recipe's; machine: {why}"]),
                       stages, size, m, nodes, precision)
    if not m.gpus:
        if params is None or params > CPU_MAX_PARAMS:
            what = "an unknown size" if params is None else f"{params / 1e9:.1f}B parameters"
            return _priced(Sizing("recipe", 8, notes=[
                f"sizes: the recipe's for 8 GPUs: the target ({what}) is not trained on a CPU; machine: {why} "
                "(`--gpus N` says the GPUs it will run on)"]), stages, size, m, nodes, precision)
        if m.gflops is None and m.measure:
            m = replace(m, gflops=matmul_gflops())
        return _cpu(stages, size, m, context)
    peaks = _recipe_gpu_fit(stages, size, m, precision, nodes)
    cap = m.gpu_mib * MIB_BYTES * MARGIN
    if all(p <= cap for p in peaks.values()):
        return _priced(Sizing("recipe", m.gpus, notes=[
            f"sizes: the recipe's: the memory estimate fits {why} (peak {max(peaks.values()) / GiB:.1f} GiB)"]),
            stages, size, m, nodes, precision)
    return _priced(_gpu(stages, size, m, precision, nodes, cap), stages, size, m, nodes, precision)


def _priced(out: Sizing, stages: dict[str, dict], size: ModelSize | None, m: Machine, nodes: int,
            precision: str) -> Sizing:
    """`out` with a cost line per GPU stage: tokens per optimizer step and, for a bf16 or fp16 stage on
    a GPU whose rate is listed (longspec.machine.gpus), a step's rough time at GPU_EFFICIENCY of it
    and the stage's (per 1,000 steps for a whole-epoch stage, whose steps the data's size sets)."""
    from longspec.machine.gpus import listed_bf16_tflops

    world = out.gpus * nodes
    rate = listed_bf16_tflops(m.gpu_name) if m.gpu_name and not m.declared else None
    for name, sd in stages.items():
        sd = {**sd, **out.stages.get(name, {})}
        seq, micro = int(sd["max_seq_length"]), int(sd["per_gpu_train_batch_size"])
        accum, steps = int(sd.get("gradient_accumulation_steps") or 1), int(sd.get("max_steps") or 0)
        dp = max(1, world // _sp(sd))                     # sequence-parallel ranks share a sequence
        tokens = seq * micro * accum * dp
        line = f"{name} cost: {tokens:,} tokens a step ({seq} x {micro} x {accum} accumulation x {dp} data-parallel)"
        if size is not None and rate and precision in ("bf16", "fp16"):
            step_s = tokens * flops_per_token(size, seq) / (world * rate * 1e12 * GPU_EFFICIENCY)
            span = f"{steps} steps ~{_hours(steps * step_s)}" if steps else f"~{_hours(1000 * step_s)} per 1,000 steps"
            line += (f", ~{step_s:.1f} s a step on {m.gpu_name} ({rate:.0f} TFLOP/s listed, {GPU_EFFICIENCY:.0%} "
                     f"of it reached), {span}")
        else:
            why = ("the target's size is unknown" if size is None else "no GPU here whose rate is listed" if not rate
                   else f"{precision}: only bf16 and fp16 rates are listed")
            line += f", time not estimated ({why})"
        if not steps:
            line += "; a whole epoch: `longspec prepare` counts its steps"
        out.notes.append(line)
    return out


def _hours(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _gpu(stages, size, m: Machine, precision: str, nodes: int, cap: float) -> Sizing:
    out = Sizing("gpu", m.gpus, notes=[f"sizes fitted to {m.text()} (the recipe's do not fit the memory estimate)"])
    world = m.gpus * nodes
    for name, sd in stages.items():
        seq, micro = int(sd["max_seq_length"]), int(sd["per_gpu_train_batch_size"])
        if _sp(sd) > 1:                                   # a sequence-parallel stage: its own plan
            out.notes.append(f"{name}: the recipe's (sequence parallel {_sp(sd)}): `longspec run --dry-run` "
                             "checks its memory")
            continue
        glob = micro * int(sd["gradient_accumulation_steps"]) * 8          # the recipe's global batch
        peak = lambda s, b: estimate(_shape(size, sd, s, b, world, precision)).peak  # noqa: E731
        while peak(seq, micro) > cap and micro > 1:
            micro //= 2
        while peak(seq, micro) > cap and seq > MIN_SEQ:
            seq //= 2
        accum = max(1, -(-glob // (micro * world)))
        fits = peak(seq, micro) <= cap
        out.stages[name] = {"max_seq_length": seq, "per_gpu_train_batch_size": micro,
                            "gradient_accumulation_steps": accum}
        out.notes.append(f"{name}: {seq} tokens x {micro} per GPU x {accum} accumulation x {world} GPUs "
                         f"(recipe {sd['max_seq_length']} x {sd['per_gpu_train_batch_size']}); estimate "
                         f"{peak(seq, micro) / GiB:.1f} GiB per GPU" + ("" if fits else
                         " - still over: see `longspec run --dry-run` (sequence_parallel_size)"))
    return out


def _cpu(stages, size: ModelSize, m: Machine, context: int | None) -> Sizing:
    rate = (m.gflops or 0) * 1e9 * CPU_EFFICIENCY
    out = Sizing("cpu", 1, notes=[f"sizes fitted to this machine ({m.text()}): a {size.target_params() / 1e6:.0f}M-"
                                  f"parameter target, each stage about {CPU_STAGE_S // 60} minutes"
                                  + ("" if rate else " (no rate measured: fixed step counts)")])
    for name, sd in stages.items():
        seq, micro, accum, lr = CPU_SHAPES.get(name, CPU_SHAPES["long"])
        seq = min(seq, int(sd["max_seq_length"]), context or seq)
        tokens = seq * micro * accum
        step_s = tokens * flops_per_token(size, seq) / rate if rate else None
        steps = int(min(CPU_STEPS[1], max(CPU_STEPS[0], CPU_STAGE_S / step_s))) if step_s else 200
        steps = max(CPU_STEPS[0], steps // 10 * 10)
        every = max(10, steps // 5)
        out.stages[name] = {"max_seq_length": seq, "per_gpu_train_batch_size": micro,
                            "gradient_accumulation_steps": accum, "learning_rate": lr, "max_steps": steps,
                            "eval_steps": every, "save_steps": max(every, steps // 2),
                            "eval_tokens": min(int(sd.get("eval_tokens", 4096)), 4 * seq)}
        cost = f"~{steps * step_s / 60:.0f} min" if step_s else "time not estimated"
        out.notes.append(f"{name}: {steps} steps x {tokens:,} tokens ({seq} x {micro} x {accum} accumulation) = "
                         f"{steps * tokens:,} tokens, lr {lr:g}, tau every {every} steps; {cost} "
                         f"(recipe: {sd['max_seq_length']} tokens, a whole epoch, lr {sd['learning_rate']:g})")
    return out
