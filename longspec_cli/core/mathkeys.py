"""Which config keys change what a run trains (docs/DESIGN.md, Resume keys).

    math_config(conf)           dotted key -> value of every math leaf of a resolved config
    differences(theirs, ours)   the dotted keys whose values differ
    show_changes(theirs, ours, keys)   "key old -> new, ..." for a message
    resume_blockers(saved, ours, resume_schedule)   what keeps a checkpoint from being resumed
    layout_blocker(saved_layout, world, sp)   why a checkpoint cannot resume on this many ranks / SP

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


def layout(world: int, sp: int) -> dict[str, int]:
    """The ranks a checkpoint is saved on (its checkpoint.json `layout`)."""
    return {"world_size": int(world), "sequence_parallel_size": int(sp), "data_parallel": int(world) // int(sp)}


def layout_blocker(saved: Any, world: int | None, sp: int) -> tuple[str, str] | None:
    """(why, hint) when a checkpoint saved on the layout ``saved`` (layout(): world size and SP)
    cannot resume on ``world`` ranks at sequence_parallel_size ``sp``; None when it can, or when
    either side is unknown (a checkpoint saved before checkpoints recorded it: DeepSpeed decides).

    DeepSpeed 0.19's facts (deepspeed/runtime/engine.py): ZeRO's optimizer state (and at ZeRO-3
    the weights) is partitioned over every rank, at SP > 1 too (the Ulysses mpu's SP x
    data-parallel group), and a load on another number of ranks is refused ("Automatic adjustment
    of ZeRO's optimizer state partitioning with a new world size is not currently supported");
    under the Ulysses mpu each rank's files are named by its SP rank (the mpu's model-parallel
    rank), so other SP finds other file names. On the same ranks, another SP is another number of
    data-parallel ranks: each step would train on another number of sequences, and the sampler
    and the position seeds follow the data-parallel rank. sequence_parallel_size stays a non-math
    key (a finished stage is not trained again for it): it only pins the resume of a checkpoint."""
    if not isinstance(saved, dict) or world is None:
        return None
    w0, sp0 = saved.get("world_size"), saved.get("sequence_parallel_size") or 1
    if not isinstance(w0, int) or not isinstance(sp0, int):
        return None
    start_over = "force=true starts over (its checkpoints are removed), or choose another output_dir"
    if w0 != world:
        return (f"it was saved on {w0} rank(s) and this run has {world}: DeepSpeed's ZeRO state is "
                f"partitioned over every rank (sequence-parallel ranks too) and DeepSpeed cannot "
                f"repartition it", f"resume on {w0} rank(s) (--gpus / launch.gpus), at "
                f"sequence_parallel_size={sp0}; {start_over}")
    if sp0 != sp:
        dp0, dp = w0 // sp0, world // max(sp, 1)
        return (f"sequence_parallel_size {sp0} -> {sp} on the same {world} rank(s) makes {dp0} -> {dp} "
                f"data-parallel rank(s): each step would train on {dp}/{dp0} of its sequences "
                "(per_gpu_train_batch_size x gradient_accumulation_steps x data-parallel ranks), the "
                "sampler and the position seeds follow the data-parallel rank, and DeepSpeed names "
                "each rank's files by its SP rank", f"resume at sequence_parallel_size={sp0}; {start_over}")
    return None
