"""What the validate checks share: the check Context, path helpers and `where` strings."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.project.composed import Composed, Origin
from longspec.project.manifest import resolve_path
from longspec.project.placeholders import has_placeholder

CHECKPOINT_RE = re.compile(r"(?:^|/)checkpoint-(?:last|best|\d+)(?:/|$)")


@dataclass
class Context:
    base_dir: Path  # relative paths in a stage file resolve against this
    world: int
    world_from: str
    manifest: Any = None  # manifest.Manifest
    stage: Any = None  # manifest.StageSpec
    earlier: dict[Path, str] = field(default_factory=dict)  # output_dir -> name, stages before this one


def abs_path(ctx: Context, value: str) -> Path:
    return Path(os.path.normpath(resolve_path(ctx.base_dir, value)))


def usable(value: Any) -> bool:
    """A path-like text worth checking on disk (not a placeholder, not an unresolved ${...})."""
    return isinstance(value, str) and bool(value.strip()) and "${" not in value and not has_placeholder(value)


def where_origin(c: Composed, o: Origin) -> str:
    """`line 12` in the stage file itself, `deepspeed/zero1.yaml:18` elsewhere."""
    if o.kind == "override":
        return "command-line override"
    if o.kind == "default":
        return f"trainer default (config.yaml:{o.line})" if o.line else "trainer default"
    if o.file == c.path:
        return f"line {o.line}" if o.line else c.path.name
    name = f"{o.file.parent.name}/{o.file.name}" if o.file.parent.name else o.file.name
    return f"{name}:{o.line}" if o.line else name


def where_set(c: Composed, key: str) -> str:
    return where_origin(c, c.origin(key))


def is_under(p: Path, folder: Path) -> bool:
    return p == folder or folder in p.parents


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)
