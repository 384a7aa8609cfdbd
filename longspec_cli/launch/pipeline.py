"""`longspec run`: which stages run, the preflight, the launches, chaining between them.

    plan      status of every stage -> skip (done, same config, same input draft) | start |
              resume (complete checkpoints) | rerun (done or stale: the old run folder is moved
              aside, the stage starts fresh); every stage downstream of a (re)run reruns too
    preflight overrides (exit 2), validation of the stages that will run (errors refuse unless
              --force), DeepSpeed importable, memory estimate vs the GPUs (a warning)
    execute   per stage: chain its draft from the upstream (core.chain, as `next-stage`), validate
              it, launch (process.py), require stage_complete.json; stop at the first failure
    evaluate  (--eval, --gate P, `demo`) per stage, before chaining into the next: `python -m
              longspec.evaluate` on its final draft (the upstream's final draft as the baseline on
              the same prompts), unless its eval.json is current; --gate P then stops the pipeline
              when quality.gate_stage fails (tau more than P% below the upstream draft's)
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from longspec_cli.core import runfolder
from longspec_cli.core.manifest import Manifest, StageSpec
from longspec_cli.errors import INTERRUPTED, PREEMPTED, LongspecError, RefusedError, RunFailed, UsageError
from longspec_cli.launch import argv as A
from longspec_cli.launch import memory as M

LOW_SPACE_BYTES = 64 * 1024 ** 2  # a failed stage with less free than this is reported as a full disk


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
    tau: float | None = None  # from eval.json, only when it was measured on this final draft
    speedup: float | None = None
    tree_tau: float | None = None  # the token tree's tau on the same prompts
    note: str = ""

    def row(self) -> list[str]:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        return [self.name, self.action, self.result, f(self.steps, "d"), f(self.first_loss, ".4f"),
                f(self.last_loss, ".4f"), f(self.tokens_per_s, ",.0f"), f(self.wall_s, ".1f"),
                f(self.tau, ".2f"), f(self.speedup, ".2f"), f(self.tree_tau, ".2f"), (self.sha256 or "-")[:16]]

    def take_eval(self, ev: dict) -> None:
        """tau and speed-up of the chain, and the tree's tau, from an eval.json (old files: chain only)."""
        from longspec_cli.core import quality

        chain, tree = quality.method_figures(ev, "chain"), quality.method_figures(ev, "tree")
        head = chain if chain is not None else ev
        self.tau, self.speedup = _num(head.get("tau")), _num(head.get("speedup"))
        self.tree_tau = _num(tree.get("tau")) if tree is not None else None


SUMMARY_HEADER = ["stage", "action", "result", "steps", "first loss", "last loss", "tokens/s", "wall s",
                  "tau", "speed-up", "tree tau", "sha256"]
GATE_FAILED = "gate failed"


# ------------------------------------------------------------------------------------ helpers

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


def check_overrides(spec: StageSpec, overrides: list[str]) -> None:
    """Hydra's override parser, then the stage composed with the overrides, as the trainer will:
    an override Hydra refuses (a key that is not there, a typo) is a usage error (exit 2) here,
    before anything starts. Values that do not fit (save_steps=0) are validation errors."""
    from longspec_cli.core.hydracompose import stage_overrides

    A.check_overrides(overrides)
    if not overrides or not spec.config.is_file():
        return
    c = composed(spec.config, tuple(stage_overrides(spec.output_dir, overrides)))
    bad = [p for p in c.problems if p.file is None]  # what Hydra refused about the command line
    if bad:
        raise UsageError("bad override(s): " + "; ".join(p.message + (f" ({p.hint})" if p.hint else "")
                                                         for p in bad),
                         hint="overrides are key=value with a key of the stage config (`longspec config "
                              "DIR STAGE` lists them); `+key=value` adds a key")


def _move_aside(path: Path) -> Path | None:
    if not path.exists():
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.old-{stamp}")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.old-{stamp}-{n}")
        n += 1
    os.replace(path, dest)
    return dest


# --------------------------------------------------------------------------------------- plan

def plan_stages(manifest: Manifest, req: RunRequest) -> list[StagePlan]:
    """What each stage in scope will do. Raises RefusedError when a stage is running."""
    from longspec_cli.core.status import config_current, draft_current, project_status

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
                                    and draft_current(complete, up))
        if st.state in ("done", "stale") and same_config and same_draft:
            plans.append(StagePlan(spec, "skip", "done, config unchanged"))
            continue
        if st.state in ("done", "stale"):
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


# ---------------------------------------------------------------------------------- preflight

def validation_problems(manifest: Manifest, plans: list[StagePlan], world: int,
                        only: StagePlan | None = None, overrides: list[str] = (),
                        world_from: str = "--gpus x --num-nodes") -> list[Any]:
    """Errors and warnings for the stages that will run (the manifest's own included).

    Each stage is composed with the command line's overrides, as the trainer will compose it.
    """
    from longspec_cli.core.validate import validate_paths

    targets = [only] if only else [p for p in plans if p.action != "skip"]
    configs = {str(p.spec.config) for p in targets}
    # Stages whose upstream runs first get their draft key from the chain: ignore it until then.
    chained_later = set() if only else {str(p.spec.config) for p in targets
                                        if p.spec.draft_from in {q.spec.name for q in targets}}
    rep = validate_paths([manifest.root], world_size=world, overrides=list(overrides), world_from=world_from)
    out = []
    for prob in rep.problems:
        if prob.file is not None and prob.file not in configs and prob.file != str(manifest.path):
            continue
        if prob.file in chained_later and prob.key == "draft_model_name_or_path":
            continue
        out.append(prob)
    return out


def world_label(res: A.Resources) -> str:
    """Where `run`'s world size comes from, in `run`'s own flags (validate's say --world-size)."""
    per = "CPU ranks" if res.cpu else "GPUs"
    return f"{res.ranks_per_node} {per} per node (--gpus) x {res.nodes} node(s) (--num-nodes)"


def stage_shape(manifest: Manifest, spec: StageSpec, overrides: list[str], res: A.Resources) -> M.StageShape | None:
    """The memory-estimate inputs of a stage, from its composed config + overrides; None if unknown."""
    from longspec_cli.core import presets

    data = _stage_data(spec, overrides)
    if data is None:
        return None
    size = None
    target = data.get("model_name_or_path")
    if isinstance(target, str) and (Path(target) / "config.json").is_file():
        try:
            size = M.ModelSize.from_config_json(Path(target) / "config.json")
        except (ValueError, OSError):
            size = None
    if size is None and manifest.preset:
        try:
            table = presets.get_preset(manifest.preset).size
            size = M.ModelSize.from_mapping({**table, "family": presets.get_preset(manifest.preset).family})
        except (LongspecError, ValueError):
            size = None
    if size is None:
        return None
    ds = data.get("ds_cfg") if isinstance(data.get("ds_cfg"), dict) else {}
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    off = zero.get("offload_optimizer")
    offload = isinstance(off, dict) and str(off.get("device", "none")).lower() in ("cpu", "nvme")
    get = lambda d, k, default: d.get(k) if isinstance(d, dict) and isinstance(d.get(k), int) else default  # noqa: E731
    precision = data.get("precision") if data.get("precision") in M.PRECISION_BYTES else "bf16"
    flash = (not res.cpu) and A.find_spec("flash_attn") is not None
    return M.StageShape(
        size=size, precision=precision, zero_stage=get(zero, "stage", 0), offload_optimizer=offload,
        seq_len=get(data.get("data"), "max_seq_length", 1024), micro_batch=get(data, "per_gpu_train_batch_size", 1),
        world_size=res.world_size, flash=flash, loss_chunk=get(data, "loss_chunk_size", 0) or M.DEFAULT_CE_CHUNK,
        sliding_window=get(data.get("draft"), "sliding_window", 512),
        prefetch_params=_count(zero.get("stage3_prefetch_bucket_size"), 100_000_000), cuda=not res.cpu,
    )


def _stage_data(spec: StageSpec, overrides: list[str]) -> dict | None:
    """The stage's config composed with the command-line overrides (None if it does not compose)."""
    from longspec_cli.core.hydracompose import stage_overrides

    c = composed(spec.config, tuple(stage_overrides(spec.output_dir, overrides)))
    if not c.ok or not isinstance(c.data, dict):
        return None
    return c.data


def disk_reports(manifest: Manifest, todo: list[StagePlan], overrides: list[str],
                 res: A.Resources) -> list[tuple[StagePlan, str, str | None]]:
    """(plan, estimate line, warning or None) per stage; stages on one disk add up in order."""
    from longspec_cli.core.diskspace import existing_parent
    from longspec_cli.launch import disk as D

    out, used = [], {}  # device -> bytes the earlier stages of this run will have written there
    for p in todo:
        shape = stage_shape(manifest, p.spec, overrides, res)
        data = _stage_data(p.spec, overrides) or {}
        if shape is None:
            out.append((p, "disk estimate: unknown (no config.json for the target and no preset size)", None))
            continue
        num = lambda k: data.get(k) if isinstance(data.get(k), int) and not isinstance(data.get(k), bool) else None  # noqa: E731
        est = D.estimate(shape, p.spec.output_dir, save_total_limit=num("save_total_limit"),
                         max_steps=num("max_steps"), save_steps=num("save_steps"))
        try:
            dev = existing_parent(p.spec.output_dir).stat().st_dev
        except OSError:
            dev = None
        before = used.get(dev, 0)
        used[dev] = before + est.total
        if before and est.free is not None:
            from dataclasses import replace

            est = replace(est, free=max(0, est.free - before))
        out.append((p, est.line() + (" (after the earlier stages)" if before else ""), est.warning()))
    return out


def _count(v: Any, default: int) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return default


def memory_report(manifest: Manifest, spec: StageSpec, overrides: list[str], res: A.Resources,
                  gpu_mem_gib: float | None) -> tuple[list[str], str | None]:
    """(estimate lines, warning or None)."""
    shape = stage_shape(manifest, spec, overrides, res)
    if shape is None:
        return [f"memory estimate: unknown (no config.json for the target and no preset size)"], None
    est = M.estimate(shape, res.ranks_per_node)
    lines = est.lines()
    if gpu_mem_gib:
        cap, where = gpu_mem_gib * M.GiB, f"--gpu-mem {gpu_mem_gib:g}"
    elif res.gpus:
        g = min(res.gpus, key=lambda x: x.memory_mib)
        cap, where = g.memory_mib * 1024 ** 2, f"GPU {g.index} ({g.name})"
    else:
        lines[0] += " [CPU run: informational]"
        return lines, None
    return lines, M.fit_warning(est, cap, where)


# ------------------------------------------------------------------------------------ execute

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


def resolve_placement(manifest: Manifest, p: A.Placement) -> A.Placement:
    """CLI flags win; the manifest's launch block fills hostfile and node count."""
    from dataclasses import replace

    if p.hostfile is None and manifest.launch.hostfile is not None:
        p = replace(p, hostfile=manifest.launch.hostfile,
                    num_nodes=p.num_nodes or (manifest.launch.nodes if manifest.launch.nodes > 1 else None))
    return p


def prepare(req: RunRequest, console: Console) -> tuple[Manifest, list[StagePlan], A.Placement, A.Resources]:
    from longspec_cli.core.manifest import load_manifest

    check_gate(req.gate)
    manifest = load_manifest(req.project)
    first = manifest.stage(req.stage) if req.stage else manifest.stages[0]
    check_overrides(first, req.overrides)
    placement = resolve_placement(manifest, req.placement)
    res = A.resolve_resources(placement, A.detect_gpus(), manifest.launch.gpus, force=req.force)
    plans = plan_stages(manifest, req)
    return manifest, plans, placement, res


def run_request(req: RunRequest, console: Console | None = None) -> list[StageOutcome]:
    """The whole `longspec run`; returns the outcomes (raises for refusals and failures)."""
    console = console or Console()
    manifest, plans, placement, res = prepare(req, console)
    todo = [p for p in plans if p.action != "skip"]
    where = "CPU (DS_ACCELERATOR=cpu)" if res.cpu else f"{len(res.gpus)} GPU(s)"
    console.say(f"project {manifest.name}: {len(todo)} stage(s) to run on {where}, world size {res.world_size}")
    for p in plans:
        console.say(f"  {p.spec.name:<10} {p.action:<7} {p.reason}")
    if not todo:
        if plans and req.measuring and not req.dry_run:  # nothing to train: measure (and gate) what is there
            outcomes = execute(manifest, plans, placement, res, req, console)
        elif plans:
            print_summary([_outcome(p.spec, "skip", "skipped") for p in plans], console)
        if req.stage and not req.all:
            console.say(f"nothing to do: stage {req.stage} is done with this config and input draft "
                        "(pass --force to train it again)")
        else:
            console.say("nothing to do: " + ("every stage is done with an unchanged config" if plans
                                              else "no stage in scope"))
        return [_outcome(p.spec, "skip", "skipped") for p in plans]

    problems = validation_problems(manifest, plans, res.world_size, overrides=req.overrides,
                                   world_from=world_label(res))
    req.checked = {str(p.spec.config): file_state(p.spec.config) for p in todo}
    errors = _report_problems(problems, console)
    if not req.dry_run:
        A.deepspeed_command()  # DeepSpeed and torch importable, else one sentence on the extra
    memory_warnings = []
    disk = {id(p): (line, warning) for p, line, warning in disk_reports(manifest, todo, req.overrides, res)}
    for p in todo:
        lines, warning = memory_report(manifest, p.spec, req.overrides, res, req.gpu_mem_gib)
        if req.dry_run:
            conf, exp = exp_location(p.spec)
            cmd = with_ops_dir(A.build_launch(placement, res, conf, exp, p.spec.output_dir, req.overrides,
                                              launcher=_dry_launcher()))
            console.say(f"\n# stage {p.spec.name} ({p.action}{': ' + p.reason if p.reason else ''})"
                        + (f"; its draft is chained from {p.spec.draft_from} first" if p.spec.draft_from
                           and p.spec.draft_from in {q.spec.name for q in todo} else ""))
            console.say(cmd.shell())
            if req.measuring:
                console.say("# then: " + " ".join(eval_argv(manifest, p.spec))
                            + (f" ; gate: stop unless tau >= {100 - req.gate:g}% of the upstream draft's"
                               if req.gate is not None else ""))
            for line in lines:
                console.say("# " + line)
            console.say("# " + disk[id(p)][0])
        if warning:
            memory_warnings.append(f"{p.spec.name}: {warning}")
    for w in memory_warnings:
        console.warn(w)
    disk_warnings = [f"{p.spec.name}: {disk[id(p)][1]}" for p in todo if disk[id(p)][1]]
    for w in disk_warnings:
        console.warn(w)
    if disk_warnings and not req.force and not req.dry_run:
        raise RefusedError(f"not enough free disk space for {len(disk_warnings)} stage(s); nothing was started",
                           hint="free some space, lower save_total_limit or move output_dir; "
                                f"`longspec run {manifest.root} --force` launches anyway")
    if errors and not req.force:
        # `demo` runs this too and has no --force: the hints name `run`'s.
        raise RefusedError(f"{errors} validation error(s) in the stage(s) to run; nothing was started",
                           hint=f"fix them (`longspec validate` lists them), or launch anyway with "
                                f"`longspec run {manifest.root} --force`")
    if req.dry_run:
        return [_outcome(p.spec, p.action, "not run") for p in plans]
    return execute(manifest, plans, placement, res, req, console)


def _dry_launcher() -> list[str]:
    try:
        return A.deepspeed_command()
    except LongspecError:
        return ["deepspeed"]


def _report_problems(problems: list[Any], console: Console) -> int:
    errors = 0
    for prob in problems:
        where = f"{prob.file}:{prob.line}" if prob.line else str(prob.file)
        text = f"{where}: {prob.message}" + (f" (hint: {prob.hint})" if prob.hint else "")
        if prob.severity == "error":
            errors += 1
            console.err.write(f"error: {text}\n")
        else:
            console.warn(text)
    console.err.flush()
    return errors


def execute(manifest: Manifest, plans: list[StagePlan], placement: A.Placement, res: A.Resources,
            req: RunRequest, console: Console) -> list[StageOutcome]:
    from longspec_cli.core.atomic import locked

    outcomes: list[StageOutcome] = []
    with locked(manifest.root / ".longspec-run", timeout=0.5):
        for i, p in enumerate(plans):
            out: StageOutcome | None = None
            try:
                if p.action == "skip":
                    out = _outcome(p.spec, "skip", "skipped")
                else:
                    out = run_one(manifest, p, placement, res, req, console)
                if req.measuring:
                    measure_stage(manifest, p.spec, out, req, console)  # before the next stage chains
            except LongspecError as e:
                if out is None:
                    out = _outcome(p.spec, p.action, "interrupted" if e.exit_code == INTERRUPTED
                                   else "failed", wall_s=p.wall_s, note=e.message.splitlines()[0])
                elif out.result != GATE_FAILED:  # trained, but its measuring failed or was interrupted
                    out.result = "interrupted" if e.exit_code == INTERRUPTED else "eval failed"
                    out.note = out.note or e.message.splitlines()[0]
                outcomes.append(out)
                outcomes += [_outcome(q.spec, q.action, "not run") for q in plans[i + 1:]]
                print_summary(outcomes, console)
                raise
            outcomes.append(out)
    print_summary(outcomes, console)
    return outcomes


# ----------------------------------------------------------------------------- evaluate + gate

def check_gate(pct: float | None) -> None:
    """--gate P: a percentage in 0..100 (UsageError, exit 2, otherwise)."""
    import math

    if pct is None:
        return
    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not math.isfinite(pct) or pct < 0 or pct > 100:
        raise UsageError(f"--gate {pct!r}: must be a number >= 0 (a percentage, at most 100)",
                         hint="--gate 10 stops the pipeline when a stage's tau is more than 10% below "
                              "its upstream stage's; --gate 0 demands no drop at all")


def _final(spec: StageSpec) -> tuple[Path | None, str | None]:
    """(final weights, their sha256 per stage_complete.json) of a finished stage, else (None, None)."""
    rd = runfolder.RunDir(spec.output_dir)
    complete = rd.stage_complete()
    if complete is None:
        return None, None
    return rd.weights_for(complete), complete.get("sha256")


def current_eval(spec: StageSpec, upstream: StageSpec | None) -> dict | None:
    """The stage's eval.json when it was measured on its final draft (and, for a stage with an
    upstream, with that upstream's final draft as the baseline); None when it must be measured."""
    ev = _eval_of(spec, _final(spec)[1])
    if ev is None:
        return None
    if upstream is not None:
        base = ev.get("baseline")
        if not isinstance(base, dict) or base.get("draft_sha256") != _final(upstream)[1]:
            return None
    return ev


def eval_argv(manifest: Manifest, spec: StageSpec) -> list[str]:
    """`python -m longspec.evaluate` for a stage, as `longspec eval` runs it (default settings)."""
    from longspec_cli.core import quality

    weights, up_name = quality.baseline_draft(manifest.previous(spec.name), planned=True)
    return quality.eval_command(spec.output_dir, spec.name, baseline_draft=weights,
                                baseline_stage=up_name, methods=("chain", "tree"))


def measure_stage(manifest: Manifest, spec: StageSpec, out: StageOutcome, req: RunRequest, console: Console) -> None:
    """Evaluate a finished stage unless its eval.json is current; then, with --gate, the gate.
    Fills out.tau / out.speedup; raises to stop the pipeline (gate failed, or eval failed under --gate)."""
    from longspec_cli.core import quality

    up = manifest.stage(spec.draft_from) if spec.draft_from else None
    ev = current_eval(spec, up)
    if ev is not None:
        console.say(f"== {spec.name}: eval.json is current (tau {ev['tau']:.2f}); not measured again")
    else:
        ev = _run_eval(manifest, spec, out, req, console)
        if ev is None:  # --eval only: a warning was printed, the pipeline goes on
            return
    out.take_eval(ev)
    if req.gate is None:
        if ev.get("lossless") is not True:
            console.warn(f"{spec.name}: speculative output differs from greedy output (not lossless); "
                         f"see {spec.output_dir / quality.EVAL_NAME}")
        return
    ok, msg = quality.gate_stage(spec.output_dir, up.output_dir if up else None, req.gate,
                                 cur_sha256=_final(spec)[1], prev_sha256=_final(up)[1] if up else None)
    console.say(f"== {spec.name}: gate (--gate {req.gate:g}) {'passed' if ok else 'FAILED'}: {msg}")
    if not ok:
        out.result, out.note = GATE_FAILED, f"failed the quality gate (--gate {req.gate:g}): {msg}"
        last = manifest.stages[-1].name == spec.name
        raise RefusedError(f"stage {spec.name} failed the quality gate (--gate {req.gate:g}): {msg}"
                           + ("" if last else "; the next stage was not started"),
                           hint=f"`longspec eval {manifest.root} {spec.name}` shows the figures per prompt")


def _run_eval(manifest: Manifest, spec: StageSpec, out: StageOutcome, req: RunRequest,
              console: Console) -> dict | None:
    """Run the evaluator (as `longspec eval`); the result, or None after a warning (--eval only)."""
    from longspec_cli.core import quality
    from longspec_cli.core.trainerjson import run_trainer_json

    argv = eval_argv(manifest, spec)
    console.say(f"\n== {spec.name}: evaluating\n$ {' '.join(argv)}")
    t0 = time.monotonic()
    try:
        ev = run_trainer_json(argv, show_progress=not req.quiet, allow_codes=(1,))  # 1: not lossless
    except KeyboardInterrupt:
        raise LongspecError(f"stage {spec.name}: evaluation interrupted", exit_code=INTERRUPTED) from None
    except LongspecError as e:
        if e.exit_code == INTERRUPTED:
            raise
        out.note = f"evaluation failed: {e.message.splitlines()[0]}"
        if req.gate is not None:  # no figures, no gate: refused (exit 1), whatever the evaluator's own code
            raise RefusedError(f"stage {spec.name}: evaluation failed, so the gate cannot pass: {e.message}",
                               hint=f"run it alone: `longspec eval {manifest.root} {spec.name}`"
                                    + (f" (the evaluator's hint: {e.hint})" if e.hint else "")) from None
        console.warn(f"{spec.name}: {out.note}")
        return None
    base = ev.get("baseline") if isinstance(ev.get("baseline"), dict) else None
    tree = quality.method_figures(ev, "tree")
    console.say(f"== {spec.name}: tau {ev['tau']:.2f}" + (f" (upstream draft {base['tau']:.2f})" if base else "")
                + (f", tree tau {tree['tau']:.2f}" if tree else "")
                + f", speed-up x{ev.get('speedup', 0):.2f}, lossless {'yes' if ev.get('lossless') else 'NO'}"
                + f" ({time.monotonic() - t0:.1f} s)")
    return ev


def run_one(manifest: Manifest, p: StagePlan, placement: A.Placement, res: A.Resources, req: RunRequest,
            console: Console) -> StageOutcome:
    from longspec_cli.core import chain
    from longspec_cli.launch import process

    spec = p.spec
    if p.action == "rerun":
        moved = _move_aside(spec.output_dir)
        if moved:
            console.say(f"{spec.name}: moved the previous run folder to {moved}")
    if spec.draft_from:
        _chain_into(manifest, spec, console, chain, deep=False if _draft_measured(manifest, spec) else None)
    if req.checked.get(str(spec.config)) != file_state(spec.config):  # chained (or edited) since the preflight
        problems = validation_problems(manifest, [p], res.world_size, only=p, overrides=req.overrides,
                                       world_from=world_label(res))
        if _report_problems([q for q in problems if q.severity == "error"], console) and not req.force:
            raise RefusedError(f"stage {spec.name}: validation errors; not started",
                               hint=f"fix them, or launch anyway with `longspec run {manifest.root} --force`")
    from longspec_cli.launch.prepare import ensure_prepared

    ensure_prepared(manifest, spec, req.overrides, res.world_size, console.say)  # before DeepSpeed starts
    conf, exp = exp_location(spec)
    cmd = with_ops_dir(A.build_launch(placement, res, conf, exp, spec.output_dir, req.overrides))
    console.say(f"\n== {spec.name}: {p.action}{' (' + p.reason + ')' if p.reason else ''}\n$ {cmd.shell()}")
    kw = {k: v for k, v in (("grace_int", req.grace_int), ("grace_term", req.grace_term)) if v is not None}
    result = process.run_stage_process(cmd, spec.output_dir, spec.name, runfolder.config_overrides(req.overrides),
                                       stream=console.out,
                                       quiet=req.quiet, **kw)
    p.wall_s = result.wall_s
    saved = _preempted_event(spec)
    if result.interrupted or result.stopped:
        how = "stopped by `longspec stop`" if result.stopped and not result.interrupted else "interrupted"
        what = (f"after saving checkpoint-{saved['step']}" if saved else f"after {result.wall_s:.0f} s")
        raise LongspecError(f"stage {spec.name} {how} {what}; no process of it is left",
                            hint=f"`longspec run {manifest.root}` resumes it from its newest checkpoint",
                            exit_code=INTERRUPTED)
    if result.returncode != 0 and saved:  # 5 from the ranks, or -15: SIGTERM reached the launcher too
        raise LongspecError(f"stage {spec.name} was preempted ({saved.get('signal') or 'a stop signal'}) at step "
                            f"{saved['step']} and saved checkpoint-{saved['step']}; the next stage was not started",
                            hint=f"`longspec run {manifest.root}` resumes it from step {saved['step']}",
                            exit_code=PREEMPTED)
    rd = runfolder.RunDir(spec.output_dir)
    complete = rd.stage_complete()
    if result.returncode != 0 or complete is None:
        _fail(spec, result, complete, console)
    out = _outcome(spec, p.action, "done", wall_s=result.wall_s)
    console.say(f"== {spec.name}: done in {result.wall_s:.1f} s, {out.steps} steps, final loss "
                f"{out.last_loss if out.last_loss is not None else '?'}, sha256 {(out.sha256 or '?')[:16]}")
    return out


def _preempted_event(spec: StageSpec) -> dict | None:
    """The last lifecycle event of the stage when it is `preempted` (a checkpoint was saved)."""
    events = [e for e in runfolder.RunDir(spec.output_dir).events()
              if e.get("event") in ("start", "resume", "end", "error", "preempted")]
    last = events[-1] if events else None
    return last if last is not None and last.get("event") == "preempted" and isinstance(last.get("step"), int) \
        else None


def ops_build_dir() -> str:
    """TORCH_EXTENSIONS_DIR for the launches: one folder per Python environment, beside torch's own.

    DeepSpeed JIT-builds its CPU ops (cpu_adam, the shm comm op) into torch's extension folder,
    which every environment of a user shares: two environments (two checkouts, two venvs)
    alternating on one machine rebuild each other's ops, about two minutes per launch here."""
    import hashlib

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env_id = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return os.path.join(cache, "torch_extensions", f"longspec-{env_id}")


def with_ops_dir(cmd: A.LaunchCommand) -> A.LaunchCommand:
    """The launch with TORCH_EXTENSIONS_DIR set (unless the user set it: theirs is inherited)."""
    from dataclasses import replace

    if "TORCH_EXTENSIONS_DIR" in os.environ or "TORCH_EXTENSIONS_DIR" in cmd.env:
        return cmd
    return replace(cmd, env={**cmd.env, "TORCH_EXTENSIONS_DIR": ops_build_dir()})


def _draft_measured(manifest: Manifest, spec: StageSpec) -> bool:
    """True when the upstream's final draft was just loaded against this stage's target by the
    evaluator (a current eval.json): the chain's separate load check (a torch subprocess) would
    repeat it."""
    up = manifest.stage(spec.draft_from)
    ev = _eval_of(up, _final(up)[1])
    if ev is None or not isinstance(ev.get("target"), str):
        return False
    c = composed(spec.config)
    target = c.data.get("model_name_or_path") if c.ok and isinstance(c.data, dict) else None
    if not isinstance(target, str) or "${" in target:
        return False
    t = Path(os.path.expanduser(target))
    t = t if t.is_absolute() else manifest.root / t
    return os.path.realpath(t) == os.path.realpath(ev["target"])


def _chain_into(manifest: Manifest, spec: StageSpec, console: Console, chain, deep: bool | None = None) -> None:
    """Point `spec` at its upstream's verified final draft, exactly as `longspec next-stage --to`
    (deep=False: without the subprocess load check, when the evaluator has just done it)."""
    from longspec_cli.core.status import stage_status

    prev = manifest.stage(spec.draft_from)
    if stage_status(prev).state != "done":
        raise RefusedError(f"stage {spec.name} starts from {prev.name}'s draft, but {prev.name} is not done",
                           hint=f"run it first: `longspec run {manifest.root} {prev.name}` (or use --all)")
    result = chain.chain_project(manifest, spec.name, dry_run=False, deep=deep)
    if result is not None:
        state = "set" if result.written else "already set"
        console.say(f"{spec.name}: draft_model_name_or_path {state} to {result.new} "
                    f"(sha256 {(result.draft_sha256 or '?')[:16]}, from {prev.name})")


def _fail(spec: StageSpec, result, complete, console: Console) -> None:
    tail = "\n".join(result.log_tail[-25:])
    log = spec.output_dir / process_log_name()
    if result.missing_module:
        raise RunFailed(f"stage {spec.name}: the training process cannot import {result.missing_module}",
                        hint=A.INSTALL_HINT)
    why = (f"exit code {result.returncode}" if result.returncode != 0
           else "exit code 0 but no stage_complete.json was written")
    console.err.write(f"\n--- last lines of {log} ---\n{tail}\n---\n")
    console.err.flush()
    from longspec_cli.core import diskspace

    free = diskspace.free_bytes(spec.output_dir)
    if free is not None and free < LOW_SPACE_BYTES or "could not write" in tail:
        # train.log may be the very file that could not be written: say it from here too.
        raise RunFailed(f"stage {spec.name} failed ({why}): {diskspace.human(free)} free on the disk of "
                        f"{spec.output_dir}\n{diskspace.resume_sentence(spec.output_dir)}",
                        hint="free some space (or point output_dir elsewhere) and run again")
    raise RunFailed(f"stage {spec.name} failed ({why}); the next stage was not started",
                    hint=f"full log: {log}")


def process_log_name() -> str:
    from longspec_cli.launch.process import TRAIN_LOG

    return TRAIN_LOG


def _outcome(spec: StageSpec, action: str, result: str, wall_s: float | None = None, note: str = "") -> StageOutcome:
    rd = runfolder.RunDir(spec.output_dir)
    out = StageOutcome(name=spec.name, action=action, result=result, wall_s=wall_s, note=note)
    if result in ("not run",):
        return out
    complete = rd.stage_complete()
    steps = [r for r in rd.metrics().steps]
    if steps:
        out.first_loss = _num(steps[0].get("loss"))
        out.last_loss = _num(steps[-1].get("loss"))
        rates = [_num(r.get("tokens_per_s")) for r in steps]
        rates = [r for r in rates if r]
        out.tokens_per_s = sum(rates) / len(rates) if rates else None
        out.steps = steps[-1].get("step") if isinstance(steps[-1].get("step"), int) else None
    if complete is not None:
        out.sha256 = complete.get("sha256")
        ev = _eval_of(spec, out.sha256)
        if ev is not None:
            out.take_eval(ev)
        if isinstance(complete.get("steps"), int):
            out.steps = complete["steps"]
        if _num(complete.get("final_loss")) is not None:
            out.last_loss = _num(complete.get("final_loss"))
    return out


def _eval_of(spec: StageSpec, sha256: str | None) -> dict | None:
    """The stage's eval.json when it was measured on the draft with this sha256, else None."""
    from longspec_cli.core import quality

    try:
        ev = quality.read_eval(spec.output_dir)
    except quality.EvalFileError:
        return None
    return ev if ev is not None and quality.eval_is_current(ev, sha256) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def print_summary(outcomes: list[StageOutcome], console: Console) -> None:
    rows = [SUMMARY_HEADER] + [o.row() for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_HEADER))]
    console.say("")
    for n, r in enumerate(rows):
        console.say("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            console.say("  ".join("-" * w for w in widths))
    for o in outcomes:
        if o.note:
            console.say(f"{o.name}: {o.note}")
