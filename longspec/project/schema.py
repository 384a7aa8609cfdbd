"""What a stage config may contain, per dialect: known keys, their types and ranges.

Two dialects (docs/DESIGN.md):
  longspec  our templates: the key table of DESIGN.md (`longspec/conf/config.yaml` has the defaults)
  upstream  the reference implementation's Hydra files (`model._target_`, `read_tensor`, ...)
Both carry a DeepSpeed block under `ds_cfg`, checked against DeepSpeed's own key names.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

LONGSPEC = "longspec"
UPSTREAM = "upstream"


@dataclass(frozen=True)
class Spec:
    kind: str  # int | float | bool | str | enum | betas | map | list | any
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    nullable: bool = False
    children: dict[str, "Spec"] | None = None  # known keys of a map (None = free-form)


def _int(lo=None, hi=None, nullable=False):
    return Spec("int", lo, hi, nullable=nullable)


def _pos_int(nullable=False):
    return Spec("int", 1, None, nullable=nullable)


def _float(lo=None, hi=None, lo_open=False, hi_open=False, nullable=False):
    return Spec("float", lo, hi, lo_open, hi_open, nullable=nullable)


def _enum(*choices, nullable=False):
    return Spec("enum", choices=choices, nullable=nullable)


BOOL = Spec("bool")
BOOL_N = Spec("bool", nullable=True)
STR = Spec("str")
STR_N = Spec("str", nullable=True)
ANY = Spec("any", nullable=True)
FREE = Spec("map", nullable=True)
LR = _float(0, 1, lo_open=True)
BETAS = Spec("betas")

PRECISIONS = ("bf16", "fp16", "fp32")
COLLATORS = ("short_text", "long_data", "long_cot")

# ---------------------------------------------------------------- DeepSpeed block (ds_cfg)

_OFFLOAD = Spec("map", nullable=True, children={
    "device": _enum("cpu", "nvme", "none", nullable=True), "nvme_path": STR_N, "pin_memory": BOOL_N,
    "buffer_count": _pos_int(True), "buffer_size": ANY, "max_in_cpu": ANY, "pipeline_read": BOOL_N,
    "pipeline_write": BOOL_N, "fast_init": BOOL_N, "ratio": _float(0, 1, nullable=True),
    "super_offload": BOOL_N, "cpuadam_cores_perc": ANY,
})

ZERO_KEYS = (
    "stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce "
    "allgather_partitions allgather_bucket_size overlap_comm compute_grad_norm load_from_fp32_weights "
    "elastic_checkpoint offload_param offload_optimizer zenflow sub_group_size cpu_offload_param "
    "cpu_offload_use_pin_memory cpu_offload prefetch_bucket_size param_persistence_threshold "
    "model_persistence_threshold max_live_parameters max_reuse_distance gather_16bit_weights_on_model_save "
    "module_granularity_threshold use_all_reduce_for_fetch_params allgather_sequential "
    "stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1 round_robin_gradients "
    "parameter_alignment zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights "
    "zero_quantized_gradients memory_efficient_linear pipeline_loading_checkpoint override_module_apply "
    "log_trace_cache_warnings enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module "
    "stage3_prefetch_bucket_size stage3_param_persistence_threshold stage3_model_persistence_threshold "
    "stage3_max_live_parameters stage3_max_reuse_distance stage3_gather_16bit_weights_on_model_save "
    "stage3_module_granularity_threshold stage3_use_all_reduce_for_fetch_params stage3_allgather_sequential"
).split()

DS_KEYS = (
    "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler "
    "fp16 bf16 bfloat16 amp torch_autocast zero_optimization gradient_clipping prescale_gradients "
    "gradient_predivide_factor steps_per_print wall_clock_breakdown dump_state zero_allow_untested_optimizer "
    "zero_force_ds_cpu_optimizer activation_checkpointing flops_profiler tensorboard wandb csv_monitor "
    "comet monitor_config comms_logger communication_data_type seq_parallel_communication_data_type "
    "sparse_gradients memory_breakdown hybrid_engine data_efficiency curriculum_learning elasticity "
    "checkpoint aio autotuning compression_training pipeline data_types disable_allgather sparse_attention "
    "nebula weight_quantization graph_harvesting use_data_before_expert_parallelism timers "
    "dataloader_drop_last eigenvalue progressive_layer_drop quantize_training zero_optimization "
    "load_universal_checkpoint use_node_local_storage gradient_accumulation_dtype"
).split()

_PRECISION_BLOCK = Spec("map", nullable=True, children=None)

DS_SPEC = Spec("map", nullable=True, children={
    **{k: ANY for k in DS_KEYS},
    "train_batch_size": _pos_int(True),
    "train_micro_batch_size_per_gpu": _pos_int(True),
    "gradient_accumulation_steps": _pos_int(True),
    "gradient_clipping": _float(0, nullable=True),
    "steps_per_print": _pos_int(True),
    "fp16": _PRECISION_BLOCK,
    "bf16": _PRECISION_BLOCK,
    "optimizer": Spec("map", nullable=True, children={
        "type": STR_N,
        "params": Spec("map", nullable=True, children=None),
    }),
    "zero_optimization": Spec("map", nullable=True, children={
        **{k: ANY for k in ZERO_KEYS},
        "stage": _int(0, 3, nullable=True),
        "offload_optimizer": _OFFLOAD,
        "offload_param": _OFFLOAD,
        "overlap_comm": BOOL_N,
        "contiguous_gradients": BOOL_N,
    }),
})

# Value checks inside ds_cfg whose parent map is free-form.
DS_VALUES = {
    "ds_cfg.optimizer.params.lr": _float(0, 1, lo_open=True, nullable=True),
    "ds_cfg.optimizer.params.betas": Spec("betas", nullable=True),
    "ds_cfg.optimizer.params.eps": _float(0, 1, lo_open=True, nullable=True),
    "ds_cfg.optimizer.params.weight_decay": _float(0, nullable=True),
    "ds_cfg.fp16.enabled": Spec("bool", nullable=True),
    "ds_cfg.bf16.enabled": Spec("bool", nullable=True),
}

# ---------------------------------------------------------------- longspec dialect

LONGSPEC_SPEC: dict[str, Spec] = {
    "defaults": Spec("list", nullable=True),
    "hydra": FREE,
    "stage": STR,
    "model_name_or_path": STR,
    "draft_model_name_or_path": STR_N,
    "train_file": STR,
    "output_dir": STR,
    "precision": _enum(*PRECISIONS),
    "force": BOOL,
    "resume_schedule": _enum("refuse", "stretch"),
    "data": Spec("map", children={
        "collator": _enum(*COLLATORS),
        "max_seq_length": _pos_int(),
        "on_bad_record": _enum("error", "skip"),
        "max_untrainable_share": _float(0, 1),
    }),
    "positions": Spec("map", children={
        "mode": _enum("anchor_offset", "plain"),
        "anchors": _int(0),
        "max_offset": _int(0, nullable=True),
        "threshold": _int(0),
    }),
    "cross_attn_lag": _int(0, 8),
    "draft": Spec("map", children={"sliding_window": _pos_int()}),
    "learning_rate": LR,
    "weight_decay": _float(0),
    "adam_epsilon": _float(0, 1, lo_open=True),
    "adam_betas": BETAS,
    "max_grad_norm": _float(0),
    "per_gpu_train_batch_size": _pos_int(),
    "gradient_accumulation_steps": _pos_int(),
    "global_batch_size": _pos_int(nullable=True),
    "num_train_epochs": _float(0, lo_open=True),
    "max_steps": _int(0),
    "warmup_proportion": _float(0, 1),
    "warmup_steps": _int(0),
    "save_steps": _pos_int(),
    "save_total_limit": _int(0, nullable=True),
    "eval_steps": _int(0),
    "eval_tokens": _int(0),
    "eval_share": _float(0, 1, hi_open=True),
    "eval_gamma": _int(1, 16),
    "logging_steps": _pos_int(),
    "seed": _int(0),
    "loss_chunk_size": _pos_int(),
    "kernels": _enum("auto", "fused", "reference"),
    "sequence_parallel_size": _pos_int(),
    "logging": Spec("map", children={"wandb": BOOL, "tensorboard": BOOL}),
    "ds_cfg": DS_SPEC,
}

# ---------------------------------------------------------------- upstream dialect
# Every key the reference trainer's experiment files use (plus draft_model_name_or_path,
# which its trainer reads although no shipped file sets it). `_target_` blocks are free-form.

_UPSTREAM_FREE = (
    "hydra torch_dtype tokenizer_init device_map model read_tensor collator prediction_cfg "
    "eval_forward_fn post_process summary_helper"
).split()
_UPSTREAM_ANY = (
    "data_path_prefix model_path_prefix output_path_prefix train_file dev_file test_file eos_token "
    "extended_vocab model_name model_name_or_path draft_model_name_or_path pretrain resume dp_size "
    "wandb_project exp_name exp_notes output_dir eval_sub_path optimizer use_nvlamb bit_training "
    "n_gpu device train_batch_size eval_batch_size world_size fp16_opt_level"
).split()

UPSTREAM_SPEC: dict[str, Spec] = {
    "defaults": Spec("list", nullable=True),
    **{k: FREE for k in _UPSTREAM_FREE},
    **{k: ANY for k in _UPSTREAM_ANY},
    "torch_dtype": Spec("map", nullable=True, children={
        "_target_": STR, "dtype": _enum("bfloat16", "float16", "float32", nullable=True)}),
    "collator": Spec("map", nullable=True, children=None),
    "eos_token_id": _int(0, nullable=True),
    "dist_load_data_barrier": BOOL_N,
    "num_workers": _int(0, nullable=True),
    "prefetch_factor": _pos_int(True),
    "tp_size": _pos_int(True),
    "pp_size": _pos_int(True),
    "do_train": BOOL_N,
    "evaluate_during_training": BOOL_N,
    "do_eval": BOOL_N,
    "per_gpu_train_batch_size": _pos_int(),
    "per_gpu_eval_batch_size": _pos_int(True),
    "learning_rate": LR,
    "gradient_accumulation_steps": _pos_int(),
    "weight_decay": _float(0),
    "adam_epsilon": _float(0, 1, lo_open=True),
    "adam_betas": BETAS,
    "total_dataset_len": _int(-1, nullable=True),
    "max_grad_norm": _float(0),
    "num_train_epochs": _float(0, lo_open=True),
    "max_steps": _int(0),
    "warmup_proportion": _float(0, 1),
    "warmup_steps": _int(0),
    "logging_steps": _pos_int(),
    "save_ds_state": BOOL_N,
    "save_steps": _pos_int(),
    "save_best": BOOL_N,
    "eval_steps": _pos_int(True),
    "ddp_eval": BOOL_N,
    "no_cuda": BOOL_N,
    "seed": _int(0),
    "local_rank": _int(-1, nullable=True),
    "fp16": BOOL_N,
    "fp16_bfloat16": BOOL_N,
    "ds_cfg": DS_SPEC,
}
UPSTREAM_VALUES = {"collator.max_seq_length": _pos_int()}

SPECS = {LONGSPEC: LONGSPEC_SPEC, UPSTREAM: UPSTREAM_SPEC}

# An upstream key written in a longspec file: what longspec calls it (or why it has no such key).
UPSTREAM_TO_LONGSPEC = {
    "collator": "longspec's keys are data.collator (short_text | long_data | long_cot) and data.max_seq_length",
    "read_tensor": "longspec's keys are train_file (JSON or JSONL) and data.collator",
    "model": "remove it: longspec builds the draft from the target (model_name_or_path)",
    "model_name": "longspec's key is model_name_or_path (the target's folder)",
    "model_path_prefix": "longspec's key is model_name_or_path (a full path)",
    "data_path_prefix": "longspec's key is train_file (a full path)",
    "output_path_prefix": "longspec's key is output_dir (longspec.yaml's stages[].output_dir)",
    "exp_name": "longspec's key is output_dir (longspec.yaml's stages[].output_dir)",
    "torch_dtype": "longspec's key is precision (bf16 | fp16 | fp32)",
    "fp16": "longspec's key is precision (bf16 | fp16 | fp32)",
    "fp16_bfloat16": "longspec's key is precision (bf16 | fp16 | fp32)",
    "tokenizer_init": "remove it: longspec reads the tokenizer from model_name_or_path",
    "resume": "remove it: a stage resumes from its newest complete checkpoint by itself",
    "train_batch_size": "longspec's key is global_batch_size",
    "do_eval": "remove it: `longspec eval` measures a stage",
}
# Upstream values that are still checked against the longspec key they stand for.
UPSTREAM_VALUE_OF = {"collator.max_seq_length": "data.max_seq_length"}


DEEPSPEED = "deepspeed"  # a DeepSpeed file given on its own (conf/deepspeed/*.yaml)
HYDRA = "hydra"  # Hydra's own settings (conf/hydra/*.yaml)
_STAGE_MARKERS = ("model_name_or_path", "train_file", "output_dir", "stage", "model", "read_tensor",
                  "precision", "data", "learning_rate")
_HYDRA_KEYS = {"run", "sweep", "job", "searchpath", "output_subdir", "job_logging", "hydra_logging",
               "launcher", "sweeper", "callbacks", "mode", "verbose", "help", "hydra_help", "overrides", "env"}


_LONGSPEC_ONLY = ("precision", "data", "positions", "stage", "cross_attn_lag")


def dialect_of(data: dict[str, Any], path: Any = None) -> str:
    if any(k in data for k in _LONGSPEC_ONLY):  # a longspec file, even with upstream keys pasted in
        return LONGSPEC
    model = data.get("model")
    if (isinstance(model, dict) and "_target_" in model) or "read_tensor" in data:
        return UPSTREAM
    if not any(k in data for k in _STAGE_MARKERS):
        if data and set(data) <= _HYDRA_KEYS:
            return HYDRA
        if any(k in data for k in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16",
                                   "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")):
            return DEEPSPEED
    return LONGSPEC


# Where the same setting lives in each dialect.
KEYS = {
    LONGSPEC: {"max_seq_length": "data.max_seq_length", "collator": "data.collator"},
    UPSTREAM: {"max_seq_length": "collator.max_seq_length", "collator": "collator._target_"},
}


def did_you_mean(word: str, choices) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return close[0] if close else None


# ---------------------------------------------------------------- value checks

_NUMBER_TEXT = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")
_TUPLE_TEXT = re.compile(r"^\s*[(\[]\s*([^,()\[\]]+)\s*,\s*([^,()\[\]]+)\s*[)\]]\s*$")


def as_number(v: Any) -> float | None:
    """A number, or a number written as text ("5e-4"); None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _NUMBER_TEXT.match(v):
        return float(v)
    return None


def as_betas(v: Any) -> tuple[float, float] | None:
    """[b1, b2] or the upstream text "(b1, b2)"; None if it is neither."""
    if isinstance(v, (list, tuple)) and len(v) == 2:
        a, b = as_number(v[0]), as_number(v[1])
        return (a, b) if a is not None and b is not None else None
    if isinstance(v, str):
        m = _TUPLE_TEXT.match(v)
        if m:
            a, b = as_number(m.group(1)), as_number(m.group(2))
            return (a, b) if a is not None and b is not None else None
    return None


def _range_text(spec: Spec) -> str:
    if spec.lo is not None and spec.hi is not None:
        return f"in {'(' if spec.lo_open else '['}{_fmt(spec.lo)}, {_fmt(spec.hi)}{')' if spec.hi_open else ']'}"
    if spec.lo is not None:
        return f"{'>' if spec.lo_open else '>='} {_fmt(spec.lo)}"
    return f"{'<' if spec.hi_open else '<='} {_fmt(spec.hi)}"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _in_range(spec: Spec, x: float) -> bool:
    if math.isnan(x):
        return False
    if spec.lo is not None and (x < spec.lo or (spec.lo_open and x == spec.lo)):
        return False
    if spec.hi is not None and (x > spec.hi or (spec.hi_open and x == spec.hi)):
        return False
    return True


def check_value(spec: Spec, value: Any, key: str, dialect: str) -> tuple[str, str, str | None] | None:
    """(severity, message, hint) when `value` does not fit `spec`, else None."""
    if value is None:
        return None if spec.nullable or spec.kind in ("any", "str") else (
            "error", f"{key} must be set (it is empty/null)", None)
    kind = spec.kind
    if kind == "any":
        return None
    if kind in ("int", "float"):
        if isinstance(value, str):
            if as_number(value) is not None:
                return ("error", f"{key} is the text {value!r}, not a number",
                        f"remove the quotes: {key.rsplit('.', 1)[-1]}: {value.strip()}")
            return "error", f"{key} must be a number, got {value!r}", None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "error", f"{key} must be a number, got {_kind(value)}", None
        if kind == "int" and not float(value).is_integer():
            return "error", f"{key} must be a whole number, got {value!r}", None
        if not _in_range(spec, float(value)):
            return "error", f"{key} = {value!r} is out of range: must be {_range_text(spec)}", None
        return None
    if kind == "bool":
        if not isinstance(value, bool):
            return "error", f"{key} must be true or false, got {value!r}", None
        return None
    if kind == "enum":
        if value not in spec.choices:
            close = did_you_mean(str(value), spec.choices)
            return ("error", f"{key} = {value!r} is not one of {', '.join(spec.choices)}",
                    f"did you mean {close!r}?" if close else None)
        return None
    if kind == "str":
        if not isinstance(value, str):
            return "error", f"{key} must be text (a path or name), got {_kind(value)}", None
        return None
    if kind == "betas":
        betas = as_betas(value)
        if isinstance(value, str):
            if betas is None:
                return "error", f"{key} must be a list [beta1, beta2], got the text {value!r}", None
            sev = "warning" if dialect == UPSTREAM else "error"
            return (sev, f"{key} is the text {value!r}, not a list of two numbers",
                    f"write {key.rsplit('.', 1)[-1]}: [{_fmt(betas[0])}, {_fmt(betas[1])}]")
        if betas is None:
            return "error", f"{key} must be a list of two numbers [beta1, beta2], got {value!r}", None
        bad = [b for b in betas if not 0 < b < 1]
        if bad:
            return "error", f"{key} = {list(betas)}: each beta must be in (0, 1)", None
        return None
    if kind == "map":
        if not isinstance(value, dict):
            return "error", f"{key} must be a mapping, got {_kind(value)}", None
        return None
    if kind == "list":
        if not isinstance(value, list):
            return "error", f"{key} must be a list, got {_kind(value)}", None
    return None


def _kind(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "text", bool: "a boolean"}.get(type(v), type(v).__name__)
