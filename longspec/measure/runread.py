"""A finished stage's run folder as `eval` and `export` read it, and their user-facing error.

    read_run(run_dir)             (the resolved training config or {}, stage_complete.json or None)
    stage_draft(run_dir, ...)     (stage, draft weights, target, sliding window), flags first
    EvalError(message, code)      a failure with an exit code: 1 refused, 2 usage, 3 unreadable input

The run-folder contract itself (file names, the finished draft) is longspec.runs.runfolder's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from longspec.measure.prompts import conf_get as _get


def stage_draft(run_dir: Path, conf: Mapping, complete: Mapping | None, args) -> tuple[str, Path, Path, int]:
    """(stage, draft weights, target, sliding window) of a run folder; --stage/--draft/--target/
    --sliding-window in ``args`` win over what the run recorded. Shared by eval and export."""
    from longspec.runs import runfolder

    stage = args.stage or _get(conf, "stage") or (complete or {}).get("stage") or run_dir.name
    draft = args.draft
    if draft is None:
        if complete is None:
            raise EvalError(f"stage {stage} has no finished draft ({run_dir} has no stage_complete.json)", 1,
                            hint="train the stage first, or pass --draft PATH")
        draft = runfolder.RunDir(run_dir).weights_for(complete)
    if not draft.exists():
        raise EvalError(f"draft weights not found: {draft}", 1 if args.draft is None else 2)
    target = args.target or as_path(_get(conf, "model_name_or_path")) or as_path((complete or {}).get("target"))
    if target is None:
        raise EvalError(f"{run_dir}: no target recorded (training_config.yaml missing)", 2, hint="pass --target PATH")
    window = args.sliding_window or int(_get(conf, "draft.sliding_window", 512))
    return str(stage), draft, target, window


class EvalError(Exception):
    """A user-facing failure with an exit code (1 refused, 2 usage, 3 unreadable input)."""

    def __init__(self, message: str, code: int = 2, hint: str | None = None):
        super().__init__(message)
        self.message, self.code, self.hint = message, code, hint


# ----------------------------------------------------------------------------- run folder

def read_run(run_dir: Path) -> tuple[dict, dict | None]:
    """(resolved training config or {}, stage_complete.json or None)."""
    from longspec.runs import runfolder
    from longspec.files import yamlio

    if not run_dir.is_dir():
        raise EvalError(f"{run_dir}: no such run folder", 2)
    conf: dict = {}
    cfg_path = run_dir / "training_config.yaml"
    if cfg_path.is_file():
        try:
            conf = yamlio.to_plain(yamlio.load_mapping(cfg_path).data)
        except yamlio.YamlError as e:
            raise EvalError(e.message, 3) from None
    complete, why = runfolder.read_json(run_dir / runfolder.STAGE_COMPLETE)
    if why:
        raise EvalError(why, 3)
    return conf, complete


def as_path(value: Any) -> Path | None:
    return Path(str(value)).expanduser() if value not in (None, "", "???") else None
