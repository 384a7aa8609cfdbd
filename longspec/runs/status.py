"""Where each stage stands, from its run folder alone, and what `longspec run` would do next.

States (docs/DESIGN.md): done, stale, running, queued, requeued, failed, preempted, pending.
Order of the checks:
  running  the run record (longspec/runs/runrecord.py) names a live run: a process group on this host whose
           start time matches `proc_start`, or a running SLURM job whose step runs this stage
  queued   a SLURM job that will run the stage is pending, or runs an earlier stage
  requeued the stage's SLURM job saved a checkpoint and was requeued: it resumes the stage
  done     stage_complete.json present and the weights' sha256 matches it
  stale    done, but the config as composed now (the stage file, the files it includes, the
           run's own overrides) differs in a key that changes what is trained (project.mathkeys; an
           edit of logging or saving keys leaves it done), or the input draft differs from the
           upstream stage's current final draft, or the upstream stage is itself not done, or
           the train_file is a regeneration folder written by another target than the stage's
           target now (runs.regenstate)
  failed   the last lifecycle event is `error`, or run.json's process is gone without
           stage_complete.json, or the final weights no longer match stage_complete.json
  preempted  the last lifecycle event is `preempted`: a stop signal saved a checkpoint (resumable)
  pending  anything else (resumable when complete checkpoints exist)
A regeneration of the stage's data (`longspec regenerate`, runs.regenstate) is a note: running
("regenerating 120/500 rows", also in the next action), interrupted (resumable) or unfinished
("regenerated 17/48, 30 failed: rerun ...": it ended with failed or missing rows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longspec.runs import runfolder
from longspec.project.manifest import Manifest, StageSpec, same_file
from longspec.runs.draftpick import DRAFT_KEY

STATES = ("pending", "running", "queued", "requeued", "done", "failed", "stale", "preempted")
LIVE = ("running", "queued", "requeued")  # a live run (a process group, a SLURM job) owns the folder
FINISHED = ("done", "stale")  # the stage has a final draft (stale: its inputs changed since)


@dataclass
class StageStatus:
    name: str
    config: str
    output_dir: str
    state: str
    steps: int | None = None
    total_steps: int | None = None
    last_loss: float | None = None
    draft_from: str | None = None
    draft_model_name_or_path: str | None = None
    draft_weights: str | None = None  # the stage's final weights, when the file exists
    sha256: str | None = None  # of draft_weights
    next_action: str = "start"
    action: str = "start"  # machine form: start | resume | skip | wait | rerun | blocked
    resume_step: int | None = None
    reasons: list[str] = field(default_factory=list)  # why stale / failed / blocked, and notes
    tau: float | None = None  # chain tau (tokens per target forward) from eval.json, when measured on this draft
    speedup: float | None = None
    tree_tau: float | None = None  # the token tree's tau on the same prompts, when eval measured it
    tree_speedup: float | None = None
    # tau by context length (eval.json by_length, the headline method): [{length, label, prompts,
    # tau, baseline_tau (the input draft's on the same prompts)}]
    tau_by_length: list[dict] = field(default_factory=list)
    eval_results: list[str] = field(default_factory=list)  # other measurements: eval-<what>.json names
    sim_tau: float | None = None  # the latest simulated tau while training (metrics.jsonl), its step and rates
    sim_tau_step: int | None = None
    sim_alpha: list[float] | None = None
    best_tau: float | None = None  # best/: the draft with the highest simulated tau, its step and sha256
    best_step: int | None = None
    best_weights: str | None = None
    best_sha256: str | None = None
    draft_pick: str = "final"  # which draft of draft_from the stage starts from (longspec.yaml)
    where: str | None = None  # what runs it (or ran it last): "process 12 on h", "SLURM job 42 on node[1-2]"
    job_id: str | None = None  # the SLURM job of the run record, if any
    # the stage's data regeneration (runs.regenstate), when one is recorded:
    # {state: running | interrupted | unknown, done, total, pid, folder}, or
    # {state: unfinished, done, total, failed, folder, rerun} (runs.regenstate.folder_state), or one that
    # ended whole: {state: complete, done, total, pid: None, folder, counts}
    regeneration: dict | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def project_status(manifest: Manifest) -> list[StageStatus]:
    out: list[StageStatus] = []
    by_name: dict[str, StageStatus] = {}
    for spec in manifest.stages:
        upstream = by_name.get(spec.draft_from) if spec.draft_from else None
        st = stage_status(spec, upstream, manifest.root)
        out.append(st)
        by_name[spec.name] = st
    return out


def _read_eval(st: StageStatus, spec: StageSpec) -> None:
    """tau and speed-up from `longspec eval`, only when measured on the stage's current draft."""
    from longspec.runs import quality

    st.eval_results = quality.result_files(spec.output_dir)
    try:
        ev = quality.read_eval(spec.output_dir)
    except quality.EvalFileError as e:
        st.reasons.append(f"ignored: {e}")
        return
    if ev is None:
        return
    if not quality.eval_is_current(ev, st.sha256):
        st.reasons.append("eval.json was measured on another draft: run `longspec eval` again")
        return
    chain, tree = quality.method_figures(ev, "chain"), quality.method_figures(ev, "tree")
    if chain is not None:
        st.tau, st.speedup = chain["tau"], chain.get("speedup")
    elif tree is None:
        st.tau, st.speedup = ev["tau"], ev.get("speedup")
    if tree is not None:
        st.tree_tau, st.tree_speedup = tree["tau"], tree.get("speedup")
    st.tau_by_length = quality.length_rows(ev)


def stage_status(spec: StageSpec, upstream: StageStatus | None = None, root: Path | None = None) -> StageStatus:
    rd = runfolder.RunDir(spec.output_dir)
    st = StageStatus(name=spec.name, config=str(spec.config), output_dir=str(spec.output_dir),
                     state="pending", draft_from=spec.draft_from)
    st.draft_model_name_or_path = _draft_key(spec, st.reasons)

    complete = rd.stage_complete()
    if rd.stage_complete_error:
        st.reasons.append(f"ignored: {rd.stage_complete_error}")
    info = rd.run_info()
    if rd.run_info_error:
        st.reasons.append(f"ignored: {rd.run_info_error}")
    weights = rd.weights_for(complete)
    if weights.is_file():
        st.draft_weights = str(weights)
        try:
            st.sha256 = runfolder.cached_sha256(weights)
        except OSError as e:
            st.reasons.append(f"cannot hash {weights}: {e.strerror or e}")

    _read_eval(st, spec)
    _read_simtau(st, rd)
    st.draft_pick = spec.draft_pick
    events = rd.events()
    _progress(st, rd, complete, events)
    last_event = runfolder.last_lifecycle_event(events)

    own = _owner(info, st)
    if own is not None and own.live:
        st.state = own.state
    elif complete is not None and st.sha256 is not None and st.sha256 == complete.get("sha256"):
        st.state = "done"
        _check_stale(st, spec, complete, info, upstream)
    elif complete is not None:
        st.state = "failed"
        st.reasons.append("final weights missing" if st.draft_weights is None
                          else "final weights do not match stage_complete.json sha256 (truncated or replaced)")
    elif last_event is not None and last_event.get("event") == "preempted":
        st.state = "preempted"
        st.reasons.append(f"stopped by {last_event.get('signal') or 'a stop signal'} at step "
                          f"{last_event.get('step')} after saving a checkpoint")
    elif last_event is not None and last_event.get("event") == "error":
        st.state = "failed"
        st.reasons.append(f"error at step {last_event.get('step')}: {last_event.get('message', '?')}")
    elif info is not None and not (info.get("kind") == "slurm" and info.get("phase") == "queued"):
        st.state = "failed"
        how = ("stopped (Ctrl-C or `longspec stop`)" if info.get("interrupted") or info.get("stop_requested_at")
               else f"exited with code {info['returncode']}" if isinstance(info.get("returncode"), int)
               else "is gone")
        what = st.where or f"process {info.get('pid')}"
        st.reasons.append(f"{what} {how} and stage_complete.json was never written")
    regen = _read_regen(st, spec, root)
    _next_action(st, rd, upstream)
    if regen is not None and regen.state != "interrupted" and st.action in ("start", "resume", "rerun"):
        st.next_action = f"wait: {regen.short()}; then {st.next_action}"
    wanted = upstream_weights(upstream, spec.draft_pick) if upstream is not None else None
    if (st.action in ("start", "resume", "rerun") and wanted
            and not same_file(st.draft_model_name_or_path, wanted, root or spec.config.parent)):
        st.reasons.append(f"{DRAFT_KEY} does not point at {upstream.name}'s {spec.draft_pick} draft yet "
                          f"(`longspec next-stage{' --best' if spec.draft_pick == 'best' else ''}` sets it)")
    return st


def _read_regen(st: StageStatus, spec: StageSpec, root: Path | None):
    """The stage's regeneration (runs.regenstate), as a note; a finished stage whose train_file was
    regenerated by another target than its target now turns stale. Returns the regeneration's state."""
    from longspec.runs import regenstate
    from longspec.project.hydracompose import compose_stage, stage_overrides

    base = Path(root) if root is not None else spec.config.parent
    folder = regenstate.stage_folder(base, spec.name)
    regen = regenstate.regen_state(folder)
    if regen is not None:
        st.reasons.append(regen.line())
        st.regeneration = {"state": regen.state, "done": regen.done, "total": regen.total, "pid": regen.pid,
                           "folder": regen.folder}
    elif (rows := regenstate.folder_state(folder)) is not None and rows.unfinished:
        st.reasons.append(rows.line())          # ended with failed or missing rows: a rerun finishes it
        st.regeneration = {"state": "unfinished", "done": rows.done, "total": rows.records,
                           "failed": rows.failed, "folder": rows.folder, "rerun": rows.rerun}
    elif (done := regenstate.written(folder)) is not None:   # ended whole: its counts, untrainable rows too
        st.reasons.append(regenstate.written_line(done))
        st.regeneration = done
    c = compose_stage(spec.config, stage_overrides(spec.output_dir, []))
    train, target = (c.get(k) if c.ok else None for k in ("train_file", "model_name_or_path"))
    if isinstance(train, str) and isinstance(target, str):
        why = regenstate.other_target(_abs(base, train), _abs(base, target))
        if why:
            if st.state == "done":
                st.state = "stale"
            st.reasons.append(why)
    return regen


def _abs(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _draft_key(spec: StageSpec, notes: list[str]) -> str | None:
    """The draft path the trainer will read: the composed value (with the output_dir `run` passes,
    the one composition of the stage every verb shares), not the stage file's text."""
    from longspec.runs.draftpick import composed_draft
    from longspec.project.hydracompose import stage_overrides

    v, problem = composed_draft(spec.config, stage_overrides(spec.output_dir, []))
    if problem:
        notes.append(f"config unreadable (it does not compose): {problem}")
    return None if v is None else str(v)


def _progress(st: StageStatus, rd: runfolder.RunDir, complete: dict | None, events: list[dict]) -> None:
    last = rd.last_step_record()
    if last is not None:
        st.steps = last.get("step")
        st.total_steps = _int(last.get("total_steps"))
        st.last_loss = _float(last.get("loss"))
    if complete is not None:
        st.steps = _int(complete.get("steps")) if _int(complete.get("steps")) is not None else st.steps
        if st.last_loss is None:
            st.last_loss = _float(complete.get("final_loss"))
    if st.total_steps is None:
        for ev in reversed(events):
            if ev.get("event") == "start" and _int(ev.get("total_steps")) is not None:
                st.total_steps = _int(ev.get("total_steps"))
                break


def _owner(info: dict | None, st: StageStatus):
    """The run record's owner (longspec/runs/runrecord.py); a run that cannot be checked counts as running."""
    from longspec.runs import runrecord

    if info is None:
        return None
    own = runrecord.owner(info)
    st.where, st.job_id = own.where or None, own.job_id
    if own.state == "unknown":
        st.reasons.append(f"{own.where}: {own.detail}")
        return runrecord.Owner("running", own.where, own.detail, own.job_id)
    if own.live:
        st.reasons.append(f"{own.state}: {own.where}" + (f" ({own.detail})" if own.detail else ""))
    return own


def config_current(spec: StageSpec, complete: dict, overrides: list[str]) -> bool | None:
    """Was the finished stage trained on its config file as it is now, with these overrides?
    None when that cannot be told (the config file is missing or unreadable)."""
    try:
        return runfolder.config_fingerprint(spec.config, overrides) == complete.get("config_sha256")
    except OSError:
        return None


def math_changes(spec: StageSpec, complete: dict, overrides: list[str]) -> list[str] | None:
    """The math keys (project.mathkeys) whose values differ between the finished run and the stage's
    config composed now: [] when an edit touched only keys that do not change what is trained.
    None when that cannot be told: the run recorded no `math`, or the stage does not compose."""
    saved = complete.get("math")
    if not isinstance(saved, dict):
        return None
    from longspec.project.hydracompose import compose_stage, stage_overrides
    from longspec.project.mathkeys import differences, math_config

    c = compose_stage(spec.config, stage_overrides(spec.output_dir, overrides))
    if not c.ok or c.missing:
        return None
    return differences(saved, math_config(c.data))


def upstream_weights(upstream: StageStatus, pick: str) -> str | None:
    """The upstream's draft a stage starts from: its final weights, or its best/ ones (pick "best")."""
    return upstream.best_weights if pick == "best" else upstream.draft_weights


def draft_current(complete: dict, upstream: StageStatus | None, pick: str = "final") -> bool:
    """Was the finished stage trained from its upstream's current final draft (or best draft, pick
    "best"), the upstream being done?"""
    want = upstream.best_sha256 if upstream is not None and pick == "best" else getattr(upstream, "sha256", None)
    return upstream is None or (upstream.state == "done" and complete.get("draft_sha256") == want)


def _read_simtau(st: StageStatus, rd: runfolder.RunDir) -> None:
    """The latest simulated-tau record and the best draft (best.json, verified) of the run folder."""
    rec = rd.last_simtau_record()
    if rec is not None:
        st.sim_tau, st.sim_tau_step, st.sim_alpha = float(rec["tau"]), rec["step"], list(rec["alpha"])
    best = rd.best()
    if best is not None:
        st.best_tau, st.best_step = _float(best.get("tau")), _int(best.get("step"))
        st.best_weights, st.best_sha256 = best["weights"], best["sha256"]


def run_overrides(info: dict | None) -> list[str]:
    """The overrides a stage's last run was launched with (its run record), [] when none or unreadable."""
    overrides = (info or {}).get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return []
    return overrides


def finished_changes(spec: StageSpec, complete: dict, overrides: list[str]) -> list[str] | None:
    """The math keys in which the finished run differs from the stage composed now with `overrides`
    (its file, every file it includes, the overrides): [] when none. None when that cannot be told
    and the stage must count as changed: the run recorded no `math` and the file's fingerprint
    differs, or the stage no longer composes. Raises OSError when the config file is missing."""
    same = config_current(spec, complete, overrides)
    if same is None:
        raise FileNotFoundError(spec.config)
    changed = math_changes(spec, complete, overrides)
    if changed is not None:
        return changed
    return [] if same else None


def _check_stale(st: StageStatus, spec: StageSpec, complete: dict, info: dict | None,
                 upstream: StageStatus | None) -> None:
    overrides = run_overrides(info)
    try:
        changed = finished_changes(spec, complete, overrides)
    except OSError:
        st.reasons.append(f"config {spec.config} is missing; cannot check whether it changed")
    else:
        if changed is None or changed:
            st.state = "stale"
            keys = f": {', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''}" if changed else ""
            st.reasons.append(f"config changed since the run ({spec.config.name}{keys})")
        elif config_current(spec, complete, overrides) is False:
            st.reasons.append(f"{spec.config.name} was edited since the run, in keys that do not change what "
                              "is trained only: still done")
    if not draft_current(complete, upstream, spec.draft_pick):
        st.state = "stale"
        st.reasons.append(f"upstream stage {upstream.name} is {upstream.state}" if upstream.state != "done"
                          else f"trained from a different draft than {upstream.name}'s current {spec.draft_pick} one"
                          if complete.get("draft_sha256") else f"trained without {upstream.name}'s draft")


def _next_action(st: StageStatus, rd: runfolder.RunDir, upstream: StageStatus | None) -> None:
    if st.state == "done":
        st.next_action, st.action = "skip (done)", "skip"
        return
    if st.state in ("running", "queued"):
        st.next_action, st.action = f"wait ({st.state}{' in SLURM job ' + st.job_id if st.job_id else ''})", "wait"
        return
    if st.state == "requeued":
        ckpts = rd.checkpoints()
        st.resume_step = ckpts[-1].step if ckpts else None
        at = f"from step {st.resume_step}" if ckpts else "from the start"
        st.next_action, st.action = f"wait (SLURM job {st.job_id} resumes it {at})", "wait"
        return
    if st.state == "stale":
        st.next_action, st.action = "re-run (stale)", "rerun"
        return
    if upstream is not None and upstream.state != "done":
        st.next_action, st.action = f"wait for {upstream.name}", "blocked"
        return
    ckpts = rd.checkpoints() if st.state in ("pending", "failed", "preempted") else []
    if ckpts:
        st.resume_step = ckpts[-1].step
        st.next_action, st.action = f"resume from step {st.resume_step}", "resume"
    elif st.state == "failed":
        st.next_action, st.action = "re-run (failed)", "rerun"
    else:
        st.next_action, st.action = "start", "start"


def run_plan(stages: list[StageStatus]) -> str:
    """One sentence: what `longspec run` would do next."""
    for st in stages:
        if st.action == "skip":
            continue
        if st.action == "wait":
            job = f" in SLURM job {st.job_id}" if st.job_id else ""
            return (f"{st.name} is {st.state}{job}; `longspec run` refuses to start it again "
                    "(watch it with `longspec monitor`, stop it with `longspec stop`)")
        if st.action == "blocked":
            return f"{st.name} waits for an earlier stage"
        if st.action == "resume":
            return f"`longspec run` would resume {st.name} from step {st.resume_step}"
        if st.action == "rerun":
            why = f" ({'; '.join(st.reasons)})" if st.reasons else ""
            return f"`longspec run` would re-run {st.name}{why}"
        return f"`longspec run` would start {st.name}"
    return "every stage is done; nothing to run"


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    return float(v) if isinstance(v, (int, float)) else None
