"""longspec/runs/scheduler.py and longspec/runs/runrecord.py against a real SLURM (tests/cluster): what the scheduler
says of a job (queued, running, requeued, gone) is what `status`, `run` and `stop` read."""

from __future__ import annotations

import json

import pytest

from longspec.runs import runrecord, scheduler


@pytest.mark.slow
def test_a_jobs_record_follows_the_scheduler_through_run_requeue_and_cancel(slurm_cluster, tmp_path, monkeypatch):
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "runs" / "base"
    held = slurm_cluster.sbatch("--hold", "--nodes=1", "--requeue", f"--output={tmp_path}/held.out", "--time=1",
                                "--wrap", "sleep 60")
    runrecord.slurm_submitted(out, "base", held, nodes=1, ranks_per_node=1, overrides=["max_steps=3"],
                              script="x.sbatch")
    own = runrecord.owner(runrecord.read(out))
    assert (own.state, own.job_id) == ("queued", held) and "PENDING" in own.detail

    slurm_cluster.run(["scontrol", "release", held])
    slurm_cluster.wait_job_state(held, "RUNNING", timeout=60)
    info = runrecord.slurm_stage_begins(out, "base", {"SLURM_JOB_ID": held, "SLURM_JOB_NODELIST": "node1",
                                                      "SLURM_RESTART_COUNT": "0"})
    own = runrecord.owner(info)
    assert own.state == "running" and own.where.startswith(f"SLURM job {held} on node")

    slurm_cluster.run(["scontrol", "requeue", held])
    slurm_cluster.wait_job_state(held, "PENDING", timeout=60)
    job = scheduler.job(held)
    assert job.alive and not job.running and job.restarts == 1, job
    assert runrecord.owner(runrecord.read(out)).state == "requeued"

    scheduler.cancel(held)
    slurm_cluster.wait_job_state(held, ("CANCELLED",), timeout=60)
    assert runrecord.owner(runrecord.read(out)).state is None
    assert scheduler.job("999999") is None  # a job SLURM does not know is no job, not an error
    assert json.loads((out / "run.json").read_text())["overrides"] == ["max_steps=3"]


def test_a_jobs_record_where_slurm_cannot_be_asked(tmp_path, monkeypatch):
    """No scontrol here (a laptop holding a synced run folder): a running job's stage cannot be
    judged (unknown, so `status` keeps it running and says why); a finished or stopped stage is
    judged by its folder, without asking."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "runs" / "base"
    runrecord.slurm_submitted(out, "base", "42", nodes=2, ranks_per_node=8, overrides=[], script="x.sbatch")
    info = runrecord.slurm_stage_begins(out, "base", {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-2]"})
    own = runrecord.owner(info)
    assert (own.state, own.job_id) == ("unknown", "42") and "SLURM cannot be asked" in own.detail
    assert runrecord.owner(runrecord.slurm_stage_ends(out, 0)).state is None
    assert runrecord.owner(runrecord.slurm_stage_ends(out, 5)).state is None
    with pytest.raises(scheduler.SchedulerUnavailable):
        scheduler.job("42")
