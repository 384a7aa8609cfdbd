"""`longspec run`, step 1: what each stage will do, and the types a run passes around.

    plan      status of every stage (core.status) -> skip (done, same config, same input draft) |
              start | resume (complete checkpoints) | rerun (done or stale: the old run folder is
              moved aside, the stage starts fresh); every stage downstream of a (re)run reruns too
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from longspec_cli.core import runfolder
from longspec_cli.core.manifest import Manifest, StageSpec
from longspec_cli.errors import RefusedError, UsageError
from longspec_cli.launch import argv as A


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
        from longspec_cli.core import quality

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


def exp_location(spec: StageSpec) -> tuple[Path, str]:
    """(conf dir, exp name) for `--config-dir CONF +exp=NAME`: the config must be CONF/exp/NAME.yaml."""
    from longspec_cli.core.hydracompose import stage_location

    loc = stage_location(spec.config)
    if loc is None:
        raise UsageError(f"stage {spec.name}: {spec.config} is not inside a conf/exp/ folder",
                         hint="Hydra reads a stage as --config-dir CONF +exp=NAME from CONF/exp/NAME.yaml")
    return loc


def composed(path: Path, overrides: tuple[str, ...] = ()):
    """The stage as the trainer will compose it (core.hydracompose reuses it while its files are unchanged)."""
    from longspec_cli.core.hydracompose import compose_stage

    return compose_stage(path, list(overrides))


def file_state(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def plan_stages(manifest: Manifest, req: RunRequest) -> list[StagePlan]:
    """What each stage in scope will do. Raises RefusedError when a stage is running."""
    from longspec_cli.core.status import FINISHED, config_current, draft_current, project_status

    statuses = {s.name: s for s in project_status(manifest)}
    rerun: set[str] = set()  # stages that will produce a new draft in this invocation
    plans: list[StagePlan] = []
    for spec in manifest.stages:
        st = statuses[spec.name]
        if st.state == "running":
            plans.append(StagePlan(spec, "running", "; ".join(st.reasons)))
            continue
        complete = runfolder.RunDir(spec.output_dir).stage_complete()
        same_config = complete is not None and config_current(spec, complete, req.overrides) is True
        up = statuses.get(spec.draft_from) if spec.draft_from else None
        same_draft = up is None or (spec.draft_from not in rerun and complete is not None
                                    and draft_current(complete, up, spec.draft_pick))
        if st.state in FINISHED and same_config and same_draft:
            plans.append(StagePlan(spec, "skip", "done, config unchanged"))
            continue
        if st.state in FINISHED:
            why = []
            if not same_config:
                why.append("config or overrides changed")
            if not same_draft:
                why.append(f"{spec.draft_from} " + ("runs again" if spec.draft_from in rerun else "has a new draft"))
            plans.append(StagePlan(spec, "rerun", ", ".join(why)))
        elif spec.draft_from in rerun:
            plans.append(StagePlan(spec, "rerun" if runfolder.RunDir(spec.output_dir).exists() else "start",
                                   f"{spec.draft_from} runs first"))
        elif st.action == "resume":
            plans.append(StagePlan(spec, "resume", f"from step {st.resume_step}", st.resume_step))
        else:
            plans.append(StagePlan(spec, "start", "failed before" if st.state == "failed" else ""))
        rerun.add(spec.name)
    return _in_scope(manifest, plans, req)


def _in_scope(manifest: Manifest, plans: list[StagePlan], req: RunRequest) -> list[StagePlan]:
    if req.stage is not None:
        manifest.index(req.stage)  # UsageError with "did you mean" for a bad name
        chosen = [p for p in plans if p.spec.name == req.stage]
        if req.all:
            i = manifest.index(req.stage)
            chosen = plans[i:]
    elif req.all:
        chosen = plans
    else:
        todo = next((p for p in plans if p.action != "skip"), None)
        chosen = [todo] if todo else []
    for p in chosen:
        if p.action == "running":
            info = runfolder.RunDir(p.spec.output_dir).run_info() or {}
            raise RefusedError(f"stage {p.spec.name} is running (pid {info.get('pid')} on {info.get('host')})",
                               hint=f"watch it with `longspec monitor`, or stop it with "
                                    f"`longspec stop {manifest.root} {p.spec.name}`")
    if req.force and req.stage is not None and not req.all:
        for p in chosen:
            if p.action == "skip":
                p.action, p.reason = "rerun", "--force"
    return chosen
