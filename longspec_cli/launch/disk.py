"""Disk estimate of one training stage (checkpoints + final weights) against output_dir's free space.

What the trainer writes (longspec/train.py, longspec/model/weights.py), per checkpoint-<step>/:
    draft_model_weights.pth + .safetensors   every draft parameter, twice, at the precision's bytes
    ds/state/*model_states.pt                 the trainable draft parameters (frozen ones excluded)
    ds/state/*optim_states.pt                 Adam under ZeRO >= 1: fp32 master + 2 fp32 moments
                                              = 12 bytes per trainable parameter, summed over the
                                              ranks' shards (the same total for ZeRO-1/2/3, offloaded
                                              or not: offload moves the states in RAM, not on disk);
                                              without ZeRO: the 2 moments (+ an fp32 master in bf16/fp16)
    ds/zero_to_*.py, checkpoint.json          ~50 KB
The newest checkpoint is complete before the oldest beyond save_total_limit is removed, so the
peak is (save_total_limit + 1) checkpoints; plus the final weights (.pth + .safetensors), and the
best draft (best/: the same two files) when the simulated-tau evaluation is on (eval_steps > 0).
The model sizes come from longspec.machine.memory (one owner of the parameter counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longspec.runs.diskspace import free_bytes, human
from longspec.machine.memory import PRECISION_BYTES, StageShape

CHECKPOINT_FIXED_BYTES = 50_000  # DeepSpeed's zero_to_fp32.py / zero_to_torch.py copies + checkpoint.json


@dataclass(frozen=True)
class DiskEstimate:
    checkpoint: int        # bytes of one checkpoint-<step>/
    kept: int              # checkpoints on disk at the peak
    final: int             # final weights
    free: int | None       # free bytes on output_dir's filesystem
    where: str             # the folder whose filesystem was measured
    best: int = 0          # best/: the draft with the highest simulated tau (0 when that is off)

    @property
    def total(self) -> int:
        return self.checkpoint * self.kept + self.final + self.best

    def _parts(self) -> str:
        best = f" + best draft {human(self.best)}" if self.best else ""
        return f"{self.kept} checkpoint(s) x {human(self.checkpoint)} + final weights {human(self.final)}{best}"

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def line(self) -> str:
        return f"disk estimate: {human(self.total)} ({self._parts()}); {human(self.free)} free on the disk of {self.where}"

    def warning(self) -> str | None:
        if self.fits:
            return None
        return (f"the run needs ~{human(self.total)} on disk ({self._parts()}) but the disk of {self.where} "
                f"has {human(self.free)} free; "
                f"it would fail part-way. Free some space, lower save_total_limit, or choose another output_dir")


def checkpoint_bytes(shape: StageShape) -> int:
    p = PRECISION_BYTES[shape.precision]
    total, trainable = shape.size.draft_params()
    weights = 2 * total * p                           # .pth + .safetensors twin
    module = trainable * p                            # DeepSpeed's module states
    if shape.zero_stage >= 1:
        optim = 12 * trainable
    else:
        optim = (8 if p == 4 else 12) * trainable
    return weights + module + optim + CHECKPOINT_FIXED_BYTES


def checkpoints_kept(save_total_limit: int | None, max_steps: int | None, save_steps: int | None) -> int:
    """Checkpoints on disk at the peak: the limit + the newest one being written (0/None = keep all:
    the number of saves of max_steps, or the limit-less worst case unknown -> 1 more than counted)."""
    if save_total_limit and save_total_limit > 0:
        saves = math.ceil(max_steps / save_steps) if max_steps and save_steps else None
        return min(save_total_limit + 1, saves) if saves else save_total_limit + 1
    if max_steps and save_steps:
        return max(1, math.ceil(max_steps / save_steps))
    return 1


def estimate(shape: StageShape, output_dir, *, save_total_limit: int | None, max_steps: int | None,
             save_steps: int | None, keeps_best: bool = False) -> DiskEstimate:
    total, _ = shape.size.draft_params()
    final = 2 * total * PRECISION_BYTES[shape.precision]
    return DiskEstimate(checkpoint=checkpoint_bytes(shape),
                        kept=checkpoints_kept(save_total_limit, max_steps, save_steps),
                        final=final, free=free_bytes(output_dir), where=str(output_dir),
                        best=final if keeps_best else 0)
