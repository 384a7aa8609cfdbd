"""The stage's target against the families a GLIDE draft supports (longspec.project.targets).

`check_target_family(composed, dialect, ctx) -> [Problem]` reads the target's config.json only
(no torch): an unsupported family or MLP activation is an error with the same sentence `init`
and the trainer refuse with; fp16 training of a bf16 target is a warning (bf16 weights can
overflow fp16). Targets that are not local folders are checked by `check_paths`, the position
limit by `check_seq_len`.
"""

from __future__ import annotations

import json

from longspec.project import targets
from longspec.project.checks.common import CHECKPOINT_RE, Context, abs_path, usable
from longspec.project.composed import Composed
from longspec.project.problem import Problem


def check_target_family(c: Composed, d: str, ctx: Context) -> list[Problem]:
    model = c.get("model_name_or_path")
    if not usable(model) or CHECKPOINT_RE.search(model):
        return []
    cfg = abs_path(ctx, model) / "config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []                        # missing folder / config.json: check_paths says so
    if not isinstance(data, dict) or "model_type" not in data:
        return []                        # not a transformers config: the trainer's loading says why
    problem = targets.config_refusal(data)
    if problem is not None:
        return [c.problem("error", "model_name_or_path", f"model_name_or_path {abs_path(ctx, model)}: {problem}",
                          "point model_name_or_path at a target of a supported family")]
    if c.get("precision") == "fp16" and targets.precision_of(data) == "bf16":
        return [c.problem("warning", "precision", "precision fp16 but the target's weights are bfloat16 "
                                                  "(torch_dtype): values beyond fp16's range overflow",
                          "use precision: bf16")]
    return []
