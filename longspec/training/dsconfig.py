"""From the composed stage config to checked trainer settings and DeepSpeed's config dict.

Pure (no torch, deepspeed or hydra): `train.py` calls these with a plain dict
(`OmegaConf.to_container(cfg, resolve=True)`), so every rule here is testable without a launch.

One source of truth: the trainer keys (learning_rate, adam_betas, gradient_accumulation_steps, ...)
decide; the DeepSpeed block may repeat them through `${...}` but never with another value, and
`precision` alone decides DeepSpeed's fp16 / bf16 blocks.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from longspec.project import schema
from longspec.machine.memory import reduce_bucket_elements

# Trainer-only keys that a stage file does not carry (command-line switches).
EXTRA_SPEC = {"force": schema.BOOL}
SCHEDULERS = ("WarmupCosineLR", "WarmupDecayLR", "WarmupLR")
OPTIMIZERS = ("AdamW", "Adam")
FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}


class ConfigError(Exception):
    """The stage config cannot be run; `problems` lists every reason (one line each)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ----------------------------------------------------------------------------- key checks

def check_config(conf: dict[str, Any]) -> list[str]:
    """Every problem with the keys' names, types and ranges (schema.LONGSPEC_SPEC), as lines."""
    spec = {**schema.LONGSPEC_SPEC, **EXTRA_SPEC}
    spec.pop("defaults", None)
    spec.pop("hydra", None)
    problems: list[str] = []
    _walk(conf, spec, "", problems)
    return problems


def _walk(node: dict, spec: dict[str, schema.Spec], prefix: str, problems: list[str]) -> None:
    for key, value in node.items():
        path = f"{prefix}{key}"
        sub = spec.get(key)
        if sub is None:
            close = schema.did_you_mean(str(key), spec)
            problems.append(f"{path}: unknown key" + (f" (did you mean {prefix}{close}?)" if close else ""))
            continue
        if path == "ds_cfg":                  # DeepSpeed's own names: checked by build_ds_config
            if value is not None and not isinstance(value, dict):
                problems.append(f"ds_cfg must be a mapping, got {value!r}")
            continue
        bad = schema.check_value(sub, value, path, schema.LONGSPEC)
        if bad and bad[0] == "error":
            problems.append(bad[1] + (f" ({bad[2]})" if bad[2] else ""))
            continue
        if sub.kind == "map" and sub.children is not None and isinstance(value, dict):
            _walk(value, sub.children, path + ".", problems)


# ----------------------------------------------------------------------------- schedule

def plan_steps(conf: dict[str, Any], batches_per_epoch: int) -> tuple[int, int]:
    """(total optimizer steps, warm-up steps). max_steps > 0 wins; else epochs x batches / GA.
    Warm-up is at least 1 step: DeepSpeed's warm-up schedulers refuse 0."""
    ga = conf["gradient_accumulation_steps"]
    if conf["max_steps"] > 0:
        total = int(conf["max_steps"])
    else:
        if batches_per_epoch <= 0:
            raise ConfigError(["the training data yields no batch on this rank "
                               "(fewer records than per_gpu_train_batch_size x world size)"])
        total = math.ceil(conf["num_train_epochs"] * batches_per_epoch / ga)
    total = max(total, 1)
    if conf.get("warmup_steps", 0) > 0:
        warmup = int(conf["warmup_steps"])
    else:
        warmup = int(conf.get("warmup_proportion", 0.0) * total)
    return total, max(1, min(warmup, total))


# ----------------------------------------------------------------------------- DeepSpeed block

def build_ds_config(
    conf: dict[str, Any],
    *,
    world_size: int,
    total_steps: int,
    warmup_steps: int,
    on_cpu: bool,
    cpu_adam_error: str | None = None,
    draft_trainable: int | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """(DeepSpeed config, notes for the log). Raises ConfigError when ds_cfg contradicts a trainer key.

    cpu_adam_error: why DeepSpeedCPUAdam cannot be built here (None = it can); then optimizer
    offload is turned off and torch's AdamW used instead, with a note saying so.
    draft_trainable: the draft's trainable parameters; the reduce bucket is sized to them where
    ds_cfg sets none (longspec.machine.memory.reduce_bucket_elements).
    """
    ds = copy.deepcopy(conf.get("ds_cfg") or {})
    problems: list[str] = []
    notes: list[str] = []
    per_gpu, ga = conf["per_gpu_train_batch_size"], conf["gradient_accumulation_steps"]
    sp = int(conf.get("sequence_parallel_size") or 1)
    if world_size % sp:
        problems.append(f"sequence_parallel_size = {sp} does not divide the world size {world_size}")
        sp = 1
    # The ranks of one sequence-parallel group share each sequence: the batch counts data-parallel ranks.
    data_parallel = world_size // sp
    where = "world size" if sp == 1 else f"data-parallel ranks ({world_size} / SP {sp})"

    global_batch = per_gpu * ga * data_parallel
    if conf.get("global_batch_size") not in (None, global_batch):
        problems.append(
            f"global_batch_size = {conf['global_batch_size']} but per_gpu_train_batch_size x "
            f"gradient_accumulation_steps x {where} = {per_gpu} x {ga} x {data_parallel} = {global_batch} "
            "(set global_batch_size to that, or null)")

    _pin(ds, ("train_micro_batch_size_per_gpu",), per_gpu, "per_gpu_train_batch_size", problems)
    _pin(ds, ("gradient_accumulation_steps",), ga, "gradient_accumulation_steps", problems)
    _pin(ds, ("train_batch_size",), global_batch, f"per_gpu x accumulation x {where}", problems)
    _pin(ds, ("gradient_clipping",), conf["max_grad_norm"], "max_grad_norm", problems)

    opt = ds.setdefault("optimizer", {}) or {}
    ds["optimizer"] = opt
    opt.setdefault("type", "AdamW")
    if opt["type"] not in OPTIMIZERS:
        problems.append(f"ds_cfg.optimizer.type = {opt['type']!r}: longspec trains with {' or '.join(OPTIMIZERS)}")
    opt["params"] = opt.get("params") or {}
    prefix = ("optimizer", "params")
    _pin(ds, prefix + ("lr",), conf["learning_rate"], "learning_rate", problems)
    _pin(ds, prefix + ("betas",), list(conf["adam_betas"]), "adam_betas", problems)
    _pin(ds, prefix + ("eps",), conf["adam_epsilon"], "adam_epsilon", problems)
    _pin(ds, prefix + ("weight_decay",), conf["weight_decay"], "weight_decay", problems)

    _scheduler(ds, conf, total_steps, warmup_steps, problems)
    _precision(ds, conf["precision"], on_cpu, problems)
    _zero(ds, on_cpu, cpu_adam_error, problems, notes)
    zero = ds["zero_optimization"]
    if zero.get("stage") in (1, 2, 3) and zero.get("reduce_bucket_size") is None and draft_trainable:
        # DeepSpeed allocates reduce_bucket_size elements whatever the model (default 5e8: 1 GB
        # in bf16); every gradient of the one-block draft fits in its own count
        zero["reduce_bucket_size"] = reduce_bucket_elements(draft_trainable)
    if sp > 1:
        _sequence_parallel(ds, sp, problems, notes)
    ds.setdefault("steps_per_print", 1_000_000_000)   # the trainer prints its own progress line
    ds.setdefault("wall_clock_breakdown", False)
    if problems:
        raise ConfigError(problems)
    return ds, notes


def _sequence_parallel(ds: dict, sp: int, problems: list[str], notes: list[str]) -> None:
    """SP > 1: DeepSpeed is told the SP size (its batch arithmetic and zero.Init count data-parallel
    ranks), and ZeRO-3 reduces gradients without reduce_scatter: DeepSpeed 0.19's reduce_scatter
    path averages over the SP ranks where every other path sums, which would scale the gradient by
    1/SP (tests/trainer/test_sequence_parallel.py)."""
    _pin(ds, ("sequence_parallel_size",), sp, "sequence_parallel_size", problems)
    zero = ds["zero_optimization"]
    if zero.get("stage") == 3 and zero.get("reduce_scatter") is not False:
        zero["reduce_scatter"] = False
        notes.append(f"sequence_parallel_size = {sp} with ZeRO-3: zero_optimization.reduce_scatter = false "
                     "(DeepSpeed's reduce_scatter averages the gradient over the SP ranks instead of summing)")


def _pin(ds: dict, path: tuple[str, ...], want: Any, source: str, problems: list[str]) -> None:
    """Set ds[path] = want, or record a problem when the block hard-codes another value."""
    node = ds
    for key in path[:-1]:
        node = node.setdefault(key, {})
    have = node.get(path[-1])
    if have is not None and not _same(have, want):
        where = "ds_cfg." + ".".join(path)
        problems.append(f"{where} = {have!r} but {source} = {want!r}: set it once, on the trainer key "
                        f"(write `{path[-1]}: ${{{source}}}` in the DeepSpeed file, or leave it out)"
                        if source.isidentifier() else
                        f"{where} = {have!r} but {source} = {want!r}: leave it out of the DeepSpeed file")
    node[path[-1]] = want


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _scheduler(ds: dict, conf: dict, total: int, warmup: int, problems: list[str]) -> None:
    sched = ds.setdefault("scheduler", {}) or {}
    ds["scheduler"] = sched
    sched.setdefault("type", "WarmupCosineLR")
    kind = sched["type"]
    if kind not in SCHEDULERS:
        problems.append(f"ds_cfg.scheduler.type = {kind!r}: supported are {', '.join(SCHEDULERS)}")
        return
    sched["params"] = sched.get("params") or {}
    path = ("scheduler", "params")
    _pin(ds, path + ("warmup_num_steps",), warmup, "the warm-up steps computed at run time", problems)
    if kind in ("WarmupCosineLR", "WarmupDecayLR"):
        _pin(ds, path + ("total_num_steps",), total, "the total steps computed at run time", problems)
    if kind in ("WarmupDecayLR", "WarmupLR"):
        _pin(ds, path + ("warmup_max_lr",), conf["learning_rate"], "learning_rate", problems)
        sched["params"].setdefault("warmup_min_lr", 0.0)


def _precision(ds: dict, precision: str, on_cpu: bool, problems: list[str]) -> None:
    blocks = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
    for name, owner in blocks.items():
        block = ds.get(name)
        if isinstance(block, dict) and block.get("enabled") is not None \
                and bool(block["enabled"]) != (owner == precision):
            problems.append(f"ds_cfg.{name}.enabled = {block['enabled']} but precision = {precision}: "
                            f"precision is the only precision setting; remove enabled from ds_cfg.{name}")
    ds.pop("bfloat16", None)
    if precision == "fp16" and on_cpu:
        problems.append("precision = fp16: DeepSpeed's CPU accelerator cannot train in fp16; "
                        "use precision=bf16 or precision=fp32 on CPU")
    fp16 = ds.get("fp16") if isinstance(ds.get("fp16"), dict) else {}
    bf16 = ds.get("bf16") if isinstance(ds.get("bf16"), dict) else {}
    if precision == "fp16":
        ds["fp16"] = {**FP16_DEFAULTS, **fp16, "enabled": True}   # loss_scale 0 = dynamic
    else:
        ds["fp16"] = {"enabled": False}
    ds["bf16"] = {**bf16, "enabled": precision == "bf16"}


def _zero(ds: dict, on_cpu: bool, cpu_adam_error: str | None, problems: list[str], notes: list[str]) -> None:
    zero = ds.setdefault("zero_optimization", {}) or {}
    ds["zero_optimization"] = zero
    zero.setdefault("stage", 1)
    if zero["stage"] not in (0, 1, 2, 3):
        problems.append(f"ds_cfg.zero_optimization.stage = {zero['stage']!r}: must be 0, 1, 2 or 3")
    for name in ("offload_optimizer", "offload_param"):
        off = zero.get(name)
        if off is None:
            zero.pop(name, None)
            continue
        device = off.get("device")
        if device in (None, "none"):
            zero.pop(name)
            continue
        if name == "offload_param" and zero["stage"] != 3:
            problems.append(f"ds_cfg.zero_optimization.offload_param needs ZeRO stage 3 (stage is {zero['stage']})")
        if on_cpu and off.get("pin_memory"):
            off["pin_memory"] = False   # nothing to pin against without a GPU
    if "offload_optimizer" in zero and zero["stage"] == 0:
        problems.append("ds_cfg.zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    if "offload_optimizer" in zero and cpu_adam_error is not None:
        zero.pop("offload_optimizer")
        ds["optimizer"]["params"]["torch_adam"] = True
        notes.append(f"DeepSpeedCPUAdam cannot be built here ({cpu_adam_error}); optimizer offload is off "
                     "and torch.optim.AdamW is used instead")
    elif "offload_optimizer" not in zero:
        # torch's own AdamW, fused on CUDA (DeepSpeed passes `fused` through): nothing to compile
        # before the first step. DeepSpeed's FusedAdam is a JIT-built op (nvcc, an arch list it can
        # parse); set torch_adam: false in ds_cfg to have it instead.
        params = ds["optimizer"]["params"]
        params.setdefault("torch_adam", True)
        if params["torch_adam"] and not on_cpu:
            params.setdefault("fused", True)


def optimizer_name(opt) -> str:
    """'torch.optim.AdamW (fused)', 'deepspeed DeepSpeedCPUAdam', ...: the optimizer that really runs."""
    cls = type(opt)
    kind = " (fused)" if (getattr(opt, "defaults", None) or {}).get("fused") else ""
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}{kind}"
    return f"{cls.__module__.split('.')[0]} {cls.__name__}{kind}"
