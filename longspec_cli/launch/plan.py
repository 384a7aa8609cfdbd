"""`longspec run`, step 1: what each stage will do, and the types a run passes around.

    plan      status of every stage (runs.status) -> skip (done, same config, same input draft) |
              start | resume (complete checkpoints) | rerun (done or stale: the old run folder is
              moved aside, the stage starts fresh); every stage downstream of a (re)run reruns too
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from longspec.runs import runfolder
from longspec.project.manifest import Manifest, StageSpec
from longspec.errors import RefusedError
from longspec_cli.launch import argv as A
from longspec_cli.launch.trainer import exp_location  # noqa: F401  (where every stage module reads its stage)


@dataclass
class RunRequest:
    project: Path
    stage: str | None = None
    all: bool = False
    dry_run: bool = False
    force: bool = False
    overrides: list[str] = field(default_factory=list)
    placement: A.Placement = field(default_factory=A.Placement)
    gpu_mem_gib: float | None = None
    quiet: bool = False
    grace_int: float | None = None
    grace_term: float | None = None
    checked: dict[str, tuple | None] = field(default_factory=dict)  # config -> file state at preflight
    gate: float | None = None  # --gate P: stop when a stage's tau is more than P% below its upstream's
    evaluate: bool = False  # --eval: measure each stage after it finishes (implied by gate)

    @property
    def measuring(self) -> bool:
        return self.evaluate or self.gate is not None


@dataclass
class StagePlan:
    spec: StageSpec
    action: str  # start | resume | rerun | skip
    reason: str = ""
    resume_step: int | None = None
    wall_s: float | None = None  # set once its launch has ended


@dataclass
class StageOutcome:
    name: str
    action: str
    result: str  # done | skipped | failed | interrupted | not run
    steps: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None
    sha256: str | None = None
    sim_tau: float | None = None  # the simulated tau of the stage's last evaluation while training
    sim_cost: tuple | None = None  # (seconds in tau evaluations and continuations, the trainer's wall s)
    tau: float | None = None  # from eval.json, only when it was measured on this final draft
    speedup: float | None = None
    tree_tau: float | None = None  # the token tree's tau on the same prompts
    note: str = ""
    by_length: tuple = ()  # quality.length_rows of the eval.json: tau by context length, input draft's

    def row(self) -> list[str]:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        return [self.name, self.action, self.result, f(self.steps, "d"), f(self.first_loss, ".4f"),
                f(self.last_loss, ".4f"), f(self.tokens_per_s, ",.0f"), f(self.wall_s, ".1f"),
                f(self.sim_tau, ".2f"), f(self.tau, ".2f"), f(self.speedup, ".2f"), f(self.tree_tau, ".2f"), (self.sha256 or "-")[:16]]

    def take_eval(self, ev: dict) -> None:
        """tau and speed-up of the chain, and the tree's tau, from an eval.json (old files: chain only)."""
        from longspec.runs import quality

        chain, tree = quality.method_figures(ev, "chain"), quality.method_figures(ev, "tree")
        head = chain if chain is not None else ev
        self.tau, self.speedup = as_float(head.get("tau")), as_float(head.get("speedup"))
        self.tree_tau = as_float(tree.get("tau")) if tree is not None else None
        self.by_length = tuple(quality.length_rows(ev))


class Console:
    """Plain output helpers (stdout for the run, stderr for warnings); rich only for the table."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        self.err.write(f"warning: {text}\n")
        self.err.flush()


def as_float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def composed(path: Path, overrides: tuple[str, ...] = ()):
    """The stage as the trainer will compose it (project.hydracompose reuses it while its files are unchanged)."""
    from longspec.project.hydracompose import compose_stage

    return compose_stage(path, list(overrides))


def file_state(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def plan_stages(manifest: Manifest, req: RunRequest, world: int | None = None) -> list[StagePlan]:
    """What each stage this command runs will do (the stages in scope, in order).

    Every stage is first judged by its own record (runs.status: its run's own overrides). Those
    that this command runs are then judged with the command's overrides: a finished one is done
    when its math keys are unchanged and its input draft is its upstream's current one; an
    interrupted one resumes unless its math keys changed (refused, keys named, checkpoints kept).
    Raises RefusedError when a stage in scope is owned by a live run, when its upstream is not in
    scope and not done, or when its checkpoints cannot be resumed with this config."""
    from longspec.runs.status import FINISHED, LIVE, draft_current, finished_changes, project_status

    statuses = {s.name: s for s in project_status(manifest)}
    scope = _scope(manifest, statuses, req)
    rerun: set[str] = set()  # stages that will produce a new draft in this invocation
    kept: set[str] = set()  # finished stages in scope that stay as they are
    plans: list[StagePlan] = []
    for spec in manifest.stages:
        if spec.name not in scope:
            continue
        st = statuses[spec.name]
        if st.state in LIVE:
            _refuse_live(manifest, spec, st)
        up = statuses.get(spec.draft_from) if spec.draft_from else None
        if up is not None and up.name in kept:  # judged done with this command's overrides
            up = replace(up, state="done")
        if up is not None and spec.draft_from not in rerun and up.state != "done":
            raise RefusedError(f"stage {spec.name} starts from {up.name}'s draft, but {up.name} is {up.state}"
                               + (f" ({'; '.join(up.reasons)})" if up.reasons else ""),
                               hint=f"run it first: `longspec run {manifest.root} {up.name}`, or "
                                    f"`longspec run {manifest.root} {up.name} --all` for both")
        complete = runfolder.RunDir(spec.output_dir).stage_complete() if st.state in FINISHED else None
        if complete is not None:
            why = _finished_reasons(spec, complete, req.overrides, finished_changes)
            if spec.draft_from in rerun:
                why.append(f"{spec.draft_from} runs first")
            elif up is not None and not draft_current(complete, up, spec.draft_pick):
                why.append(f"{up.name} has a new {spec.draft_pick} draft")
            forced = req.force and req.stage == spec.name and not req.all
            if not why and not forced:
                plans.append(StagePlan(spec, "skip", "done, config unchanged"))
                kept.add(spec.name)
                continue
            plans.append(StagePlan(spec, "rerun", ", ".join(why) or "--force"))
        elif spec.draft_from in rerun:
            plans.append(StagePlan(spec, "rerun" if runfolder.RunDir(spec.output_dir).exists() else "start",
                                   f"{spec.draft_from} runs first"))
        elif st.resume_step is not None and st.state in ("pending", "failed", "preempted"):
            _check_resumable(manifest, spec, req.overrides, world)
            plans.append(StagePlan(spec, "resume", f"from step {st.resume_step}", st.resume_step))
        else:
            plans.append(StagePlan(spec, "start", "failed before" if st.state == "failed" else ""))
        rerun.add(spec.name)
    return plans


def _scope(manifest: Manifest, statuses: dict, req: RunRequest) -> list[str]:
    """The stages this command runs: STAGE, STAGE and those after it (--all), every stage (--all),
    or else the first stage that its own record does not call done."""
    names = [s.name for s in manifest.stages]
    if req.stage is not None:
        i = manifest.index(req.stage)  # UsageError with "did you mean" for a bad name
        return names[i:] if req.all else [req.stage]
    if req.all:
        return names
    return next(([n] for n in names if statuses[n].action != "skip"), [])


def _finished_reasons(spec: StageSpec, complete: dict, overrides: list[str], finished_changes) -> list[str]:
    """Why a finished stage would train again with the command's overrides ([] = it is done)."""
    from longspec.project.mathkeys import UNSET, math_config

    try:
        changed = finished_changes(spec, complete, overrides)
    except OSError:
        return [f"{spec.config} is missing"]
    if changed is None:
        return ["config or overrides changed"]
    if not changed:
        return []
    saved = complete.get("math") or {}
    ours = math_config(composed(spec.config, tuple(_stage_overrides(spec, overrides))).data)
    shown = [f"{k} {saved.get(k, UNSET)} -> {ours.get(k, UNSET)}" for k in changed[:3]]
    return [f"changed since its run: {', '.join(shown)}{', ...' if len(changed) > 3 else ''}"]


def _stage_overrides(spec: StageSpec, overrides: list[str]) -> list[str]:
    from longspec.project.hydracompose import stage_overrides

    return stage_overrides(spec.output_dir, overrides)


def _check_resumable(manifest: Manifest, spec: StageSpec, overrides: list[str], world: int | None = None) -> None:
    """Refuse, as the trainer would, a resume whose math keys changed, or on other ranks than its
    checkpoint's, or at another sequence_parallel_size with other sequences per step (``world``:
    the launch's ranks, None: unknown); the checkpoints are kept."""
    from longspec.project.mathkeys import batch_keys_free, layout_blocker, math_config, resume_blockers, show_changes

    newest = runfolder.RunDir(spec.output_dir).checkpoints()[-1]
    saved, saved_layout = newest.info.get("math"), newest.info.get("layout")
    try:
        same = newest.info.get("config_sha256") == runfolder.config_fingerprint(spec.config, overrides)
    except OSError:
        return  # a missing config is validation's to report
    if same and (world is None or not isinstance(saved_layout, dict)):
        return
    c = composed(spec.config, tuple(_stage_overrides(spec, overrides)))
    if not c.ok or c.missing:
        return  # validation reports a stage that does not compose
    ours = math_config(c.data)
    sp = int(c.data.get("sequence_parallel_size") or 1)
    blocked = layout_blocker(saved_layout, world, sp, saved if isinstance(saved, dict) else None, ours)
    if blocked:
        raise RefusedError(f"stage {spec.name} cannot resume checkpoint-{newest.step}: {blocked[0]}", hint=blocked[1])
    if same or not isinstance(saved, dict):
        return  # saved before checkpoints named their math keys: the trainer decides
    other, schedule = resume_blockers(saved, ours, c.data.get("resume_schedule"),
                                      batch_keys_free(saved_layout, world, sp))
    if other or schedule:
        keys = other or schedule
        hint = (f"set them back to resume from checkpoint-{newest.step} (the checkpoints are kept), or "
                f"choose another output_dir; force=true starts over")
        if not other:
            hint = f"resume_schedule=stretch resumes from checkpoint-{newest.step} on the new length; " + hint
        raise RefusedError(f"stage {spec.name} cannot resume checkpoint-{newest.step}: "
                           f"{show_changes(saved, ours, keys)} changed since it was saved", hint=hint)


def _refuse_live(manifest: Manifest, spec: StageSpec, st) -> None:
    where = st.where or "a live run"
    raise RefusedError(f"stage {spec.name} is {st.state}: {where} owns {spec.output_dir}",
                       hint=f"watch it with `longspec monitor {manifest.root}`, or stop it with "
                            f"`longspec stop {manifest.root} {spec.name}`")
