"""Target presets, stage defaults and variants, read from the shipped templates/ folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from longspec.errors import UsageError

STAGE_ORDER = ("base", "long", "longcot")
VARIANTS = ("standard", "sinkpi-slicing")
LEGACY_VARIANTS = {"sinkpi": "sinkpi-slicing"}   # older manifests
PRECISIONS = ("bf16", "fp16", "fp32")


def templates_dir() -> Path:
    """The templates folder: top-level in a checkout, `longspec/_templates` in a wheel."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "templates", here / "_templates"):
        if (candidate / "presets.yaml").is_file():
            return candidate
    raise FileNotFoundError("longspec templates not found (broken install?)")


@lru_cache(maxsize=None)
def _read(name: str) -> dict[str, Any]:
    from longspec.files.yamlio import load_mapping, to_plain

    return to_plain(load_mapping(templates_dir() / name).data)


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    target: str
    context: int
    eos_token: str | None
    eos_token_id: int | None
    pad_token_id: int | None
    max_offset: int
    precision: str
    gpus: int = 8
    size: dict[str, int] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        """Built on this machine (the tiny preset) rather than a path or hub id."""
        return self.target == "local"


def preset_names() -> list[str]:
    return list(_read("presets.yaml"))


def get_preset(name: str) -> Preset:
    table = _read("presets.yaml")
    if name not in table:
        import difflib

        close = difflib.get_close_matches(name, table, n=1)
        raise UsageError(
            f"unknown preset {name!r}",
            hint=(f"did you mean {close[0]!r}? " if close else "") + "presets: " + ", ".join(table),
        )
    return Preset(name=name, **table[name])


def stage_defaults(stage: str, preset: Preset | None = None) -> dict[str, Any]:
    """The stage's values from templates/stages.yaml, with the preset's per-stage overrides."""
    values = dict(_read("stages.yaml")[stage])
    if preset is not None:
        values.update(preset.stages.get(stage, {}))
    return values


def variant_values(variant: str, stage: str | None = None) -> dict[str, Any]:
    """The training keys of a variant; with ``stage``, also ``reference``: the reference
    experiment file that stage mirrors."""
    table = _read("variants.yaml")
    if variant not in table:
        raise UsageError(f"unknown variant {variant!r}", hint="variants: " + ", ".join(table))
    values = dict(table[variant])
    refs = values.pop("reference", {}) or {}
    if stage is not None:
        values["reference"] = refs.get(stage, "(none)")
    return values


def default_max_offset(context: int) -> int:
    """Anchor-offset range: 0-15k for targets of at most 16k positions, else 0-30k."""
    return 15000 if context <= 16384 else 30000
