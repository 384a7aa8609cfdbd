"""`longspec run`: the whole run (plan.py, preflight.py, then the launches, gate.py between them).

    execute   per stage: chain its draft from the upstream (launch.chain, as `next-stage`), validate
              it, launch (process.py), require stage_complete.json; stop at the first failure
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

from longspec.machine import opsdir
from longspec.runs import runfolder
from longspec.project.manifest import Manifest, StageSpec
from longspec.errors import INTERRUPTED, PREEMPTED, LongspecError, RefusedError, RunFailed
from longspec_cli.launch import argv as A
from longspec_cli.launch.gate import GATE_FAILED, check_gate, draft_measured, eval_argv, eval_of, measure_stage
from longspec_cli.launch.plan import (Console, RunRequest, StageOutcome, StagePlan, as_float, exp_location,
                                      file_state, plan_stages)
from longspec_cli.launch.preflight import (check_overrides, disk_reports, memory_report, refuse_unless_forced,
                                           report_problems, resolve_placement, validation_problems, world_label)


LOW_SPACE_BYTES = 64 * 1024 ** 2  # a failed stage with less free than this is reported as a full disk


SUMMARY_HEADER = ["stage", "action", "result", "steps", "first loss", "last loss", "tokens/s", "wall s",
                  "sim tau", "tau", "speed-up", "tree tau", "sha256"]


def prepare(req: RunRequest, console: Console) -> tuple[Manifest, list[StagePlan], A.Placement, A.Resources]:
    from longspec.project.manifest import load_manifest

    check_gate(req.gate)
    manifest = load_manifest(req.project)
    first = manifest.stage(req.stage) if req.stage else manifest.stages[0]
    check_overrides(first, req.overrides)
    placement = resolve_placement(manifest, req.placement)
    res = A.resolve_resources(placement, A.detect_gpus(), manifest.launch.gpus, force=req.force)
    plans = plan_stages(manifest, req, res.world_size)
    return manifest, plans, placement, res


def run_request(req: RunRequest, console: Console | None = None) -> list[StageOutcome]:
    """The whole `longspec run`; returns the outcomes (raises for refusals and failures)."""
    console = console or Console()
    manifest, plans, placement, res = prepare(req, console)
    todo = [p for p in plans if p.action != "skip"]
    console.say(f"project {manifest.name}: {len(todo)} stage(s) to run on {res.where()}, world size {res.world_size}")
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
    errors = report_problems(problems, console)
    if not req.dry_run:
        A.deepspeed_command()  # DeepSpeed and torch importable, else one sentence on the extra
    memory_warnings = []
    disk = {id(p): (line, warning) for p, line, warning in disk_reports(manifest, todo, req.overrides, res)}
    for p in todo:
        lines, warning = memory_report(manifest, p.spec, req.overrides, res, req.gpu_mem_gib)
        if req.dry_run:
            conf, exp = exp_location(p.spec)
            cmd = launch_command(placement, res, conf, exp, p.spec.output_dir, req.overrides, dry=True)
            console.say(f"\n# stage {p.spec.name} ({p.action}{': ' + p.reason if p.reason else ''})"
                        + (f"; its draft is chained from {p.spec.draft_from} first" if p.spec.draft_from
                           and p.spec.draft_from in {q.spec.name for q in todo} else ""))
            console.say(cmd.shell())
            for line in cmd.comments:
                console.say("# " + line)
            if req.measuring:
                console.say("# then: " + " ".join(eval_argv(manifest, p.spec))
                            + (f" ; gate: stop unless tau >= {100 - req.gate:g}% of the input draft's"
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
    # `demo` runs this too and has no --force: the hints name `run`'s. A dry run only warns of disk.
    refuse_unless_forced(manifest, errors, [] if req.dry_run else disk_warnings, force=req.force)
    if req.dry_run:
        return [_outcome(p.spec, p.action, "not run") for p in plans]
    return execute(manifest, plans, placement, res, req, console)


def launch_command(placement: A.Placement, res: A.Resources, conf: Path, exp: str, output_dir: Path,
                   overrides: list[str], dry: bool = False) -> A.LaunchCommand:
    """One stage's launch: DeepSpeed's runner on one node, longspec's own over ssh on several
    (launch/nodes.py), with the ops folder either way."""
    from longspec_cli.launch import nodes

    if nodes.uses_nodes(placement):
        extra = {} if "TORCH_EXTENSIONS_DIR" in os.environ else {"TORCH_EXTENSIONS_DIR": opsdir.ops_build_dir()}
        return nodes.build_launch(placement, res, A.trainer_args(conf, exp, output_dir, overrides),
                                  Path(conf).parent, extra_env=extra)
    if one_cpu_rank(placement, res):
        # The trainer runs as a world of one by itself (longspec.training.rank.single_process_env):
        # DeepSpeed's runner and per-node launcher would add two interpreters that import torch and
        # DeepSpeed, start to finish, to every stage.
        module_args = A.trainer_args(conf, exp, output_dir, overrides)[1:]          # without --module
        return with_ops_dir(A.LaunchCommand(argv=[sys.executable, "-u", "-m", *module_args],
                                            env={**A.cpu_env(res), "LONGSPEC_WORLD_OF_ONE": "1"},
                                            world_size=1, cpu=True))
    return with_ops_dir(A.build_launch(placement, res, conf, exp, output_dir, overrides,
                                       launcher=_dry_launcher() if dry else None))


def one_cpu_rank(placement: A.Placement, res: A.Resources) -> bool:
    """One CPU rank on this machine, with no launcher flag asked for: the trainer starts directly."""
    return (res.cpu and res.world_size == 1 and not placement.multi_node and not placement.include
            and not placement.launcher and placement.master_port is None and placement.master_addr is None)


def _dry_launcher() -> list[str]:
    try:
        return A.deepspeed_command()
    except LongspecError:
        return ["deepspeed"]


def execute(manifest: Manifest, plans: list[StagePlan], placement: A.Placement, res: A.Resources,
            req: RunRequest, console: Console) -> list[StageOutcome]:
    from longspec.files.atomic import locked

    from contextlib import nullcontext

    from longspec_cli.launch.evalworker import EvalWorker

    outcomes: list[StageOutcome] = []
    # one measuring process for the run's stages where it holds no GPU (eval decodes on the CPU)
    shared = req.measuring and not A.detect_gpus()
    with locked(manifest.root / ".longspec-run", timeout=0.5), (EvalWorker() if shared else nullcontext()) as worker:
        clear_stale_op_locks(console)
        for i, p in enumerate(plans):
            out: StageOutcome | None = None
            try:
                if p.action == "skip":
                    out = _outcome(p.spec, "skip", "skipped")
                else:
                    out = run_one(manifest, p, placement, res, req, console)
                if req.measuring:
                    measure_stage(manifest, p.spec, out, req, console, worker)  # before the next stage chains
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


def run_one(manifest: Manifest, p: StagePlan, placement: A.Placement, res: A.Resources, req: RunRequest,
            console: Console) -> StageOutcome:
    from longspec_cli.launch import chain
    from longspec_cli.launch import process

    spec = p.spec
    if p.action == "rerun":
        moved = _move_aside(spec.output_dir)
        if moved:
            console.say(f"{spec.name}: moved the previous run folder to {moved}")
    if spec.draft_from:
        _chain_into(manifest, spec, console, chain, deep=False if draft_measured(manifest, spec) else None)
    if req.checked.get(str(spec.config)) != file_state(spec.config):  # chained (or edited) since the preflight
        problems = validation_problems(manifest, [p], res.world_size, only=p, overrides=req.overrides,
                                       world_from=world_label(res))
        if report_problems([q for q in problems if q.severity == "error"], console) and not req.force:
            raise RefusedError(f"stage {spec.name}: validation errors; not started",
                               hint=f"fix them, or launch anyway with `longspec run {manifest.root} --force`")
    from longspec_cli.launch.prepare import ensure_prepared

    ensure_prepared(manifest, spec, req.overrides, res.world_size, console.say)  # before DeepSpeed starts
    conf, exp = exp_location(spec)
    cmd = launch_command(placement, res, conf, exp, spec.output_dir, req.overrides)
    console.say(f"\n== {spec.name}: {p.action}{' (' + p.reason + ')' if p.reason else ''}\n$ {cmd.shell()}")
    kw = {k: v for k, v in (("grace_int", req.grace_int), ("grace_term", req.grace_term)) if v is not None}
    result = process.run_stage_process(cmd, spec.output_dir, spec.name, runfolder.config_overrides(req.overrides),
                                       stream=console.out,
                                       quiet=req.quiet, **kw)
    p.wall_s = result.wall_s
    saved = _preempted_event(spec)
    if saved and saved.get("time", 0) < result.started_unix - 1:
        saved = None  # a preemption of an earlier launch
    left = "no process of it is left"
    if result.nodes is not None:
        from longspec_cli.launch.nodes import leftovers_sentence

        left = leftovers_sentence(result.nodes, cmd.hosts)
    if result.interrupted or result.stopped:
        how = "stopped by `longspec stop`" if result.stopped and not result.interrupted else "interrupted"
        what = (f"after saving checkpoint-{saved['step']}" if saved else f"after {result.wall_s:.0f} s")
        raise LongspecError(f"stage {spec.name} {how} {what}; {left}",
                            hint=f"`longspec run {manifest.root}` resumes it from its newest checkpoint",
                            exit_code=INTERRUPTED)
    if result.returncode != 0 and saved:  # 5 from the ranks, or -15: SIGTERM reached the launcher too
        raise LongspecError(f"stage {spec.name} was preempted ({saved.get('signal') or 'a stop signal'}) at step "
                            f"{saved['step']} and saved checkpoint-{saved['step']}; the next stage was not started",
                            hint=f"`longspec run {manifest.root}` resumes it from step {saved['step']}",
                            exit_code=PREEMPTED)
    rd = runfolder.RunDir(spec.output_dir)
    complete = rd.stage_complete()
    if result.nodes and result.nodes.get("fault"):
        from longspec.runs.diskspace import resume_sentence

        raise RunFailed(f"stage {spec.name} failed in {result.wall_s:.0f} s: {result.nodes['fault']}; {left}\n"
                        f"{resume_sentence(spec.output_dir)}", hint=f"full log: {spec.output_dir / process_log_name()}")
    if result.returncode != 0 or complete is None:
        _fail(spec, result, complete, console)
    out = _outcome(spec, p.action, "done", wall_s=result.wall_s)
    console.say(f"== {spec.name}: done in {result.wall_s:.1f} s, {out.steps} steps, final loss "
                f"{out.last_loss if out.last_loss is not None else '?'}, sha256 {(out.sha256 or '?')[:16]}")
    return out


def _preempted_event(spec: StageSpec) -> dict | None:
    """The last lifecycle event of the stage when it is `preempted` (a checkpoint was saved)."""
    last = runfolder.last_lifecycle_event(runfolder.RunDir(spec.output_dir).events())
    return last if last is not None and last.get("event") == "preempted" and isinstance(last.get("step"), int) \
        else None


def clear_stale_op_locks(console: Console, folder: str | None = None) -> list[str]:
    """Remove the locks stopped op builds left in the ops folder (longspec/machine/opsdir.py), said once each,
    so the launch does not wait for them forever."""
    removed = []
    for lock in opsdir.stale_locks(folder or opsdir.launch_folder()):
        try:
            lock.unlink()
        except FileNotFoundError:       # its build just ended
            continue
        except OSError as e:
            console.warn(f"a stopped build of DeepSpeed's {lock.parent.name} op left {lock}, and it could "
                         f"not be removed ({e.strerror}): remove it, or the launch waits for it forever")
            continue
        removed.append(str(lock))
        console.warn(f"removed {lock}: a build of DeepSpeed's {lock.parent.name} op stopped midway and left "
                     "it (no process holds it); the op builds again")
    return removed


def with_ops_dir(cmd: A.LaunchCommand) -> A.LaunchCommand:
    """The launch with TORCH_EXTENSIONS_DIR set (unless the user set it: theirs is inherited)."""
    from dataclasses import replace

    if "TORCH_EXTENSIONS_DIR" in os.environ or "TORCH_EXTENSIONS_DIR" in cmd.env:
        return cmd
    return replace(cmd, env={**cmd.env, "TORCH_EXTENSIONS_DIR": opsdir.ops_build_dir()})


def _chain_into(manifest: Manifest, spec: StageSpec, console: Console, chain, deep: bool | None = None) -> None:
    """Point `spec` at its upstream's verified final draft, exactly as `longspec next-stage --to`
    (deep=False: without the subprocess load check, when the evaluator has just done it)."""
    from longspec.runs.status import stage_status

    prev = manifest.stage(spec.draft_from)        # (the manifest's draft_pick: final or best draft)
    if stage_status(prev).state != "done":
        raise RefusedError(f"stage {spec.name} starts from {prev.name}'s draft, but {prev.name} is not done",
                           hint=f"run it first: `longspec run {manifest.root} {prev.name}` (or use --all)")
    result = chain.chain_project(manifest, spec.name, dry_run=False, deep=deep, pick=spec.draft_pick)
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
    from longspec.runs import diskspace

    free = diskspace.free_bytes(spec.output_dir)
    if free is not None and free < LOW_SPACE_BYTES or "could not write" in tail:
        # train.log may be the very file that could not be written: say it from here too.
        raise RunFailed(f"stage {spec.name} failed ({why}): {diskspace.human(free)} free on the disk of "
                        f"{spec.output_dir}\n{diskspace.resume_sentence(spec.output_dir)}",
                        hint="free some space (or point output_dir elsewhere) and run again")
    gpu = any(w in tail for w in GPU_WORDS)
    raise RunFailed(f"stage {spec.name} failed ({why}); the next stage was not started",
                    hint=f"full log: {log}" + ("; `longspec doctor` checks this machine's GPUs, CUDA, NCCL and "
                                               "DeepSpeed ops" if gpu else ""))


# Words in a failed stage's log that point at the machine rather than the config.
GPU_WORDS = ("CUDA", "NCCL", "cuDNN", "nvcc", "TORCH_CUDA_ARCH_LIST", "device type", "flash", "OutOfMemory")


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
        out.first_loss = as_float(steps[0].get("loss"))
        out.last_loss = as_float(steps[-1].get("loss"))
        rates = [as_float(r.get("tokens_per_s")) for r in steps]
        rates = [r for r in rates if r]
        out.tokens_per_s = sum(rates) / len(rates) if rates else None
        out.steps = steps[-1].get("step") if isinstance(steps[-1].get("step"), int) else None
    sim = rd.last_simtau_record()             # eval's chain tau while training, at the stage's last evaluation
    out.sim_tau = as_float(sim.get("tau")) if sim else None
    out.sim_cost = _sim_cost(rd) if sim else None
    if complete is not None:
        out.sha256 = complete.get("sha256")
        ev = eval_of(spec, out.sha256)
        if ev is not None:
            out.take_eval(ev)
        if isinstance(complete.get("steps"), int):
            out.steps = complete["steps"]
        if as_float(complete.get("final_loss")) is not None:
            out.last_loss = as_float(complete.get("final_loss"))
    return out


def _sim_cost(rd: runfolder.RunDir) -> tuple | None:
    """(seconds the trainer spent on tau while training, its wall seconds) from metrics.jsonl."""
    log = rd.metrics()
    loop = log.loop_seconds
    return None if loop is None else (log.tau_seconds, loop)


def _cost_text(o: StageOutcome) -> str:
    spent, loop = o.sim_cost
    whole = f"{spent / o.wall_s:.1%}, " if o.wall_s else ""
    return f"{o.name} {spent:.1f} s of {o.wall_s or loop:.1f} s ({whole}{spent / loop:.1%} of {loop:.1f} s)"


def print_summary(outcomes: list[StageOutcome], console: Console) -> None:
    rows = [SUMMARY_HEADER] + [o.row() for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_HEADER))]
    console.say("")
    for n, r in enumerate(rows):
        console.say("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            console.say("  ".join("-" * w for w in widths))
    measured = [o for o in outcomes if o.by_length]
    if measured:
        console.say("\ntau by context length (prompt tokens; the input draft's on the same prompts in brackets):")
        for o in measured:
            console.say(f"  {o.name}: " + "  ".join(
                f"{r['label']} {r['tau']:.2f}" + (f" ({r['baseline_tau']:.2f})" if r["baseline_tau"] is not None else "")
                for r in o.by_length))
    costed = [o for o in outcomes if o.sim_cost]
    if costed:
        console.say("\nsim tau (eval's chain tau while training) cost, of the stage's wall time (of its "
                    "training loop's): " + "  ".join(_cost_text(o) for o in costed))
    for o in outcomes:
        if o.note:
            console.say(f"{o.name}: {o.note}")


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
