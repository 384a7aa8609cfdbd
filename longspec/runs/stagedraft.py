"""The draft of a stage, as the verbs that use a trained draft take it (eval, export, serve): the one
owner of "which stage's final draft, and the refusal when a stage has none".

A stage has a draft when its state is finished (runs.status.FINISHED: done, or stale when its
inputs changed since); its StageStatus carries `output_dir` (the run folder the trainer's modules
read) and `draft_weights` (the final weights file). Pure: no torch.
"""

from __future__ import annotations

from longspec.errors import RefusedError
from longspec.project.manifest import Manifest
from longspec.runs.status import FINISHED, StageStatus, project_status


def _none_yet(shown: str) -> RefusedError:
    return RefusedError("no stage has a finished draft yet", hint=f"train one first: longspec run {shown} --all")


def _unfinished(st: StageStatus, shown: str) -> RefusedError:
    return RefusedError(f"stage {st.name} has no finished draft (state: {st.state})",
                        hint=f"train it first: longspec run {shown} {st.name}")


def stage_draft(manifest: Manifest, stage: str | None = None, *, shown: str | None = None) -> StageStatus:
    """The stage whose draft is used: `stage` (any spelling manifest.stage accepts) when named, else
    the last finished stage of the pipeline. RefusedError (exit 1) when that stage, or every stage,
    has no finished draft; `shown` is the project as the user named it (for the hint's command)."""
    shown = shown if shown is not None else str(manifest.root)
    states = {st.name: st for st in project_status(manifest)}
    if stage is not None:
        st = states[manifest.stage(stage).name]
        if st.state not in FINISHED:
            raise _unfinished(st, shown)
        return st
    done = [states[n] for n in manifest.stage_names if states[n].state in FINISHED]
    if not done:
        raise _none_yet(shown)
    return done[-1]


def stage_drafts(manifest: Manifest, stages: list[str], *, shown: str | None = None
                 ) -> tuple[list[StageStatus], list[dict]]:
    """(stages to use, stages skipped as {stage, state}): each named stage, which must be finished
    (else RefusedError), or with none named every finished stage in pipeline order, the others
    skipped. RefusedError when none is finished."""
    shown = shown if shown is not None else str(manifest.root)
    states = {st.name: st for st in project_status(manifest)}
    chosen = [manifest.stage(s).name for s in stages] if stages else manifest.stage_names
    todo, skipped = [], []
    for name in chosen:
        st = states[name]
        if st.state in FINISHED:
            todo.append(st)
        elif stages:
            raise _unfinished(st, shown)
        else:
            skipped.append({"stage": name, "state": st.state})
    if not todo:
        raise _none_yet(shown)
    return todo, skipped
