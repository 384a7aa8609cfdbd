"""One typed view of a composed stage: the settings the preflight, eval's checks, the evaluator and
the prompts read, each with the trainer's own default (longspec/conf/config.yaml, read once).

    view = StageView.of(composed)      # the composed stage (or a run's training_config.yaml) as a dict
    view.max_seq_length                # data.max_seq_length, or config.yaml's default

A value that does not fit the schema (project.schema: type, range, choices) reads as the default:
validation reports it; the readers here only need a number to work with. Pure: no torch, no Hydra.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# view field -> where it lives in a composed stage (longspec dialect, project.schema's key table)
PATHS = {
    "target": "model_name_or_path",
    "precision": "precision",
    "collator": "data.collator",
    "max_seq_length": "data.max_seq_length",
    "on_bad_record": "data.on_bad_record",
    "per_gpu_train_batch_size": "per_gpu_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "loss_chunk_size": "loss_chunk_size",
    "sliding_window": "draft.sliding_window",
    "sequence_parallel_size": "sequence_parallel_size",
    "kernels": "kernels",
    "seed": "seed",
}


def lookup(conf: Any, dotted: str, default: Any = None) -> Any:
    """`conf["a"]["b"]` for "a.b"; `default` where a level is missing or not a mapping."""
    cur = conf
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


@functools.lru_cache(maxsize=None)
def _defaults_of(config_yaml: str) -> dict:
    from longspec.files import yamlio

    return yamlio.to_plain(yamlio.load_mapping(config_yaml).data)


def trainer_defaults() -> dict:
    """The trainer's primary config (longspec/conf/config.yaml, every key with its default), read once."""
    from longspec.project.hydracompose import trainer_conf_dir

    return _defaults_of(str(trainer_conf_dir() / "config.yaml"))


def default(dotted: str) -> Any:
    """One key's default as config.yaml writes it ("data.max_seq_length" -> 1024)."""
    return lookup(trainer_defaults(), dotted)


def _fits(dotted: str, value: Any) -> bool:
    from longspec.project import schema as S

    spec, table = None, S.LONGSPEC_SPEC
    for part in dotted.split("."):
        spec = table.get(part) if isinstance(table, dict) else None
        if spec is None:
            return True                       # a key the schema leaves free
        table = spec.children
    if spec.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return False
    return value is not None and S.check_value(spec, value, dotted, S.LONGSPEC) is None


@dataclass(frozen=True)
class StageView:
    target: str | None
    precision: str
    collator: str
    max_seq_length: int
    on_bad_record: str
    per_gpu_train_batch_size: int
    gradient_accumulation_steps: int
    loss_chunk_size: int
    sliding_window: int
    sequence_parallel_size: int
    kernels: str
    seed: int

    @classmethod
    def of(cls, conf: Any) -> "StageView":
        """The view of a composed stage (a dict; anything else reads as all defaults)."""
        conf = conf if isinstance(conf, dict) else {}
        values = {}
        for f in fields(cls):
            dotted = PATHS[f.name]
            value = lookup(conf, dotted)
            values[f.name] = value if _fits(dotted, value) else default(dotted)
        if not isinstance(values["target"], str) or values["target"] == "???":
            values["target"] = None
        return cls(**values)

    @classmethod
    def of_run(cls, run_dir: str | Path) -> "StageView":
        """The view of a run's training_config.yaml (what the trainer composed); files.yamlio's
        YamlError when it cannot be read."""
        from longspec.files import yamlio

        return cls.of(yamlio.to_plain(yamlio.load_mapping(Path(run_dir) / "training_config.yaml").data))
