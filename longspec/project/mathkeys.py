"""Which config keys change what a run trains (docs/DESIGN.md, Resume keys).

    math_config(conf)           dotted key -> value of every math leaf of a resolved config
    differences(theirs, ours)   the dotted keys whose values differ
    show_changes(theirs, ours, keys)   "key old -> new, ..." for a message
    resume_blockers(saved, ours, resume_schedule)   what keeps a checkpoint from being resumed
    layout_blocker(saved_layout, world, sp, saved_math, ours)   why a checkpoint cannot resume on these ranks / SP

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


def resume_blockers(saved: dict[str, Any], ours: dict[str, Any], resume_schedule: Any,
                    batch_free: bool = False) -> tuple[list[str], list[str]]:
    """(math keys that refuse the resume, schedule-length keys that refuse it) between a checkpoint's
    `math` and the config now: the schedule's length resumes only with resume_schedule=stretch;
    ``batch_free`` (batch_keys_free()): the batch keys may differ. The trainer
    (longspec.training.resume) and `run`'s planner both decide through this."""
    changed = differences(saved, ours)
    other = [k for k in changed if k not in SCHEDULE_LENGTH_KEYS and not (batch_free and k in BATCH_KEYS)]
    schedule = [k for k in changed if k in SCHEDULE_LENGTH_KEYS and resume_schedule != "stretch"]
    return other, schedule


def layout(world: int, sp: int) -> dict[str, int]:
    """The ranks a checkpoint is saved on (its checkpoint.json `layout`)."""
    return {"world_size": int(world), "sequence_parallel_size": int(sp), "data_parallel": int(world) // int(sp)}


def per_step(math: dict[str, Any], data_parallel: int) -> int | None:
    """Sequences per optimizer step: per_gpu_train_batch_size x gradient_accumulation_steps x
    data-parallel ranks (None when a math config lacks them)."""
    b, ga = math.get("per_gpu_train_batch_size"), math.get("gradient_accumulation_steps")
    return b * ga * data_parallel if isinstance(b, int) and isinstance(ga, int) else None


def layout_blocker(saved: Any, world: int | None, sp: int, saved_math: dict | None = None,
                   ours: dict | None = None) -> tuple[str, str] | None:
    """(why, hint) when a checkpoint saved on the layout ``saved`` (layout(): world size, SP)
    cannot resume on ``world`` ranks at sequence_parallel_size ``sp`` (the math configs: to count
    the sequences per step); None when it can, or when either side is unknown (a checkpoint saved
    before checkpoints recorded it: DeepSpeed decides).

    DeepSpeed 0.19 (deepspeed/runtime/engine.py, utils/groups.py): ZeRO's optimizer state (and at
    ZeRO-3 the weights) is partitioned over every rank, at SP > 1 too (the Ulysses mpu's SP x
    data-parallel group), and a load on another number of ranks is refused ("Automatic adjustment
    of ZeRO's optimizer state partitioning with a new world size is not currently supported").
    On the same ranks the partitions are the same at any SP, and the files are named alike (the
    Ulysses mpu counts as model-parallel size 1): another SP reloads (tried: SP 1 -> 2 on 2 ranks,
    ZeRO-3). But another SP is another number of data-parallel ranks, so the run goes on only when
    the sequences per step stay the same (per_gpu_train_batch_size or gradient_accumulation_steps
    changed to make up; batch_keys_free() then lets them differ): every step then trains on the
    same records (the sampler deals contiguous blocks of the epoch's order), only the random
    positions and lags are drawn per data-parallel rank."""
    if not isinstance(saved, dict) or world is None:
        return None
    w0, sp0 = saved.get("world_size"), saved.get("sequence_parallel_size") or 1
    if not isinstance(w0, int) or not isinstance(sp0, int):
        return None
    start_over = "force=true starts over (its checkpoints are removed), or choose another output_dir"
    if w0 != world:
        return (f"it was saved on {w0} rank(s) and this run has {world}: DeepSpeed's ZeRO state is "
                "partitioned over every rank (sequence-parallel ranks too) and DeepSpeed cannot "
                "repartition it", f"resume on {w0} rank(s) (--gpus / launch.gpus); {start_over}")
    if sp0 == sp:
        return None
    dp0, dp = w0 // sp0, world // max(sp, 1)
    before, now = per_step(saved_math or {}, dp0), per_step(ours or {}, dp)
    if before is None or now is None or before == now:
        return None
    ga = (ours or {}).get("gradient_accumulation_steps")
    b = (ours or {}).get("per_gpu_train_batch_size")
    fix = (f"gradient_accumulation_steps={before // (b * dp)} keeps {before}" if isinstance(b, int)
           and before % (b * dp) == 0 else f"a per_gpu_train_batch_size x gradient_accumulation_steps of "
           f"{before / dp:g} would keep {before}")
    return (f"sequence_parallel_size {sp0} -> {sp} on the same {world} rank(s) makes {dp0} -> {dp} data-parallel "
            f"rank(s), so each step would train on {now} sequences instead of {before} (per_gpu_train_batch_size "
            f"x gradient_accumulation_steps ({b} x {ga}) x data-parallel ranks)",
            f"{fix} sequences per step (DeepSpeed reloads the checkpoint at the new SP); or resume at "
            f"sequence_parallel_size={sp0}; {start_over}")


BATCH_KEYS = ("per_gpu_train_batch_size", "gradient_accumulation_steps",     # and DeepSpeed's copies of them
              "ds_cfg.train_micro_batch_size_per_gpu", "ds_cfg.gradient_accumulation_steps")


def batch_keys_free(saved: Any, world: int | None, sp: int) -> bool:
    """True when the checkpoint's SP differs on the same ranks: the batch keys may then differ
    (layout_blocker has held the sequences per step equal)."""
    if not isinstance(saved, dict) or world is None:
        return False
    return saved.get("world_size") == world and (saved.get("sequence_parallel_size") or 1) != sp
