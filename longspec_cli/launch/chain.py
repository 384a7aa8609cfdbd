"""next-stage: verify a stage's final draft, then point the next stage's config at it.

The edit is a surgical text edit of ONE line, `draft_model_name_or_path: <absolute path>`
(longspec/files/yamledit.py); the stage is then composed, and the edit kept only when Hydra reads the new
path (else the file is restored).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longspec.runs import runfolder
from longspec.files import yamlio
from longspec.runs.draftpick import DRAFT_KEY, composed_draft, record_pick, upstream_draft
from longspec.project.manifest import Manifest, StageSpec, resolve_path, same_file
from longspec.files.yamledit import set_root_scalar
from longspec.errors import InputError, RefusedError, UsageError

AFTER_KEY = "model_name_or_path"  # a new DRAFT_KEY line goes right after this key's value
BOM = "\ufeff"
DEEPCHECK_CACHE = "deepcheck.json"  # under atomic.cache_root()


# ---------------------------------------------------------------------------------------------
# verifying a draft


@dataclass
class VerifiedDraft:
    path: Path
    sha256: str | None  # None for an HF draft folder
    deep: dict | None = None  # the subprocess check's report, None when torch is not importable or skipped


def verify_stage_draft(spec: StageSpec, target: Path | None, deep: bool | None = None,
                       pick: str = "final") -> VerifiedDraft:
    """The final draft of a finished stage (pick "best": its best/ draft, the highest simulated tau),
    or RefusedError/InputError that says why it is not usable."""
    rd = runfolder.RunDir(spec.output_dir)
    if pick == "best" and rd.stage_complete() is not None:
        best = rd.best()
        if best is None:
            raise RefusedError(f"stage {spec.name} has no best draft ({spec.output_dir}/{runfolder.BEST_INFO} is "
                               "missing or its weights do not match it)",
                               hint="the stage ran with eval_steps=0 or eval_tokens=0; chain its final draft "
                                    "(without --best)")
        weights = Path(best["weights"])
        return VerifiedDraft(weights.absolute(), best["sha256"],
                             run_deep_check(weights, target, best["sha256"]) if deep is not False else None)
    complete = rd.stage_complete()
    if complete is None:
        if rd.stage_complete_error:
            raise InputError(f"stage {spec.name}: {rd.stage_complete_error}",
                             hint="the stage's completion record is damaged; re-run the stage")
        raise RefusedError(f"stage {spec.name} is not complete: no {runfolder.STAGE_COMPLETE} in {spec.output_dir}",
                           hint=f"finish it first (`longspec run`), then check with `longspec status`")
    weights = rd.weights_for(complete)
    if not weights.is_file():
        raise RefusedError(f"stage {spec.name}: final draft {weights} is missing",
                           hint="re-run the stage; its stage_complete.json names a file that is gone")
    from longspec.files.atomic import sha256_file

    sha = sha256_file(weights)
    if sha != complete.get("sha256"):
        raise RefusedError(f"stage {spec.name}: {weights.name} does not match stage_complete.json "
                           f"(sha256 {sha[:12]}... vs {str(complete.get('sha256'))[:12]}...)",
                           hint="the file was truncated or replaced after the run; re-run the stage")
    return VerifiedDraft(weights.absolute(), sha, run_deep_check(weights, target, sha) if deep is not False else None)


def verify_explicit_draft(draft: Path, target: Path | None, deep: bool | None = None) -> VerifiedDraft:
    if not draft.exists():
        raise UsageError(f"{draft}: no such file or folder", hint="--draft takes a .pth, .safetensors or draft folder")
    sha = None
    if draft.is_file():
        from longspec.files.atomic import sha256_file

        sha = sha256_file(draft)
    return VerifiedDraft(Path(os.path.abspath(draft)), sha,
                         run_deep_check(draft, target, sha) if deep is not False else None)


def run_deep_check(draft: Path, target: Path | None, sha: str | None, timeout: float = 600.0) -> dict | None:
    """Load the draft with weights_only=True in a subprocess (never in this process) and check it
    against the target; results for a given (sha256, target) are cached. None without torch."""
    from longspec_cli.launch import trainer
    from longspec.files.atomic import cache_get, cache_put

    if importlib.util.find_spec("torch") is None:
        return None
    cache_key = f"{sha}|{_target_sig(target)}" if sha else None
    hit = cache_get(DEEPCHECK_CACHE, cache_key) if cache_key else None
    if isinstance(hit, dict):
        return {**hit, "cached": True}
    run = trainer.run_module(trainer.draftcheck_argv(draft, target), timeout=timeout)
    if run.timed_out:
        raise InputError(f"checking {draft} took over {timeout:.0f} s",
                         hint="`longspec next-stage --no-deep` chains without the load check")
    report = run.result
    if report is None:
        tail = [line for line in run.tail if line.strip()][-3:]
        raise InputError(f"could not check {draft}: the checker exited {run.code}: {' / '.join(tail)}",
                         hint="`longspec next-stage --no-deep` chains without the load check")
    if not report.get("loadable"):
        raise InputError(f"{draft} cannot be loaded with weights_only=True: {report.get('error')}",
                         hint="a corrupt or unsafe checkpoint; re-run the stage that made it")
    if report.get("problems"):
        shown = "; ".join(report["problems"][:5])
        raise RefusedError(f"{draft} does not fit the target: {shown}",
                           hint="the draft was trained for another target, or the target changed")
    if cache_key:
        cache_put(DEEPCHECK_CACHE, cache_key, report, keep=256)
    return report


def _target_sig(target: Path | None) -> str:
    if target is None:
        return "-"
    cfg = Path(target) / "config.json"
    try:
        st = cfg.stat()
        return f"{os.path.abspath(target)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return f"{os.path.abspath(target)}:no-config"


# ---------------------------------------------------------------------------------------------
# choosing the stage and writing the edit


@dataclass
class ChainResult:
    config: str
    key: str
    old: Any
    new: str
    changed: bool  # the file's text differs after the edit (with --dry-run: would differ)
    written: bool
    draft_sha256: str | None
    stage: str | None = None
    from_stage: str | None = None
    deep_check: dict | None = None
    diff: str = field(default="", repr=False)
    note: str | None = None
    draft_pick: str | None = None  # final | best: which draft of the upstream stage (project mode)
    manifest_changed: bool = False  # longspec.yaml's draft_pick line was written

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("diff")
        return d


def pick_stage(manifest: Manifest, to: str | None, pick: str | None = None) -> tuple[StageSpec, StageSpec] | None:
    """(target stage, stage whose draft it takes); None when every finished upstream is already chained.
    A stage counts as chained when its *composed* draft key points at the upstream's final draft."""
    if to is not None:
        spec = manifest.stage(to)
        prev = manifest.previous(to)
        if prev is None:
            raise UsageError(f"stage {to} has draft_from: null; it starts from a fresh draft",
                             hint="pick a stage that has draft_from in longspec.yaml")
        return spec, prev
    finished = False
    for spec in manifest.stages:
        if not spec.draft_from:
            continue
        prev = manifest.stage(spec.draft_from)
        weights = upstream_draft(prev, pick or spec.draft_pick)
        if weights is None:
            continue
        finished = True
        current, _ = composed_draft(spec.config) if spec.config.is_file() else (None, None)
        if not same_file(current, weights, manifest.root):
            return spec, prev
    if not finished:
        first = next((s.draft_from for s in manifest.stages if s.draft_from), None)
        raise RefusedError("no stage has a finished upstream to take a draft from"
                           + (f" ({first} is not complete)" if first else ""),
                           hint="finish a stage first (`longspec run`); `longspec status` shows where each stands")
    return None


def target_of(config_data: Any, base: Path, fallback: Path | None) -> Path | None:
    """The target model folder for the deep check: the config's model_name_or_path when it is a folder."""
    v = config_data.get(AFTER_KEY) if isinstance(config_data, dict) else None
    if isinstance(v, str) and v and "${" not in v:
        p = resolve_path(base, v)
        if p.is_dir():
            return p
    return fallback if fallback is not None and Path(fallback).is_dir() else None


def _winner(config: Path) -> tuple[Any, Any]:
    """(the composed stage, the Origin that sets DRAFT_KEY last)."""
    from longspec.project.hydracompose import compose_stage

    c = compose_stage(config)
    return c, (c.origins.get(DRAFT_KEY) or [None])[-1]


def _same_path(a: Path | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def _rank(order: list[Path], path: Path) -> int:
    return next((i for i, f in enumerate(order) if _same_path(f, path)), -1)


def _refuse_winner(config: Path, edited: Path, origin: Any, new: str) -> RefusedError:
    if origin is not None and origin.kind == "file" and origin.file is not None:
        where = f"{origin.file}:{origin.line}" if origin.line else str(origin.file)
        return RefusedError(f"{config}: after the edit Hydra still composes {DRAFT_KEY} from {where}, not {new}; "
                            f"nothing changed",
                            hint=f"that file comes later in the defaults list; edit it instead with --in {origin.file}")
    return RefusedError(f"{config}: after the edit {edited} would not decide {DRAFT_KEY}; nothing changed",
                        hint="edit the stage file itself (`--in` names a file of the stage's defaults list)")


def write_draft_key(config: Path, draft: VerifiedDraft, *, dry_run: bool, stage: str | None = None,
                    from_stage: str | None = None, edit_in: Path | None = None,
                    force: bool = False) -> ChainResult:
    """Set DRAFT_KEY to the draft's absolute path (one line) in the stage file, or in `edit_in` (a file
    of its defaults list), atomically under a lock; then compose the stage with Hydra and keep the
    edit only when the composed DRAFT_KEY is the new path (else roll back, RefusedError)."""
    import contextlib

    from longspec.files.atomic import atomic_write_text, locked

    new = str(draft.path)
    before, winner = _winner(config)
    composes = before.ok and not any(p.severity == "error" and p.key in (None, "defaults") for p in before.problems)
    target = Path(edit_in) if edit_in is not None else config
    if edit_in is not None and not any(_same_path(f, target) for f in before.files):
        raise UsageError(f"--in {edit_in}: not a file of {config.name}'s defaults list",
                         hint="files composed: " + ", ".join(str(f) for f in before.files))
    if winner is not None and winner.kind == "file" and not _same_path(winner.file, target) \
            and _rank(before.merge_order, winner.file) > _rank(before.merge_order, target):
        raise _refuse_winner(config, target, winner, new)
    real = Path(os.path.realpath(target))  # a symlinked config is edited through the link
    note = None if composes else (f"{config.name} does not compose with Hydra as it stands "
                                  "(`longspec validate` says why); the edit was checked as text only")
    guard = contextlib.nullcontext() if dry_run else locked(real)
    with guard:
        text = yamlio.read_text(real)
        with open(real, "rb") as f:
            bom = BOM if f.read(3) == b"\xef\xbb\xbf" else ""
        current = yamlio.parse(text, real)
        old = current.get(DRAFT_KEY) if isinstance(current, dict) else None
        if isinstance(old, str) and "${" in old:
            if not force:
                raise RefusedError(f"{target}: {DRAFT_KEY} is an interpolation ({old}); refusing to replace it",
                                   hint="pass --force to replace it with the draft's path")
            note = "; ".join(x for x in (note, f"replaced the interpolation {old} (--force)") if x)
        edit = set_root_scalar(text, DRAFT_KEY, new, real, after=AFTER_KEY)
        written = False
        if edit.changed and not dry_run:
            atomic_write_text(real, bom + edit.new_text)
            written = True
        if written and composes:
            value, why = composed_draft(config)
            if why is not None or not same_file(value, draft.path, config.parent):
                atomic_write_text(real, bom + edit.old_text)  # roll back: nothing changed
                _, winner = _winner(config)
                if why is not None:
                    raise RefusedError(f"{config}: does not compose after the edit ({why}); nothing changed")
                raise _refuse_winner(config, target, winner, new)
    return ChainResult(config=str(target), key=DRAFT_KEY, old=edit.old_value, new=new, changed=edit.changed,
                       written=written, draft_sha256=draft.sha256, stage=stage, from_stage=from_stage,
                       deep_check=draft.deep, diff=edit.diff(str(target)) if edit.changed else "", note=note)


def _draft_target(config: Path, base: Path, fallback: Path | None) -> Path | None:
    from longspec.project.hydracompose import compose_stage

    return target_of(compose_stage(config).data, base, fallback)


def chain_project(manifest: Manifest, to: str | None, *, dry_run: bool, deep: bool | None,
                  edit_in: Path | None = None, force: bool = False, pick: str = "final") -> ChainResult | None:
    """Chain the next stage (or `to`) to its upstream's final draft, or its best one (pick "best");
    the choice is recorded in the manifest (draftpick.record_pick) once the edit is kept."""
    picked = pick_stage(manifest, to, pick)
    if picked is None:
        return None
    spec, prev = picked
    if not spec.config.is_file():
        raise UsageError(f"stage {spec.name}: config {spec.config} does not exist",
                         hint="fix `config` in longspec.yaml")
    yamlio.load_mapping(spec.config)  # bad YAML -> exit 3 before anything else happens
    draft = verify_stage_draft(prev, _draft_target(spec.config, manifest.root, manifest.target), deep, pick)
    result = write_draft_key(spec.config, draft, dry_run=dry_run, stage=spec.name, from_stage=prev.name,
                             edit_in=edit_in, force=force)
    result.draft_pick = pick
    if not dry_run:
        result.manifest_changed = record_pick(manifest, spec.name, pick)
    return result


def chain_explicit(config: Path, draft_path: Path, *, dry_run: bool, deep: bool | None,
                   edit_in: Path | None = None, force: bool = False) -> ChainResult:
    if not config.exists():
        raise UsageError(f"{config}: no such file", hint="--config takes a stage YAML")
    yamlio.load_mapping(config)
    draft = verify_explicit_draft(draft_path, _draft_target(config, config.parent, None), deep)
    return write_draft_key(config, draft, dry_run=dry_run, edit_in=edit_in, force=force)
