"""`longspec validate`: every problem of a project or stage file, as a list of Problems.

    validate_paths([PATH, ...], world_size=None) -> Report(problems, info, files)

A PATH is a project folder (longspec.yaml + conf/), a longspec.yaml, a single stage YAML (ours
or upstream's), or a folder of stage YAMLs. Each check is a small function taking the composed
config; none raises for bad input. Pure: no torch, deepspeed, transformers; Hydra composes (project.hydracompose).

    checks/stage.py    one composed stage file: keys, types, paths, precision, ZeRO, batch, length
    checks/project.py  the chain, lineage forks, the manifest's run folders, multi-node paths
    here             which files to check, the Report, fragments (a DeepSpeed file on its own)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from longspec.project import schema as S
from longspec.project.checks.common import Context
from longspec.project.checks.project import WEIGHTS_NAMES  # noqa: F401 (re-exported)
from longspec.project.checks.project import (check_checkpoint_chain, check_upstream_lineage, manifest_checks,
                                              manifest_problem, stage_in_project)
from longspec.project.checks.stage import DUPLICATES, LONG_CONTEXT, REQUIRED  # noqa: F401 (re-exported)
from longspec.project.checks.stage import (check_batch, check_duplicates, check_paths, check_precision,
                                            check_required, check_seq_len, check_types, check_unknown_keys,
                                            check_zero, global_batch, zero_stage)
from longspec.project.checks.seqpar import check_sequence_parallel
from longspec.project.checks.target import check_target_family
from longspec.project.composed import Composed
from longspec.project.hydracompose import compose_stage, stage_overrides
from longspec.project.problem import Problem
from longspec.errors import LongspecError, UsageError

__all__ = ["Problem", "Report", "validate_paths", "validate_file", "validate_project"]

DEFAULT_WORLD = 8


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)  # errors and warnings
    info: list[Problem] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)

    def add(self, items: list[Problem]) -> None:
        """Append, once: a file shared by several stages (a DeepSpeed block) is reported once."""
        for p in items:
            target = self.info if p.severity == "info" else self.problems
            if p not in target:
                target.append(p)

    def count(self, severity: str) -> int:
        return sum(p.severity == severity for p in self.problems)

    def strict(self) -> "Report":
        """Warnings promoted to errors (--strict)."""
        promoted = [Problem("error", p.file, p.line, p.key, p.message, p.hint) if p.severity == "warning" else p
                    for p in self.problems]
        return Report(promoted, self.info, self.files)

    def to_json(self) -> dict[str, Any]:
        errors = self.count("error")
        return {"ok": errors == 0, "errors": errors, "warnings": self.count("warning"),
                "problems": [p.to_json() for p in self.problems],
                "info": [p.to_json() for p in self.info], "files": self.files}


# ---------------------------------------------------------------- one file

FILE_CHECKS: tuple[Callable[[Composed, str, Context], list[Problem]], ...] = (
    check_unknown_keys, check_types, check_required, check_paths, check_precision, check_duplicates,
    check_zero, check_batch, check_seq_len, check_checkpoint_chain, check_upstream_lineage,
    check_target_family, check_sequence_parallel,
)


def _check_file(c: Composed, ctx: Context) -> tuple[list[Problem], dict[str, Any]]:
    problems = list(c.problems)
    summary: dict[str, Any] = {"file": str(c.path), "stage": getattr(ctx.stage, "name", None)}
    if not c.data:
        return problems, summary
    d = c.dialect
    if d in (S.DEEPSPEED, S.HYDRA):
        return _check_fragment(c, d, ctx, problems), {**summary, "dialect": d}
    for check in FILE_CHECKS:
        problems += check(c, d, ctx)
    summary.update(dialect=d, world_size=ctx.world, global_batch=global_batch(c, ctx),
                   zero_stage=zero_stage(c), max_seq_length=c.get(S.KEYS[d]["max_seq_length"]))
    return problems, summary


def _check_fragment(c: Composed, d: str, ctx: Context, problems: list[Problem]) -> list[Problem]:
    """A DeepSpeed or Hydra file given on its own: its ${...} point into the stage that includes it."""
    if d == S.HYDRA:
        return problems + [c.problem("info", None, "Hydra settings, not a stage config: checked for syntax only")]
    wrapped = Composed(c.path, True, {"ds_cfg": c.data}, {f"ds_cfg.{k}": v for k, v in c.origins.items()},
                       {}, c.files, dialect=S.LONGSPEC)
    problems += check_unknown_keys(wrapped, S.LONGSPEC, ctx, {"ds_cfg": S.DS_SPEC})
    problems += check_types(wrapped, S.LONGSPEC, ctx) + check_zero(wrapped, S.LONGSPEC, ctx)
    return problems + [c.problem("info", None, "DeepSpeed config on its own: its ${...} are filled in by the stage "
                                               "config that lists it in `defaults`")]


def validate_file(path: Path, world_size: int | None = None, cache: dict | None = None,
                  overrides: list[str] = (), world_from: str | None = None) -> Report:
    world, src = (world_size, world_from or "--world-size") if world_size else (DEFAULT_WORLD, "default")
    ctx = Context(base_dir=Path.cwd(), world=world, world_from=src)
    c = compose_stage(path, list(overrides))
    problems, summary = _check_file(c, ctx)
    rep = Report(files=[summary])
    rep.add(problems)
    return rep


# ---------------------------------------------------------------- projects

def validate_project(root: Path, world_size: int | None = None, cache: dict | None = None,
                     only: Path | None = None, overrides: list[str] = (),
                     world_from: str | None = None) -> Report:
    """Every stage of the project at `root` (only the stage whose config is `only`, if given)."""
    from longspec.project.manifest import load_manifest

    rep = Report()
    try:
        m = load_manifest(root)
    except LongspecError as e:  # YamlError carries path and line
        rep.add([Problem("error", str(getattr(e, "path", None) or root / "longspec.yaml"),
                         getattr(e, "line", None) or 1, None, getattr(e, "reason", e.message), e.hint)])
        return rep
    cache = {} if cache is None else cache
    if world_size:
        world, src = world_size, world_from or "--world-size"
    else:
        world, src = m.launch.gpus * m.launch.nodes, f"launch: {m.launch.gpus} GPUs x {m.launch.nodes} nodes"
    problems = manifest_checks(m) if only is None else []
    for i, st in enumerate(m.stages):
        if only is not None and st.config.resolve() != only.resolve():
            continue
        if not st.config.is_file():
            problems.append(manifest_problem(m, st.line, "config", "error",
                                             f"stage {st.name}: config {st.config} does not exist"))
            continue
        ctx = Context(base_dir=m.root, world=world, world_from=src, manifest=m, stage=st,
                      earlier={s.output_dir: s.name for s in m.stages[:i]})
        c = compose_stage(st.config, stage_overrides(st.output_dir, list(overrides)))
        file_problems, summary = _check_file(c, ctx)
        problems += file_problems + (stage_in_project(c, st, m, ctx) if c.ok else [])
        problems += _prepared_info(c, m, world) + _regen_target(c, m)
        rep.files.append(summary)
    rep.add(problems)
    return rep


def _prepared_info(c, m, world: int) -> list[Problem]:
    """An info line: the stage's prepared data (tokens, epochs covered) or that it is not ready."""
    from longspec.formats.prepared import prepared_note, prepared_warnings, stage_prepared

    if not c.ok:
        return []
    st = stage_prepared(c.data, m.root, world)
    return ([c.problem("warning" if st.state == "refused" else "info", "train_file", prepared_note(st))]
            + [c.problem("warning", "train_file", w) for w in prepared_warnings(st)])


def _regen_target(c, m) -> list[Problem]:
    """A warning when the train_file is a regeneration folder written by another target
    (runs.regenstate: the digest the manifest holds against the stage's target now). A train_file
    that is no folder is no regeneration folder: runs.regenstate (psutil) is imported only for one."""
    train, target = (c.get(k) if c.ok else None for k in ("train_file", "model_name_or_path"))
    if not (isinstance(train, str) and isinstance(target, str)):
        return []
    base = Path(m.root)
    train_path, target_path = (Path(v) if Path(v).is_absolute() else base / v for v in (train, target))
    if not train_path.is_dir():
        return []
    from longspec.runs.regenstate import other_target

    why = other_target(train_path, target_path)
    return [c.problem("warning", "train_file", why,
                      "the draft would learn another model's answers, not its target's")] if why else []


# ---------------------------------------------------------------- entry point

def _project_of(stage_file: Path) -> Path | None:
    for folder in list(stage_file.resolve().parents)[:4]:
        if (folder / "longspec.yaml").is_file():
            return folder
    return None


def _stage_files(folder: Path) -> list[Path]:
    for sub in (folder / "conf" / "exp", folder / "exp", folder):
        files = sorted(p for p in sub.glob("*.yaml") if p.is_file()) if sub.is_dir() else []
        if files:
            return files
    return []


def validate_paths(paths: list[str | os.PathLike], world_size: int | None = None,
                   overrides: list[str] = (), world_from: str | None = None) -> Report:
    """Validate every PATH (each stage composed with `overrides`, as `run` passes them to the trainer);
    UsageError (exit 2) for a path that does not exist. `world_from` says where `world_size` came
    from, in the caller's flags (default: validate's --world-size)."""
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    items = [Path(p) for p in paths]
    missing = [p for p in items if not p.exists()]
    if missing:
        raise UsageError(f"{missing[0]}: no such file or folder",
                         hint="give a project folder (with longspec.yaml) or a stage YAML file")
    rep = Report()
    cache: dict = {}
    for p in items:
        if p.is_dir():
            if (p / "longspec.yaml").is_file():
                sub = validate_project(p, world_size, cache, overrides=overrides, world_from=world_from)
            else:
                files = _stage_files(p)
                if not files:
                    raise UsageError(f"{p} holds no longspec.yaml and no stage YAML files",
                                     hint="give a project folder made by `longspec init`, or a stage YAML")
                sub = Report()
                for f in files:
                    _merge_reports(sub, validate_file(f, world_size, cache, overrides, world_from))
        elif p.name == "longspec.yaml":
            sub = validate_project(p.parent, world_size, cache, overrides=overrides, world_from=world_from)
        else:
            sub = _validate_stage_file(p, world_size, cache, overrides, world_from)
        _merge_reports(rep, sub)
    return rep


def _validate_stage_file(p: Path, world_size: int | None, cache: dict, overrides: list[str] = (),
                         world_from: str | None = None) -> Report:
    project = _project_of(p)
    if project is not None:
        try:
            from longspec.project.manifest import load_manifest

            listed = any(s.config.resolve() == p.resolve() for s in load_manifest(project).stages)
        except LongspecError:
            listed = False
        if listed:
            return validate_project(project, world_size, cache, only=p, overrides=overrides,
                                    world_from=world_from)
    return validate_file(p, world_size, cache, overrides, world_from)


def _merge_reports(into: Report, other: Report) -> None:
    into.add(other.problems + other.info)
    into.files += other.files
