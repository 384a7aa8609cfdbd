"""Train one LongSpec stage: a GLIDE draft on a frozen target, with DeepSpeed.

    python -m longspec.train --config-dir DIR/conf +exp=STAGE output_dir=RUN [key=value ...]
    deepspeed --num_gpus N --module longspec.train --config-dir DIR/conf +exp=STAGE output_dir=RUN
    deepspeed --num_gpus N /path/to/longspec/train.py --config-dir DIR/conf +exp=STAGE ...

Hydra composes longspec/conf/config.yaml (every key and its default), then DIR/conf/exp/STAGE.yaml
(`# @package _global_`, defaults [/deepspeed@ds_cfg: NAME, _self_]), then the overrides. Run from a
project folder, `--config-dir` may be left out (`--config-dir conf` is implied). The launcher's
`--local_rank=N` is taken off the command line before Hydra sees it (LOCAL_RANK is set instead);
a plain `python -m longspec.train` runs as a single rank.

Without a GPU, DS_ACCELERATOR=cpu runs DeepSpeed on the CPU (gloo), one or several ranks (deepspeed
0.19.8: `deepspeed --num_gpus N --module longspec.train ...` starts N CPU ranks). On CPU, precision
is fp32 or bf16 (DeepSpeed's CPU accelerator has no fp16 training); optimizer offload uses
DeepSpeedCPUAdam (built on first use, ~1 min), or torch AdamW when that op cannot be built.

Steps: check the config (before anything loads) -> skip if the stage is already complete ->
preflight (target, data, draft) -> DeepSpeed engine -> resume from the newest complete checkpoint
-> train -> checkpoint-<step>/ every save_steps and at the end -> draft_model_weights.pth ->
stage_complete.json (last). Every rank tears the process group down and exits 0 on success;
a user mistake prints one `error:` block on stderr and exits 1, and so does a write that fails for
want of space (the block names the path, the free space left and the checkpoint a rerun resumes
from; a half-written checkpoint is removed, never marked complete). SIGTERM or SIGUSR1 (a scheduler's
preemption notice, `longspec stop`) finishes the current optimizer step, saves a checkpoint on every
rank, writes a `preempted` event and exits 5; a second signal exits at once (longspec/training/preempt.py).
"""
from longspec.training.loop import main

if __name__ == "__main__":
    main()
