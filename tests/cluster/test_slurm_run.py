"""`longspec run --slurm --submit` against a real SLURM cluster (tests/cluster/slurm.py): CPU nodes.

One 2-node job (world size 2, one CPU rank per node) of the tiny preset's three stages lives
through every fault, one per run of the job:
  run 1  the time limit (--time 1, SIGUSR1 30 s ahead to the batch script): base, set to train
         without end, saves at its step, the job requeues itself; held in the queue, status says
         requeued, and base is given an end a few steps on (resume_schedule=stretch);
  run 2  base resumes at that step (0 steps lost) and finishes; SIGUSR1 to the batch script
         between stages (as SLURM's B: warning): the job requeues itself before long starts;
  run 3  long starts; `scancel --signal=TERM JOB` mid-stage: long saves at its step, requeue;
  run 4  long resumes at that step, longcot is chained and trained: the job ends COMPLETED.
Before that, the same command with the tiny configs' batch arithmetic (right for one rank, wrong
for two) is refused before submission with the message a local check at world size 2 gives.
The figures (seconds from the warning to the requeue and to the resume, steps lost) are printed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from longspec.runs import runfolder, runrecord

ROOT = Path(__file__).resolve().parents[2]
LONGSPEC = [sys.executable, "-m", "longspec_cli"]
STEPS = {"base": 12, "long": 8, "longcot": 3}
UNENDING = 10 ** 6  # base's steps until the time limit's warning has reached it (then STEPS' plus its step)


def cli(*args: str, env: dict, timeout: float = 300):
    import subprocess

    return subprocess.run([*LONGSPEC, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def events(out: Path, *names: str) -> list[dict]:
    return [e for e in runfolder.RunDir(out).events() if not names or e["event"] in names]


def step_records(out: Path) -> list[int]:
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if runfolder.is_step_record(rec):
            steps.append(rec["step"])
    return steps


def wait(pred, timeout: float, what: str, cluster=None, job=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if cluster is not None and job is not None:
            state = cluster.job_state(job)
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"), \
                f"job {job} ended {state} while waiting for {what}"
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def status(proj: Path, env: dict) -> dict[str, dict]:
    res = cli("status", str(proj), "--json", env=env)
    assert res.returncode == 0, res.stderr
    return {s["name"]: s for s in json.loads(res.stdout)["stages"]}


def logged_at(text: str, pattern: str) -> list[float]:
    """Unix times of the batch script's lines matching `pattern` (they end in `at YYYY-MM-DD HH:MM:SS`)."""
    out = []
    for line in text.splitlines():
        m = re.search(pattern + r".*? at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
        if m:
            out.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))
    return out


@pytest.mark.slow
def test_a_two_node_cpu_job_survives_the_time_limit_a_signal_between_stages_and_scancel(slurm_cluster, tmp_path):
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT), "LONGSPEC_CACHE_DIR": str(tmp_path / ".cache"),
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OMP_NUM_THREADS", None)
    proj = tmp_path / "tiny"
    res = cli("init", str(proj), "--preset", "tiny", "--no-input", env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    for stage, steps in STEPS.items():  # no periodic save: every checkpoint here is a stop's
        path = proj / "conf" / "exp" / f"{stage}.yaml"
        steps = UNENDING if stage == "base" else steps  # still training when the warning comes, however fast
        text = re.sub(r"(?m)^max_steps: \d+", f"max_steps: {steps}", path.read_text())
        path.write_text(re.sub(r"(?m)^save_steps: \d+", f"save_steps: {UNENDING}", text))
    slurm = ["run", str(proj), "--all", "--slurm", "--gpus", "0", "--num-nodes", "2", "--time", "1",
             "--signal-lead", "30"]

    # 0. The tiny configs' batch arithmetic is for one rank: refused before sbatch, as a local check says.
    res = cli(*slurm, "--submit", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    local = cli("validate", str(proj), "--world-size", "2", env=env)
    want = "global_batch_size is 8 but 8 per GPU x 1 accumulation x 2 GPUs"
    assert want in flat(res.stderr) and want in flat(local.stdout + local.stderr), res.stderr + local.stdout
    assert "nothing was submitted" in flat(res.stderr) and not (proj / "longspec.sbatch").exists()
    assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == ""

    # 1. Submitted: world size 2 = 2 nodes x 1 CPU rank; no GPU request, the CPU accelerator.
    res = cli(*slurm, "--submit", "per_gpu_train_batch_size=1", "global_batch_size=2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 node(s) x CPU (DS_ACCELERATOR=cpu), 1 rank(s) per node, world size 2" in flat(res.stdout)
    script = (proj / "longspec.sbatch").read_text()
    assert "--gpus" not in script and "export DS_ACCELERATOR=cpu" in script
    assert "#SBATCH --signal=B:USR1@30" in script and "#SBATCH --time=1" in script
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    assert runrecord.read(proj / "runs" / "base")["job_id"] == job
    # While the job owns the stages: status names it, and a second run is refused before it starts.
    stages = status(proj, env)
    assert {s["name"]: (s["state"] in ("queued", "running"), s["job_id"]) for s in stages.values()} == \
        {n: (True, job) for n in STEPS}, stages
    res = cli("run", str(proj), "--all", "--dry-run", env=env)
    assert res.returncode == 1 and f"SLURM job {job}" in flat(res.stderr), res.stdout + res.stderr
    log = proj / f"slurm-{job}.out"
    base, long_, longcot = (proj / "runs" / s for s in STEPS)
    t0 = time.monotonic()

    # Run 1: the time limit's warning; base saves at its step; the job requeues itself.
    wait(lambda: (r := slurm_cluster.job(job)) and int(r.get("Restarts", 0)) >= 1 and r, 240,
         "the first requeue (time limit)", slurm_cluster, job)
    slurm_cluster.wait_job_state(job, "PENDING", timeout=60)
    slurm_cluster.run(["scontrol", "hold", job])  # while base's length is set: STEPS' more after its step
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=20"])  # the rest runs unhurried
    # Held in the queue after the requeue: status says requeued, with the job and the step it resumes from.
    st = status(proj, env)["base"]
    assert st["state"] == "requeued" and st["job_id"] == job, st
    assert st["next_action"] == f"wait (SLURM job {job} resumes it from step {st['resume_step']})", st
    print(f"\nstatus during the requeue: base {st['state']}, {st['next_action']}")
    first = events(base, "preempted")
    assert len(first) == 1 and first[0]["signal"] == "SIGUSR1", log.read_text()[-3000:]
    s1 = first[0]["step"]
    steps = {**STEPS, "base": s1 + STEPS["base"]}  # base resumes at s1 on the new length (stretch)
    cfg = proj / "conf" / "exp" / "base.yaml"
    cfg.write_text(re.sub(r"(?m)^max_steps: \d+", f"max_steps: {steps['base']}", cfg.read_text())
                   + "resume_schedule: stretch\n")
    slurm_cluster.run(["scontrol", "release", job])
    assert [c.step for c in runfolder.RunDir(base).checkpoints()] == [s1] and max(step_records(base)) == s1
    text = log.read_text()
    assert "SIGUSR1 reached the batch script" in text and "stage base saved a checkpoint" in text

    # Run 2: base resumes at s1; SIGUSR1 to the batch script alone once base has ended.
    wait(lambda: (r := runrecord.read(base)) and r.get("phase") == "ended" and r.get("returncode") == 0, 300,
         "base to finish", slurm_cluster, job)
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    wait(lambda: int(slurm_cluster.job(job).get("Restarts", 0)) >= 2, 120, "the second requeue (between stages)",
         slurm_cluster, job)
    resumed = events(base, "resume")
    assert resumed and resumed[0]["step"] == s1  # 0 steps lost
    text = log.read_text()
    between = re.findall(r"longspec: (SIGUSR1 came between stages, before stage long|"
                         r"next-stage --to long ended on SIGUSR1)", text)
    assert between, text[-3000:]
    assert not (long_ / "metrics.jsonl").exists()  # long never started in that run

    # Run 3: long starts; scancel --signal=TERM mid-stage: long saves at its step.
    wait(lambda: step_records(long_) if (long_ / "metrics.jsonl").exists() else None, 300, "long's first step",
         slurm_cluster, job)
    slurm_cluster.run(["scancel", "--signal=TERM", job])
    wait(lambda: int(slurm_cluster.job(job).get("Restarts", 0)) >= 3, 120, "the third requeue (scancel)",
         slurm_cluster, job)
    pre = events(long_, "preempted")
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM"
    s3 = pre[0]["step"]

    # Run 4: long resumes at s3, longcot is chained and trained; COMPLETED.
    done = slurm_cluster.wait_job_state(job, "COMPLETED", timeout=420)
    wall = time.monotonic() - t0
    assert slurm_cluster.hostnames(done["NodeList"]) == ["node1", "node2"] and done["Restarts"] == "3"
    assert events(long_, "resume")[0]["step"] == s3
    for out, steps in zip((base, long_, longcot), steps.values()):
        assert (out / "stage_complete.json").is_file()
        assert events(out, "start")[0]["world_size"] == 2
        got = step_records(out)
        assert sorted(set(got)) == list(range(1, steps + 1)), (out, got)  # every step once: nothing lost
    text = log.read_text()
    assert "every stage of this job is done" in text and "finished earlier in this job" in text

    # The figures: the warning -> the requeue -> the resume, steps lost.
    warned = logged_at(text, "SIGUSR1 reached the batch script")[0]
    requeued = logged_at(text, "stage base saved a checkpoint")[0]
    print(f"\ntime limit: SIGUSR1 -> requeue {requeued - warned:.0f} s, -> base resumed at step "
          f"{resumed[0]['step']} {resumed[0]['time'] - warned:.0f} s later (saved at {s1}: 0 steps lost); "
          f"scancel TERM: long saved at {s3}, resumed at {events(long_, 'resume')[0]['step']}; "
          f"job wall {wall:.0f} s, 3 requeues")
    assert requeued - warned < 120


@pytest.mark.slow
def test_stop_saves_a_one_node_job_through_the_scheduler_without_a_requeue(slurm_cluster, tmp_path):
    """`longspec stop` on a stage a job runs: SIGUSR1 through scancel, the rank saves at its step, the
    job ends without requeueing itself; status says preempted and where a rerun resumes."""
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT), "LONGSPEC_CACHE_DIR": str(tmp_path / ".cache"),
           "CUDA_VISIBLE_DEVICES": ""}
    proj = tmp_path / "tiny"
    assert cli("init", str(proj), "--preset", "tiny", "--no-input", env=env, timeout=900).returncode == 0
    res = cli("run", str(proj), "base", "--slurm", "--submit", "--gpus", "0", "--time", "20",
              "max_steps=400", "save_steps=1000", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    base = proj / "runs" / "base"
    wait(lambda: (base / "metrics.jsonl").exists() and step_records(base), 300, "base's first step",
         slurm_cluster, job)
    st = status(proj, env)["base"]
    assert (st["state"], st["job_id"]) == ("running", job) and st["where"].startswith(f"SLURM job {job} on node"), st

    t0 = time.monotonic()
    res = cli("stop", str(proj), env=env, timeout=300)
    stop_s = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"stopped SLURM job {job}" in res.stdout and "checkpoint saved" in res.stdout, res.stdout
    rec = slurm_cluster.job(job)
    assert rec["JobState"] != "PENDING" and rec.get("Restarts") == "0", rec  # ended, not requeued
    pre = events(base, "preempted")
    assert len(pre) == 1 and [c.step for c in runfolder.RunDir(base).checkpoints()] == [pre[0]["step"]]
    assert max(step_records(base)) == pre[0]["step"]  # the step in progress was finished and saved: 0 lost
    st = status(proj, env)["base"]
    assert (st["state"], st["action"], st["resume_step"]) == ("preempted", "resume", pre[0]["step"]), st
    assert "`longspec stop` asked this job to stop: not requeued" in (proj / f"slurm-{job}.out").read_text()
    res = cli("stop", str(proj), env=env)
    assert res.returncode == 1 and "nothing to stop" in flat(res.stderr)
    print(f"\nstop through SLURM: checkpoint at step {pre[0]['step']}, job {rec['JobState']} "
          f"{stop_s:.1f} s after `longspec stop`")
