"""What SLURM says of a job, and asking it to signal or cancel one: the one place that talks to it.

    job(job_id)                    JobInfo (state, restarts, nodes, reason) or None (unknown to it)
    cancel(job_id, signal, batch)  `scancel`: a signal to the batch shell (batch=True, where the
                                   batch script forwards it to the running step) or the whole job

`scontrol show job -o ID` answers from slurmctld's memory, so it works without an accounting
database; a job finished longer ago than the cluster's MinJobAge is "unknown", which callers read
as "no longer queued or running". Every call is bounded (TIMEOUT_S). Pure: subprocess only.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

TIMEOUT_S = 10.0
# JobState values (scontrol/squeue) under which the job still owns its run folders.
QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD",
                    "SUSPENDED", "SPECIAL_EXIT", "RESIZING", "SIGNALING", "STAGE_OUT"})
RUNNING = frozenset({"RUNNING", "COMPLETING", "STOPPED"})


class SchedulerUnavailable(Exception):
    """SLURM cannot be asked from here (no scontrol, or it failed to answer)."""


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # JobState, e.g. PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT
    restarts: int = 0  # how often the job was requeued
    nodes: str = ""  # NodeList (compressed, e.g. node[1-2]); "(null)" while pending reads as ""
    reason: str = ""

    @property
    def alive(self) -> bool:
        """Queued or running: the job still owns the folders it names."""
        return self.state in QUEUED or self.state in RUNNING

    @property
    def running(self) -> bool:
        return self.state in RUNNING


def available() -> bool:
    return shutil.which("scontrol") is not None


def _call(argv: list[str]) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0])
    if exe is None:
        raise SchedulerUnavailable(f"{argv[0]} not found on this machine")
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SchedulerUnavailable(f"{argv[0]} did not answer within {TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise SchedulerUnavailable(f"{argv[0]}: {e.strerror or e}") from None


def parse_show_job(text: str) -> dict[str, str]:
    """`scontrol show job -o` prints one line of Key=Value words (values may hold '=': split once)."""
    out: dict[str, str] = {}
    for word in text.split():
        if "=" in word:
            k, v = word.split("=", 1)
            out.setdefault(k, v)
    return out


def job(job_id: str | int) -> JobInfo | None:
    """The job as slurmctld knows it; None when it does not (finished and purged, or never was).
    Raises SchedulerUnavailable when SLURM cannot be asked."""
    proc = _call(["scontrol", "show", "job", "-o", str(job_id)])
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr or "Invalid job id" in proc.stdout:
            return None
        raise SchedulerUnavailable(f"scontrol show job {job_id}: {(proc.stderr or proc.stdout).strip()}")
    line = next((ln for ln in proc.stdout.splitlines() if f"JobId={job_id} " in ln + " "), "")
    if not line:
        return None
    f = parse_show_job(line)
    nodes = f.get("NodeList", "")
    try:
        restarts = int(f.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return JobInfo(job_id=str(job_id), state=f.get("JobState", "UNKNOWN"), restarts=restarts,
                   nodes="" if nodes in ("(null)", "None assigned") else nodes, reason=f.get("Reason", ""))


def cancel(job_id: str | int, signal: str | None = None, *, batch: bool = False, full: bool = False) -> None:
    """`scancel [--signal=SIG] [--batch|--full] ID`; raises SchedulerUnavailable when it fails."""
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    elif full:
        argv.append("--full")
    proc = _call([*argv, str(job_id)])
    if proc.returncode != 0:
        raise SchedulerUnavailable(f"{' '.join(argv)} {job_id}: {(proc.stderr or proc.stdout).strip()}")
