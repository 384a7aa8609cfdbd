"""longspec.yaml: the project manifest (stages, their configs, run folders and chaining).

    name: demo
    preset: tiny            # or null
    variant: sinkpi-slicing # standard | sinkpi-slicing (LongSpec's two families)
    target: /abs/path/to/target
    launch: {gpus: 8, nodes: 1, hostfile: null}
    stages:
      - {name: base, config: conf/exp/base.yaml, output_dir: runs/base, draft_from: null}
      - {name: long, config: conf/exp/long.yaml, output_dir: runs/long, draft_from: base}

Relative paths resolve against the folder that holds longspec.yaml. Every shape or type
mistake is an InputError that names file:line.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.files import yamlio
from longspec.files.yamlio import item_line, key_line
from longspec.errors import UsageError

MANIFEST_NAME = "longspec.yaml"
VARIANTS = ("standard", "sinkpi-slicing")
LEGACY_VARIANTS = {"sinkpi": "sinkpi-slicing"}   # the name older manifests used
TOP_KEYS = ("name", "preset", "variant", "target", "launch", "stages")
STAGE_KEYS = ("name", "config", "output_dir", "draft_from", "draft_pick")
DRAFT_PICKS = ("final", "best")  # which draft of the draft_from stage a stage starts from
LAUNCH_KEYS = ("gpus", "nodes", "hostfile")


@dataclass(frozen=True)
class StageSpec:
    name: str
    config: Path  # absolute: the stage's experiment YAML
    output_dir: Path  # absolute: the run folder
    draft_from: str | None  # name of an earlier stage, or None (fresh draft)
    line: int | None = None  # line of this entry in longspec.yaml
    draft_pick: str = "final"  # final | best (the upstream's best/ draft: `next-stage --best` records it)


@dataclass(frozen=True)
class Launch:
    gpus: int = 1
    nodes: int = 1
    hostfile: Path | None = None


@dataclass
class Manifest:
    path: Path  # the longspec.yaml file (absolute)
    root: Path  # its folder (absolute)
    name: str
    preset: str | None
    variant: str
    target: Path | None
    launch: Launch
    stages: list[StageSpec]
    unknown_keys: list[tuple[str, int | None]] = field(default_factory=list)  # for `validate` warnings

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def index(self, name: str) -> int:
        for i, s in enumerate(self.stages):
            if s.name == name:
                return i
        raise UsageError(f"no stage named {name!r} in {self.path}", hint=_did_you_mean(name, self.stage_names)
                         or f"stages: {', '.join(self.stage_names)}")

    def stage(self, name: str) -> StageSpec:
        return self.stages[self.index(name)]

    def previous(self, name: str) -> StageSpec | None:
        """The stage whose final draft `name` starts from (its draft_from), or None."""
        spec = self.stage(name)
        return self.stage(spec.draft_from) if spec.draft_from else None


def find_manifest(path: str | os.PathLike) -> Path:
    """The longspec.yaml for `path` (a project folder or the manifest file itself)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file or folder", hint="give the project folder made by `longspec init`")
    if p.is_dir():
        m = p / MANIFEST_NAME
        if not m.is_file():
            raise UsageError(f"{p} is not a longspec project (no {MANIFEST_NAME})",
                             hint=f"create one with `longspec init {p}`")
        return m.absolute()
    return p.absolute()


def load_manifest(project: str | os.PathLike) -> Manifest:
    """Read and check DIR/longspec.yaml (or the given manifest file)."""
    path = find_manifest(project)
    doc = yamlio.load_mapping(path)
    return _build(doc, path)


def _build(doc: yamlio.YamlDoc, path: Path) -> Manifest:
    data, root = doc.data, path.parent

    def err(msg: str, key: str | None = None, line: int | None = None, hint: str | None = None):
        raise yamlio.YamlError(path, msg, line=line if line is not None else (doc.line_of(key) if key else None),
                               hint=hint)

    unknown = [(str(k), doc.line_of(str(k))) for k in data if k not in TOP_KEYS]

    name = data.get("name", path.parent.name)
    if not isinstance(name, str) or not name.strip():
        err("`name` must be a non-empty string", "name")
    preset = data.get("preset")
    if preset is not None and not isinstance(preset, str):
        err("`preset` must be a string or null", "preset")
    variant = data.get("variant", "sinkpi-slicing")
    variant = LEGACY_VARIANTS.get(variant, variant) if isinstance(variant, str) else variant
    if variant not in VARIANTS:
        err(f"`variant` must be one of {', '.join(VARIANTS)}; got {variant!r}", "variant",
            hint=_did_you_mean(str(variant), VARIANTS))
    target = data.get("target")
    if target is not None and not isinstance(target, str):
        err("`target` must be a path (string) or null", "target")
    if isinstance(target, str) and "\0" in target:
        err("`target` contains a NUL character", "target")

    launch = _launch(data.get("launch"), doc, err, root)
    stages = _stages(data.get("stages"), doc, err, root)
    return Manifest(path=path, root=root, name=str(name), preset=preset, variant=str(variant),
                    target=resolve_path(root, target) if target else None, launch=launch, stages=stages,
                    unknown_keys=unknown)


def _launch(raw: Any, doc: yamlio.YamlDoc, err, root: Path) -> Launch:
    if raw is None:
        return Launch()
    if not isinstance(raw, dict):
        err("`launch` must be a mapping like {gpus: 8, nodes: 1, hostfile: null}", "launch")
    for k in raw:
        if k not in LAUNCH_KEYS:
            err(f"unknown key `launch.{k}`", f"launch.{k}", hint=_did_you_mean(str(k), LAUNCH_KEYS))
    vals = {}
    for k in ("gpus", "nodes"):
        v = raw.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            err(f"`launch.{k}` must be an integer >= 1; got {v!r}", f"launch.{k}")
        vals[k] = int(v)
    hostfile = raw.get("hostfile")
    if hostfile is not None and (not isinstance(hostfile, str) or "\0" in hostfile):
        err("`launch.hostfile` must be a path or null", "launch.hostfile")
    return Launch(gpus=vals["gpus"], nodes=vals["nodes"], hostfile=resolve_path(root, hostfile) if hostfile else None)


def _stages(raw: Any, doc: yamlio.YamlDoc, err, root: Path) -> list[StageSpec]:
    if raw is None:
        err("missing `stages`: a list of {name, config, output_dir, draft_from}", "stages", line=1)
    if not isinstance(raw, list) or not raw:
        err("`stages` must be a non-empty list of {name, config, output_dir, draft_from}", "stages")
    out: list[StageSpec] = []
    for i, entry in enumerate(raw):
        line = item_line(raw, i) or doc.line_of("stages")
        if not isinstance(entry, dict):
            err(f"stages[{i}] must be a mapping {{name, config, output_dir, draft_from}}", line=line)
        for k in entry:
            if k not in STAGE_KEYS:
                err(f"stages[{i}]: unknown key `{k}`", line=key_line(entry, k) or line,
                    hint=_did_you_mean(str(k), STAGE_KEYS) or f"allowed: {', '.join(STAGE_KEYS)}")
        vals = {}
        for k in ("name", "config", "output_dir"):
            v = entry.get(k)
            if not isinstance(v, str) or not v.strip():
                err(f"stages[{i}].{k} must be a non-empty string; got {v!r}", line=key_line(entry, k) or line)
            if "\0" in v:
                err(f"stages[{i}].{k} contains a NUL character", line=key_line(entry, k) or line)
            vals[k] = v
        names = [s.name for s in out]
        if vals["name"] in names:
            err(f"stages[{i}]: stage name {vals['name']!r} is used twice", line=key_line(entry, "name") or line)
        draft_from = entry.get("draft_from")
        if draft_from is not None:
            if not isinstance(draft_from, str):
                err(f"stages[{i}].draft_from must be a stage name or null", line=key_line(entry, "draft_from") or line)
            if draft_from not in names:
                later = draft_from == vals["name"] or any(
                    isinstance(e, dict) and e.get("name") == draft_from for e in raw[i:])
                why = "must name an earlier stage" if later else "names no stage"
                err(f"stages[{i}].draft_from {draft_from!r} {why}", line=key_line(entry, "draft_from") or line,
                    hint=_did_you_mean(draft_from, names) or (f"earlier stages: {', '.join(names)}" if names else
                                                              "the first stage has draft_from: null"))
        pick = entry.get("draft_pick", "final")
        if pick not in DRAFT_PICKS:
            err(f"stages[{i}].draft_pick must be one of {', '.join(DRAFT_PICKS)}; got {pick!r}",
                line=key_line(entry, "draft_pick") or line, hint="`longspec next-stage --best` sets it")
        output_dir = resolve_path(root, vals["output_dir"])
        if output_dir.exists() and not output_dir.is_dir():
            err(f"stages[{i}].output_dir {str(output_dir)!r} is a file, not a folder",
                line=key_line(entry, "output_dir") or line, hint="point output_dir at a folder (made when the stage runs)")
        out.append(StageSpec(name=vals["name"], config=resolve_path(root, vals["config"]),
                             output_dir=output_dir, draft_from=draft_from, line=line, draft_pick=pick))
    return out


def resolve_path(base: Path, value: str) -> Path:
    """A path as a manifest or a config writes it: `~` expanded, a relative one taken from `base`."""
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else Path(os.path.normpath(base / p))


def same_file(value: Any, path: str | os.PathLike, base: Path) -> bool:
    """Does the path text `value` (relative to `base`) name `path`, symlinks resolved?"""
    if not isinstance(value, str) or not value.strip():
        return False
    return os.path.realpath(resolve_path(base, value)) == os.path.realpath(path)


def _did_you_mean(word: str, choices) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else None
