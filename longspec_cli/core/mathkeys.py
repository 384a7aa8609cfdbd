"""Which config keys change what a run trains (docs/DESIGN.md, Resume keys).

    math_config(conf)           dotted key -> value of every math leaf of a resolved config
    differences(theirs, ours)   the dotted keys whose values differ
    show_changes(theirs, ours, keys)   "key old -> new, ..." for a message
    resume_blockers(saved, ours, resume_schedule)   what keeps a checkpoint from being resumed

Math keys (model, data, optimiser, schedule, precision, seeds: everything not listed below) are
what a checkpoint or a finished stage was trained with; a difference in any other key (saving,
logging, tracking, eval, kernels, the stage's label) changes nothing that was trained. The trainer
saves `math_config` in each checkpoint.json and in stage_complete.json; a resume (longspec.training.resume)
and `longspec status` compare against it, both through this module. Pure: no torch, no Hydra.
"""

from __future__ import annotations

from typing import Any

# dotted keys (a key covers everything under it) whose value never changes what is trained
NON_MATH_KEYS = (
    "stage", "output_dir", "force", "resume_schedule",                  # names and instructions
    "save_steps", "save_total_limit",                                   # saving
    "logging_steps", "logging",                                         # logging, tracking
    "kernels", "loss_chunk_size", "sequence_parallel_size",             # how it is computed, not what
    "ds_cfg.steps_per_print", "ds_cfg.wall_clock_breakdown",            # DeepSpeed's own logging
    "ds_cfg.tensorboard", "ds_cfg.wandb", "ds_cfg.csv_monitor", "ds_cfg.flops_profiler",
    "eval", "hydra",
)
NON_MATH_PREFIXES = ("eval_",)                                          # eval_* keys: measuring, not training
SCHEDULE_LENGTH_KEYS = ("max_steps", "num_train_epochs")
UNSET = "<unset>"


def is_math_key(dotted: str) -> bool:
    if dotted.split(".")[0].startswith(NON_MATH_PREFIXES):
        return False
    return not any(dotted == k or dotted.startswith(k + ".") for k in NON_MATH_KEYS)


def math_config(conf: dict[str, Any]) -> dict[str, Any]:
    """dotted key -> value of every math leaf of the resolved config (lists are one leaf)."""
    out: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            dotted = f"{prefix}.{k}" if prefix else str(k)
            if not is_math_key(dotted):
                continue
            if isinstance(v, dict) and v:
                walk(v, dotted)
            else:
                out[dotted] = v

    walk(conf, "")
    return out


def differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    return sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k, UNSET) != ours.get(k, UNSET))


def show_changes(theirs: dict, ours: dict, keys: list[str]) -> str:
    return ", ".join(f"{k} {theirs.get(k, UNSET)!r} -> {ours.get(k, UNSET)!r}" for k in keys)


def resume_blockers(saved: dict[str, Any], ours: dict[str, Any], resume_schedule: Any) -> tuple[list[str], list[str]]:
    """(math keys that refuse the resume, schedule-length keys that refuse it) between a checkpoint's
    `math` and the config now: the schedule's length resumes only with resume_schedule=stretch.
    The trainer (longspec.training.resume) and `run`'s planner both decide through this."""
    changed = differences(saved, ours)
    other = [k for k in changed if k not in SCHEDULE_LENGTH_KEYS]
    schedule = [k for k in changed if k in SCHEDULE_LENGTH_KEYS and resume_schedule != "stretch"]
    return other, schedule
