"""A stage's run record (`<output_dir>/run.json`): where the stage runs, and whether that still holds.

Every launch path writes it through this module, and `status`, `run`'s planner, `stop` and the
monitor read it through `owner()`:

    kind local  a process group started by `longspec run` on `host` (one node, or the launching node
                of a multi-node run, whose `hosts` it lists): pid = pgid = the launcher, proc_start
                tells a reused pid apart (longspec/machine/liveness.py)
    kind slurm  a SLURM job (`job_id`): `phase` queued (submitted; the stage has not started in the
                job yet), running (its step runs: `nodes`, `restarts`), ended (`returncode`)

`owner(info)` answers one question: does a live run own this folder now, and how to say so.
A SLURM job owns a stage's folder while the job is queued or running and the stage is queued, runs,
or stopped with a checkpoint that the requeued job resumes. Pure: psutil (liveness) and the
scheduler's command-line tools (longspec/runs/scheduler.py), both imported when a record needs them.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from longspec.runs import runfolder
from longspec.files.atomic import atomic_write_json, locked

LOCAL, SLURM = "local", "slurm"
PREEMPTED_RC = 5  # the trainer's exit code after saving on a stop signal (docs/DESIGN.md)


@dataclass(frozen=True)
class Owner:
    """What holds a run folder. state: running | queued | requeued (a live run owns it), None (none
    does), or "unknown" (it cannot be checked from here: another host, or SLURM cannot be asked)."""

    state: str | None
    where: str  # "process 123 on host h", "SLURM job 42 on node[1-2]"
    detail: str = ""  # why unknown, or the job's state and reason
    job_id: str | None = None

    @property
    def live(self) -> bool:
        return self.state in ("running", "queued", "requeued")


def kind(info: dict | None) -> str:
    return SLURM if isinstance(info, dict) and info.get("kind") == SLURM else LOCAL


def read(output_dir: Path) -> dict | None:
    info, _ = runfolder.read_json(Path(output_dir) / runfolder.RUN_INFO)
    return info


def write(output_dir: Path, info: dict) -> None:
    """The whole record, atomically (a reader sees the old or the new one)."""
    atomic_write_json(Path(output_dir) / runfolder.RUN_INFO, info)


def update(output_dir: Path, **fields) -> dict | None:
    """Add fields to the record under a lock; None (nothing written) when there is no record."""
    path = Path(output_dir) / runfolder.RUN_INFO
    with locked(path, timeout=10.0):
        info = read(output_dir)
        if info is None:
            return None
        info = {**info, **fields}
        write(output_dir, info)
        return info


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ------------------------------------------------------------------------------------ SLURM


def slurm_submitted(output_dir: Path, stage: str, job_id: str, *, nodes: int, ranks_per_node: int,
                    overrides: list[str], script: str) -> None:
    """The record of a stage that a submitted job will run (written by `run --slurm --submit`)."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    write(output_dir, {"kind": SLURM, "job_id": str(job_id), "phase": "queued", "stage": stage,
                       "output_dir": str(output_dir), "host": socket.gethostname(), "submitted_at": utc_now(),
                       "submitted_unix": time.time(), "num_nodes": nodes, "ranks_per_node": ranks_per_node,
                       "world_size": nodes * ranks_per_node, "overrides": list(overrides), "script": script})


def slurm_stage_begins(output_dir: Path, stage: str, env: dict[str, str]) -> dict:
    """Inside the job, before the stage's step: phase running, on which nodes, after how many requeues."""
    old = read(output_dir) or {}
    info = {**{k: v for k, v in old.items() if k not in ("returncode", "ended_at", "ended_unix", "pid",
                                                         "pgid", "proc_start", "interrupted")},
            "kind": SLURM, "job_id": env.get("SLURM_JOB_ID", old.get("job_id")), "phase": "running",
            "stage": stage, "output_dir": str(output_dir), "host": socket.gethostname(),
            "nodes": env.get("SLURM_JOB_NODELIST", ""), "restarts": _int(env.get("SLURM_RESTART_COUNT")),
            "started_at": utc_now(), "started_unix": time.time()}
    if old.get("job_id") != info["job_id"]:
        info.pop("stop_requested_at", None)  # a request to another job is not one to this job
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    write(output_dir, info)
    return info


def slurm_stage_ends(output_dir: Path, returncode: int) -> dict | None:
    return update(output_dir, phase="ended", returncode=returncode, ended_at=utc_now(), ended_unix=time.time())


def _int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


# ------------------------------------------------------------------------------------ owner


def owner(info: dict | None) -> Owner:
    """Does a live run own the folder this record is in? (See the module docstring.)"""
    if not isinstance(info, dict):
        return Owner(None, "")
    if kind(info) == SLURM:
        return _slurm_owner(info)
    from longspec.machine import liveness  # psutil: only when a record is there

    host = info.get("host") or "?"
    where = f"process {info.get('pid')} on {host}"
    hosts = info.get("hosts")
    if isinstance(hosts, list) and hosts:
        where += f" (ranks on {', '.join(str(h) for h in hosts)})"
    alive = liveness.run_alive(info)
    if alive is None:
        return Owner("unknown", where, f"started on host {liveness.other_host(info)}; its process cannot be "
                                       "checked from here")
    return Owner("running" if alive else None, where)


def _slurm_owner(info: dict) -> Owner:
    from longspec.runs import scheduler

    job_id = str(info.get("job_id"))
    phase = info.get("phase")
    if phase == "ended" and info.get("returncode") == 0:
        return Owner(None, f"SLURM job {job_id}", job_id=job_id)  # the stage finished: no need to ask
    try:
        job = scheduler.job(job_id)
    except scheduler.SchedulerUnavailable as e:
        if phase == "ended":  # it stopped; whether the job requeued cannot be told: the run folder says
            return Owner(None, f"SLURM job {job_id}", f"SLURM cannot be asked from here ({e})", job_id)
        return Owner("unknown", f"SLURM job {job_id}", f"SLURM cannot be asked from here ({e})", job_id)
    if job is None or not job.alive:
        ended = f" ({job.state})" if job is not None else ""
        return Owner(None, f"SLURM job {job_id}{ended}", job_id=job_id)
    where = f"SLURM job {job_id}" + (f" on {job.nodes}" if job.nodes else "")
    detail = job.state + (f" ({job.reason})" if job.reason and job.reason != "None" else "") \
        + (f", requeued {job.restarts}x" if job.restarts else "")
    if phase == "running":
        return Owner("running" if job.running else "requeued", where, detail, job_id)
    if phase == "ended":  # it stopped early: a requeued job resumes it when it runs again
        requeued = info.get("returncode") == PREEMPTED_RC or not job.running
        return Owner("requeued" if requeued else None, where, detail, job_id)
    return Owner("queued", where, detail, job_id)


def stop_requested(info: dict | None) -> bool:
    return isinstance(info, dict) and bool(info.get("stop_requested_at"))
