"""Which checkpoint a run resumes from, and which config changes may resume it (docs/DESIGN.md).

    decide_resume(out, origin, conf)  the newest complete checkpoint, None (start), or TrainError

Which keys are math is longspec.project.mathkeys (`status` asks the same question of a finished
stage).

Math keys (model, data, optimiser, schedule, precision, seeds) must be what the checkpoint was
trained with, or two runs would be mixed. Non-math keys (saving, logging,
tracking, eval, kernels, the stage's label) never block a resume. The schedule's length
(`max_steps`, `num_train_epochs`) is math, with one way through: `resume_schedule=stretch` resumes
and recomputes warm-up and decay for the new total, so the learning rate continues on the new
curve from the checkpoint's step; without it the resume is refused and the checkpoints are kept.
`force=true` starts over (the checkpoints are removed). A checkpoint resumes only on the ranks it was saved on
(its `layout`; mathkeys.layout_blocker says why), at another sequence_parallel_size when the
sequences per step stay the same (gradient_accumulation_steps or per_gpu_train_batch_size may then
change to keep them).
"""
from __future__ import annotations

import os
from typing import Any

from longspec.training import runwriter
from longspec.training.entry import TrainError
from longspec.project.mathkeys import (SCHEDULE_LENGTH_KEYS, batch_keys_free, differences, layout_blocker, math_config, resume_blockers,
                                       show_changes)


def decide_resume(out: runwriter.RunWriter, origin, conf: dict[str, Any]):
    """The complete checkpoint to resume from (or None). A checkpoint of another config is resumed
    when only non-math keys differ, or only the schedule's length with resume_schedule=stretch;
    otherwise TrainError, with the checkpoints left in place."""
    complete = out.complete_checkpoints()
    if conf.get("force") or not complete:
        return None
    newest = complete[-1]
    from longspec.training.rank import world_size

    saved_layout, world, sp = newest.info.get("layout"), world_size(), int(conf.get("sequence_parallel_size") or 1)
    saved = newest.info.get("math")
    blocked = layout_blocker(saved_layout, world, sp, saved if isinstance(saved, dict) else None, math_config(conf))
    if blocked:
        raise TrainError(f"{out.dir}: checkpoint-{newest.step} cannot resume here: {blocked[0]}", hint=blocked[1])
    theirs = newest.info.get("config_sha256")
    if not origin.config_sha256 or not theirs or theirs == origin.config_sha256:
        return newest
    where = f"{out.dir} holds checkpoints of another config (checkpoint-{newest.step})"
    start_over = "force=true starts over (its checkpoints are removed)"
    if not isinstance(saved, dict):  # saved before checkpoints named their math keys: cannot tell
        raise TrainError(f"{where}; resuming would mix two runs",
                         hint="restore the config it was saved with to resume it, or choose another "
                              f"output_dir; {start_over}")
    ours = math_config(conf)
    changed = differences(saved, ours)
    other, schedule = resume_blockers(saved, ours, conf.get("resume_schedule"), batch_keys_free(saved_layout, world, sp))
    if other:
        raise TrainError(f"{where}: {show_changes(saved, ours, other)} change what is trained; resuming would mix "
                         "two runs",
                         hint=f"set them back to resume from checkpoint-{newest.step} (its checkpoints are "
                              f"kept), or choose another output_dir; {start_over}")
    if schedule:
        raise TrainError(f"{where}: the schedule's length changed ({show_changes(saved, ours, schedule)})",
                         hint=f"resume_schedule=stretch resumes from checkpoint-{newest.step} with warm-up and "
                              "decay recomputed for the new length (the learning rate continues on the new "
                              f"curve from step {newest.step}); or set it back; {start_over}")
    if os.environ.get("RANK", "0") == "0":
        sched = [k for k in changed if k in SCHEDULE_LENGTH_KEYS]
        batch = [k for k in changed if k not in sched]           # batch keys freed by another SP
        parts = ([f"the schedule stretched to the new length ({show_changes(saved, ours, sched)})"] if sched else []) \
            + ([f"sequence_parallel_size {saved_layout.get('sequence_parallel_size')} -> {sp} with the same "
                f"sequences per step ({show_changes(saved, ours, [k for k in batch if '.' not in k] or batch)})"]
               if batch else [])
        what = "; ".join(parts) or "only keys that do not change what is trained differ"
        print(f"[{conf.get('stage')}] resuming checkpoint-{newest.step} of a changed config: {what}", flush=True)
    return newest
