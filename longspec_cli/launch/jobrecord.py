"""A SLURM job's side of the run record: the batch script's entry points, the submission, `stop`.

`python -m longspec_cli.launch.jobrecord`, from the batch script:

    begin OUTPUT_DIR --stage NAME     before the stage's step: phase running (job id, nodes, requeues)
    end OUTPUT_DIR --rc N             after it: phase ended, its exit code
    stop-requested OUTPUT_DIR         exit 0 when `longspec stop` asked this job to stop (the script
                                      then ends without requeueing itself), else 1

`record_submission` is `run --slurm --submit`'s side: every stage the job will run is recorded as
queued under the job id, so `status`, `run` and `stop` see the job before it starts. `stop_job` is
`longspec stop` for a job: the request is written into every record of the job (so the batch script
does not requeue itself), then the job's batch shell and steps get SIGUSR1 (the ranks save at their
step and exit 5), and the job is waited for; a queued job, `--now` or a save that takes too long is
cancelled outright. The record's format and meaning belong to longspec/runs/runrecord.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from longspec.runs import runrecord


def record_submission(stages: list[tuple[str, Path]], job_id: str, *, nodes: int, ranks_per_node: int,
                      overrides: list[str], script: Path) -> None:
    for name, out in stages:
        runrecord.slurm_submitted(out, name, job_id, nodes=nodes, ranks_per_node=ranks_per_node,
                                  overrides=overrides, script=str(script))


@dataclass
class JobStop:
    job_id: str
    stages: list[str]  # the stages whose records name the job
    saved: bool  # the job ended after its ranks saved (a `preempted` event), without being cancelled
    cancelled: bool  # scancel ended it (queued, --now, or the save took too long)
    state: str  # the job's state at the end ("gone" when the scheduler no longer knows it)
    wall_s: float


def stop_job(job_id: str, records: list[tuple[str, Path]], *, save: bool, save_timeout: float,
             say: Callable[[str], None] = print, poll_s: float = 1.0) -> JobStop:
    """Stop SLURM job `job_id`, whose run records are `records` [(stage, output_dir)]."""
    from longspec.runs import scheduler

    t0 = time.monotonic()
    for _, out in records:
        runrecord.update(out, stop_requested_at=runrecord.utc_now())
    job = scheduler.job(job_id)
    cancelled = False
    if job is not None and job.alive and save and job.running:
        say(f"SLURM job {job_id}: SIGUSR1 to its batch shell and steps; the ranks finish their optimizer step, "
            f"save a checkpoint and stop (up to {save_timeout:.0f} s; `longspec stop --now` stops without saving)")
        scheduler.cancel(job_id, "USR1", full=True)
        job = _wait_job(job_id, save_timeout, poll_s)
    if job is not None and job.alive:
        if not save or not job.running:
            say(f"SLURM job {job_id}: cancelling it" + (" (queued: nothing to save)" if not job.running else ""))
        else:
            say(f"SLURM job {job_id}: still running after {save_timeout:.0f} s; cancelling it")
        if job.running:
            scheduler.cancel(job_id, "KILL", full=True)
        scheduler.cancel(job_id)
        cancelled = True
        job = _wait_job(job_id, 120.0, poll_s)
    saved = not cancelled and any(_preempted(out) for _, out in records)
    return JobStop(job_id, [name for name, _ in records], saved, cancelled,
                   job.state if job is not None else "gone", time.monotonic() - t0)


def _wait_job(job_id: str, timeout: float, poll_s: float):
    """Until the job neither runs nor waits in the queue with a start ahead (bounded)."""
    from longspec.runs import scheduler

    deadline = time.monotonic() + timeout
    while True:
        job = scheduler.job(job_id)
        if job is None or not job.alive or time.monotonic() >= deadline:
            return job
        time.sleep(poll_s)


def _preempted(out: Path) -> bool:
    from longspec.runs import runfolder

    last = runfolder.last_lifecycle_event(runfolder.RunDir(out).events())
    return last is not None and last.get("event") == "preempted"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec_cli.launch.jobrecord")
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("begin")
    b.add_argument("output_dir", type=Path)
    b.add_argument("--stage", required=True)
    e = sub.add_parser("end")
    e.add_argument("output_dir", type=Path)
    e.add_argument("--rc", type=int, required=True)
    s = sub.add_parser("stop-requested")
    s.add_argument("output_dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.what == "begin":
            runrecord.slurm_stage_begins(args.output_dir, args.stage, dict(os.environ))
        elif args.what == "end":
            runrecord.slurm_stage_ends(args.output_dir, args.rc)
        else:
            info = runrecord.read(args.output_dir)
            job = os.environ.get("SLURM_JOB_ID")
            asked = runrecord.stop_requested(info) and (job is None or str(info.get("job_id")) == job)
            return 0 if asked else 1
    except OSError as e:  # the record is advisory for the job: say so, never end the job over it
        print(f"longspec: run record in {args.output_dir}: {e.strerror or e}", file=sys.stderr)
        return 1 if args.what == "stop-requested" else 0  # unreadable: no stop was asked, requeue
    return 0


if __name__ == "__main__":
    sys.exit(main())
