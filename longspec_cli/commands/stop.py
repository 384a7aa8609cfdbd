"""`longspec stop DIR [STAGE]`: stop a running stage from another terminal (every rank, no leftovers)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec stop demo                    save a checkpoint, then stop

  longspec stop demo long --now         stop at once, without a checkpoint

  longspec stop demo --save-timeout 1800

A stage run by a SLURM job (`run --slurm --submit`) is stopped through the scheduler: the job's
batch shell and steps get SIGUSR1, the ranks save and the job ends without requeueing itself; a
queued job, or one still running after --save-timeout, is cancelled (`--now`: at once).
A run on several nodes (`run --hostfile`) is stopped through its leader, which passes the request
to every node (--now: every rank ends at once) and checks each host over ssh before it ends.
Otherwise the training ranks get SIGTERM: each finishes its optimizer step, saves a checkpoint and exits
(`longspec run DIR` later resumes from it). If they have not ended after --save-timeout seconds,
or with --now, the run's process group gets SIGINT, then SIGTERM, then SIGKILL (--timeout apart),
until none of its processes is left. run.json must still name a live process of that run (pid,
start time, host): a stale run.json whose pid now belongs to another process is never signalled.
Exit codes: 0 stopped, 1 nothing running, 2 usage."""


def stop(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stage: Optional[str] = typer.Argument(None, help="Stage to stop (default: any running stage).",
                                          show_default=False),
    timeout: float = typer.Option(15.0, "--timeout", help="Seconds after SIGINT (and again after "
                                  "SIGTERM) before the next signal, when stopping without a save."),
    now: bool = typer.Option(False, "--now", help="Stop at once, without saving a checkpoint first."),
    save_timeout: float = typer.Option(600.0, "--save-timeout", help="Seconds the ranks may take to "
                                       "save a checkpoint before they are stopped without one."),
) -> None:
    """Stop a running training stage: save a checkpoint first (SIGTERM to the ranks), then stop."""

    def body() -> None:
        from longspec.runs import runrecord
        from longspec.project.manifest import load_manifest
        from longspec.errors import RefusedError, UsageError
        from longspec_cli.launch import group

        if timeout < 0 or save_timeout < 0:
            raise UsageError("--timeout and --save-timeout must be >= 0")
        manifest = load_manifest(project_dir)
        specs = [manifest.stage(stage)] if stage else manifest.stages
        stopped, stale = [], []
        stopped += _stop_jobs(manifest, specs, save=not now, save_timeout=save_timeout)
        for spec in specs:
            info = runrecord.read(spec.output_dir)
            if info is None or runrecord.kind(info) == runrecord.SLURM:
                continue
            outcome = group.stop_run(spec.output_dir, spec.name, grace_int=timeout, grace_term=timeout,
                                     say=typer.echo, save=not now, save_timeout=save_timeout)
            if outcome is None:
                if info.get("returncode") is None:
                    stale.append(f"{spec.name} (run.json pid {info.get('pid')})")
                continue
            left = f"; {len(outcome.remaining)} process(es) remain" if outcome.remaining else ""
            if outcome.saved:
                from longspec.runs.diskspace import resume_sentence

                typer.echo(f"stopped {spec.name}: checkpoint saved; {resume_sentence(spec.output_dir)}")
            else:
                typer.echo(f"stopped {spec.name}: process group {outcome.pid} ended after {outcome.signal}{left}")
            stopped.append(spec.name)
        if not stopped:
            what = f"stage {stage}" if stage else f"any stage of {manifest.name}"
            detail = (f"; stale run.json left alone (its process is gone or is another program): "
                      f"{', '.join(stale)}") if stale else ""
            raise RefusedError(f"nothing to stop: {what} is not running{detail}",
                               hint=f"`longspec status {manifest.root}` shows each stage's state")

    run_cli(body)


def _stop_jobs(manifest, specs, *, save: bool, save_timeout: float) -> list[str]:
    """Stop the live SLURM jobs that own the chosen stages; every stage a job holds is stopped with it."""
    from longspec.runs import runrecord, scheduler
    from longspec.runs.diskspace import resume_sentence
    from longspec.errors import RefusedError
    from longspec_cli.launch.jobrecord import stop_job

    jobs: dict[str, list] = {}
    for spec in specs:
        info = runrecord.read(spec.output_dir)
        if runrecord.kind(info) != runrecord.SLURM:
            continue
        own = runrecord.owner(info)
        if own.state == "unknown":
            raise RefusedError(f"stage {spec.name}: {own.where}: {own.detail}",
                               hint=f"run `longspec stop` where SLURM answers, or `scancel {own.job_id}`")
        if own.live:
            jobs.setdefault(own.job_id, [])
    for spec in manifest.stages:  # every record of those jobs: none of them may requeue
        info = runrecord.read(spec.output_dir)
        if runrecord.kind(info) == runrecord.SLURM and str(info.get("job_id")) in jobs:
            jobs[str(info["job_id"])].append((spec.name, spec.output_dir))
    stopped = []
    for job_id, records in jobs.items():
        try:
            res = stop_job(job_id, records, save=save, save_timeout=save_timeout, say=typer.echo)
        except scheduler.SchedulerUnavailable as e:
            raise RefusedError(f"SLURM job {job_id}: {e}", hint=f"`scancel {job_id}` stops it") from None
        if res.saved:
            saved_in = next((out for name, out in records if _last_event(out) == "preempted"), records[0][1])
            typer.echo(f"stopped SLURM job {job_id} in {res.wall_s:.0f} s: checkpoint saved; "
                       f"{resume_sentence(saved_in)}")
        else:
            typer.echo(f"stopped SLURM job {job_id} in {res.wall_s:.0f} s ({res.state}"
                       f"{', cancelled' if res.cancelled else ''})")
        stopped += res.stages
    return stopped


def _last_event(out) -> str | None:
    from longspec.runs import runfolder

    last = runfolder.last_lifecycle_event(runfolder.RunDir(out).events())
    return None if last is None else last.get("event")


def register(app: typer.Typer) -> None:
    app.command("stop", epilog=EPILOG)(stop)
