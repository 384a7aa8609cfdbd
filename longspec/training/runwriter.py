"""The trainer's side of the run-folder contract (docs/DESIGN.md): what it writes into output_dir.

    metrics.jsonl          append, rank 0: step records and start/resume/checkpoint/end/error events
    tensorboard/           only with logging.tensorboard=true (wandb: logging.wandb=true)
    training_config.yaml   the resolved config, atomic
    checkpoint-<step>/     draft_model_weights.pth (+ .safetensors), ds/, checkpoint.json LAST
    stage_complete.json    atomic, the very last file of a finished stage

Readers live in longspec.runs.runfolder; the names, the fingerprint and the metrics line format
come from there so both sides agree. Only rank 0 writes (the caller passes `enabled`).
"""
from __future__ import annotations

import math
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from longspec.runs import runfolder
from longspec.files.atomic import atomic_write_json, atomic_write_text, sha256_file

CHECKPOINT_PREFIX = "checkpoint-"
DS_STATE = "ds"            # DeepSpeed's engine state inside a checkpoint folder
DS_TAG = "state"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class RunWriter:
    """Writes one stage's run folder. `enabled=False` (ranks > 0) makes every write a no-op."""

    def __init__(self, output_dir: str | Path, enabled: bool = True):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.read = runfolder.RunDir(self.dir)

    # ------------------------------------------------------------------ metrics.jsonl
    def _append(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            runfolder.append_metrics(self.dir / runfolder.METRICS, record)

    def event(self, name: str, step: int, **fields: Any) -> None:
        self._append({"event": name, "step": int(step), "time": time.time(), **fields})

    def record(self, record: dict[str, Any]) -> None:
        """Another metrics line kind (`{"record": KIND, "step", ...}`; runfolder says what each means)."""
        self._append({**record, "time": time.time()})

    def step_record(self, *, step: int, total_steps: int, loss: float, llm_loss: float | None,
                    lr: float, tokens_per_s: float, elapsed_s: float) -> None:
        self._append({
            "step": int(step), "total_steps": int(total_steps), "loss": _finite(loss),
            "llm_loss": _finite(llm_loss), "lr": float(lr), "tokens_per_s": round(tokens_per_s, 2),
            "elapsed_s": round(elapsed_s, 3), "time": time.time(),
        })

    # ------------------------------------------------------------------ config + completion
    def write_training_config(self, yaml_text: str) -> None:
        if self.enabled:
            atomic_write_text(self.dir / "training_config.yaml", yaml_text)

    def stage_complete(self) -> dict | None:
        return self.read.stage_complete()

    def clear_stage_complete(self) -> None:
        """A stage being (re)trained is not complete: drop the marker before the first step."""
        if self.enabled:
            (self.dir / runfolder.STAGE_COMPLETE).unlink(missing_ok=True)

    def write_stage_complete(self, *, stage: str, steps: int, final_loss: float | None, target: str,
                             config_sha256: str, draft_sha256: str | None, weights: Path,
                             math: dict[str, Any] | None = None) -> dict:
        info = {
            "stage": stage, "steps": int(steps), "final_loss": _finite(final_loss),
            "sha256": sha256_file(weights), "target": target, "config_sha256": config_sha256,
            "draft_sha256": draft_sha256, "finished_at": now_iso(),
            "weights": weights.name if weights.parent == self.dir else str(weights),
            **({"math": math} if math is not None else {}),  # what `status` compares after an edit
        }
        if self.enabled:
            atomic_write_json(self.dir / runfolder.STAGE_COMPLETE, info)
        return info

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_dir(self, step: int) -> Path:
        return self.dir / f"{CHECKPOINT_PREFIX}{step}"

    def complete_checkpoints(self) -> list[runfolder.Checkpoint]:
        """Checkpoints whose checkpoint.json exists, oldest first."""
        return self.read.checkpoints()

    def all_checkpoint_dirs(self) -> list[tuple[int, Path]]:
        out = []
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                tail = p.name[len(CHECKPOINT_PREFIX):]
                if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and tail.isdigit():
                    out.append((int(tail), p))
        return sorted(out)

    def prepare_checkpoint(self, step: int) -> Path:
        """An empty checkpoint-<step>/ (a leftover incomplete one from a crash is removed)."""
        path = self.checkpoint_dir(step)
        if self.enabled:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        return path

    def mark_checkpoint(self, path: Path, info: dict[str, Any]) -> None:
        """checkpoint.json, written last: from now on the checkpoint counts as complete."""
        if self.enabled:
            atomic_write_json(path / runfolder.CHECKPOINT_INFO, {**info, "saved_at": now_iso()})

    def rotate(self, keep: int | None, current_step: int) -> list[Path]:
        """Keep the newest `keep` complete checkpoints (None or 0 = all); drop incomplete ones older
        than `current_step` (left by a crash). Returns what was removed."""
        if not self.enabled:
            return []
        removed = []
        complete = {c.step for c in self.complete_checkpoints()}
        for step, path in self.all_checkpoint_dirs():
            if step not in complete and step < current_step:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        if keep:
            for c in self.complete_checkpoints()[:-keep]:
                shutil.rmtree(c.path, ignore_errors=True)
                removed.append(c.path)
        return removed

    def drop_incomplete_checkpoints(self) -> list[Path]:
        """Remove checkpoint folders without checkpoint.json (a save that failed part-way)."""
        if not self.enabled:
            return []
        complete = {c.step for c in self.complete_checkpoints()}
        dropped = [path for step, path in self.all_checkpoint_dirs() if step not in complete]
        for path in dropped:
            shutil.rmtree(path, ignore_errors=True)
        return dropped

    def remove_all_checkpoints(self) -> None:
        if self.enabled:
            for _, path in self.all_checkpoint_dirs():
                shutil.rmtree(path, ignore_errors=True)


def fingerprint(exp_file: str | Path | None, overrides: list[str]) -> str | None:
    """config_sha256 of a stage (the same function `longspec status` uses)."""
    if exp_file is None:
        return None
    return runfolder.config_fingerprint(exp_file, overrides)


class Trackers:
    """TensorBoard / Weights & Biases, each only when its logging.* key is true; rank 0 only."""

    def __init__(self, conf: dict[str, Any], out_dir: Path, enabled: bool):
        self.tb = self.wb = None
        if not enabled:
            return
        if conf["logging"]["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if conf["logging"]["wandb"]:
            import wandb

            self.wb = wandb.init(project="longspec", name=f"{conf['stage']}-{out_dir.name}",
                                 dir=str(out_dir), config=conf, resume="allow")

    def log(self, step: int, values: dict[str, float | None]) -> None:
        values = {f"train/{k}": v for k, v in values.items() if v is not None}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.wb is not None:
            self.wb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def clock(seconds: float) -> str:
    """H:MM:SS, for an ETA."""
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
