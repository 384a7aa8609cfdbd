"""Faults at run time lose nothing and say what happened: preemption, stop, a full disk.

Real launches through `longspec run` (DeepSpeed's launcher, the trainer, the tiny preset on CPU):
- a SIGTERM to the whole process tree (what a scheduler sends) saves the step in progress and
  exits 5; status shows the stage as preempted and resumable; the rerun resumes from that step;
  `longspec stop` saves and stops; `longspec stop --now` stops without saving;
- a second SIGTERM to a rank exits at once, without a checkpoint;
- a full disk (a small tmpfs, root only) gives one message with path, free space and the
  checkpoint a rerun resumes from, exit 4, no half-written checkpoint (resuming from a checkpoint
  is the preemption test's). Before that, the disk preflight warns (validate) and refuses (run);
  the CLI's own write on a full disk is a panel, exit 4.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspec.machine import liveness
from longspec.runs import runfolder
from longspec.machine.opsdir import ops_build_dir
from tests.needs import small_disk
from tests.cli.test_run import LONGSPEC, ROOT, cli, cpu_env, flat, last_step, wait_for

STEPS = ["max_steps=200", "save_steps=1000"]  # no periodic save: every checkpoint here is a stop's


def tiny(tmp_path: Path) -> Path:
    root = tmp_path / "tiny"
    res = cli("init", str(root), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    return root


def start(proj: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*LONGSPEC, "run", str(proj), "base", *STEPS, "--quiet", *extra], cwd=ROOT,
                            env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def checkpoint_steps(out: Path) -> list[int]:
    return [c.step for c in runfolder.RunDir(out).checkpoints()]


def lifecycle(out: Path) -> list[dict]:
    return [e for e in runfolder.RunDir(out).events() if e["event"] in ("start", "resume", "preempted", "end")]


@pytest.mark.slow
def test_sigterm_saves_the_step_stop_saves_stop_now_does_not_and_each_rerun_resumes(tmp_path):
    proj = tiny(tmp_path)
    out = proj / "runs" / "base"

    # 1. SIGTERM to every process of the run (runner, launcher, rank), as a scheduler sends it.
    run = start(proj)
    n = wait_for(lambda: last_step(out) >= 3 or run.poll() is not None, 600, "step 3")
    assert run.poll() is None, run.communicate()
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    os.killpg(pgid, signal.SIGTERM)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 5, stdout[-2000:] + stderr[-2000:]
    assert liveness.group_members(pgid) == []
    pre = lifecycle(out)[-1]
    assert pre["event"] == "preempted" and pre["signal"] == "SIGTERM"
    n = pre["step"]
    assert last_step(out) == n and checkpoint_steps(out) == [n]  # the step in progress, finished and saved
    assert f"resumes it from step {n}" in flat(stderr)
    status = json.loads(cli("status", str(proj), "--json").stdout)
    base = next(s for s in (status["stages"] if isinstance(status, dict) else status) if s["name"] == "base")
    assert (base["state"], base["action"], base["resume_step"]) == ("preempted", "resume", n)

    # 2. The rerun resumes from N; `longspec stop` saves the step in progress and stops it.
    run = start(proj)
    wait_for(lambda: last_step(out) >= n + 2 or run.poll() is not None, 600, f"step {n + 2}")
    res = cli("stop", str(proj), timeout=300)
    assert res.returncode == 0 and "checkpoint saved" in res.stdout, res.stdout + res.stderr
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stdout[-2000:] + stderr[-2000:]
    events = lifecycle(out)
    assert events[-2]["event"] == "resume" and events[-2]["step"] == n
    m = events[-1]["step"]
    assert events[-1]["event"] == "preempted" and m >= n + 2 and checkpoint_steps(out)[-1] == m

    # 3. `longspec stop --now` stops without a save: no new checkpoint, no preempted event.
    run = start(proj)
    wait_for(lambda: last_step(out) >= m + 2 or run.poll() is not None, 600, f"step {m + 2}")
    res = cli("stop", str(proj), "--now", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run.communicate(timeout=120)
    assert run.returncode == 130
    assert checkpoint_steps(out)[-1] == m
    last = lifecycle(out)[-1]
    assert (last["event"], last["step"]) == ("resume", m)


def sigterm_blocked(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigBlk:")), 0)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_without_a_checkpoint(tmp_path):
    proj = tiny(tmp_path)
    out = proj / "runs" / "base"
    env = {**cpu_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": ops_build_dir()}  # the ops `longspec run` built already
    log = open(tmp_path / "train.log", "w+")
    rank = subprocess.Popen([sys.executable, "-u", "-m", "longspec.train", "--config-dir", str(proj / "conf"),
                             "+exp=base", *STEPS], cwd=proj, env=env, stdout=log, stderr=subprocess.STDOUT)
    # The watcher blocks SIGTERM in the rank (it takes it with sigwaitinfo) before torch is
    # imported: once /proc shows it blocked, the first step is many seconds of set-up away.
    wait_for(lambda: sigterm_blocked(rank.pid) or rank.poll() is not None, 120, "the stop-signal watcher")
    rank.send_signal(signal.SIGTERM)
    time.sleep(2.5)  # past the window in which a copy forwarded by a launcher counts as the same
    assert rank.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
    t0 = time.monotonic()
    rank.send_signal(signal.SIGTERM)
    code = rank.wait(timeout=30)
    took = time.monotonic() - t0
    text = (tmp_path / "train.log").read_text()
    assert code == 130 and took < 5, (code, took, text[-2000:])
    assert "second stop signal" in text and "without saving" in text
    assert checkpoint_steps(out) == [] and not list(out.glob("checkpoint-*"))


def test_disk_preflight_warns_in_validate_refuses_run_and_shows_in_dry_run(tmp_path):
    proj = tiny(tmp_path)
    res = cli("run", str(proj), "base", "max_steps=6", "save_steps=2", "--dry-run", env=cpu_env())
    line = next(x for x in res.stdout.splitlines() if x.startswith("# disk estimate:"))
    assert res.returncode == 0 and "(3 checkpoint(s) x 1.1 MiB + final weights" in line and "free on the disk" in line
    assert "+ best draft" in line                       # best/ is kept while the simulated tau is on
    steps = ["max_steps=6", "save_steps=2", "eval_steps=0"]
    res = cli("run", str(proj), "base", *steps, "--dry-run", env=cpu_env())
    line = next(x for x in res.stdout.splitlines() if x.startswith("# disk estimate:"))
    assert res.returncode == 0 and "best draft" not in line
    with small_disk(proj / "runs", "1500k"):
        res = cli("validate", str(proj))
        assert res.returncode == 0 and "would fail part-way" in flat(res.stdout), res.stdout
        res = cli("run", str(proj), "base", *steps, env=cpu_env())
        assert res.returncode == 1 and "not enough free disk space" in flat(res.stderr), res.stderr
        assert not (proj / "runs" / "base").exists()  # nothing started


def test_the_clis_own_write_on_a_full_disk_is_reported_exit_4(tmp_path):
    proj = tiny(tmp_path)
    with small_disk(proj / "runs", "64k") as runs:
        (runs / "filler").write_bytes(b"x" * 60_000)
        (runs / "base").mkdir()
        while True:  # fill the last blocks
            try:
                with open(runs / "filler", "ab") as f:
                    f.write(b"x" * 4096)
            except OSError:
                break
        res = cli("run", str(proj), "base", "--force", env=cpu_env(), timeout=300)
    assert res.returncode == 4, res.stdout[-2000:] + res.stderr[-2000:]
    err, packed = flat(res.stderr), "".join(flat(res.stderr).split())  # the panel wraps long paths
    assert "Traceback" not in res.stderr and f"couldnotwrite{runs}/base/train.log" in packed, res.stderr
    assert "no complete checkpoint yet: a rerun starts from step 0" in err


@pytest.mark.slow
def test_a_full_disk_says_where_and_what_a_rerun_resumes_from(tmp_path):
    proj = tiny(tmp_path)
    with small_disk(proj / "runs", "1500k") as runs:
        out = runs / "base"
        # one checkpoint is ~1.1 MiB: the second cannot fit (no best/ draft: the disk fills at a checkpoint)
        steps = ["max_steps=6", "save_steps=2", "eval_steps=0"]
        res = cli("run", str(proj), "base", *steps, "--force", "--quiet", env=cpu_env(), timeout=600)
        err = flat(res.stderr)
        assert res.returncode == 4, res.stdout[-2000:] + res.stderr[-2000:]
        assert "Traceback" not in res.stdout + res.stderr
        packed = "".join(err.split())  # the panel wraps long paths
        assert f"couldnotwrite{out}/checkpoint-4" in packed and "freeon" in packed
        assert f"lastcompletecheckpoint:{out}/checkpoint-2(step2);arerunresumesfromit" in packed
        assert checkpoint_steps(out) == [2] and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
        assert not (out / "stage_complete.json").exists() and not (out / "draft_model_weights.pth").exists()



STAND_IN_RANK = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []

def on_signal(signo, frame):  # as the trainer: the first asks for a save, a later one ends it now
    if got and time.monotonic() - got[0][1] > 2.0:
        os._exit(130)
    if not got:
        got.append((signal.Signals(signo).name, time.monotonic()))

for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, on_signal)
# the node launcher starts its ranks with the stop signals blocked (pending until a rank takes them)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
(out / "rank.pid").write_text(str(os.getpid()))
while not got:
    time.sleep(0.05)
(out / "rank.got").write_text(got[0][0])
time.sleep(float(sys.argv[2]))  # "saving a checkpoint"
(out / "rank.saved").write_text("yes")
sys.exit(5)
"""


def start_node_launcher(tmp_path: Path, save_s: float) -> subprocess.Popen:
    from longspec_cli.launch import argv as A
    from longspec_cli.launch import slurm as S

    (tmp_path / "rank.py").write_text(STAND_IN_RANK)
    argv = S.node_launch_argv({"localhost": [0]}, 0, "127.0.0.1", A.free_port(), [])
    argv = [a for a in argv if a != "--no_local_rank"] + ["--no_local_rank", str(tmp_path / "rank.py"),
                                                          str(tmp_path), str(save_s)]
    env = {**cpu_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(tmp_path / "node.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: (tmp_path / "rank.pid").exists() or proc.poll() is not None, 120, "the stand-in rank")
    return proc


@pytest.mark.slow
def test_the_sbatch_node_launcher_lets_the_ranks_save_and_passes_their_code_on(tmp_path):
    # SIGUSR1 (SLURM's --signal) to the launcher alone: DeepSpeed's own launcher would die of it.
    proc = start_node_launcher(tmp_path, save_s=3.0)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == 5, (tmp_path / "node.log").read_text()[-2000:]
    assert (tmp_path / "rank.got").read_text() == "SIGUSR1" and (tmp_path / "rank.saved").exists()

    # A second signal after the echo window: DeepSpeed's handler ends the rank at once.
    for name in ("rank.pid", "rank.got", "rank.saved"):
        (tmp_path / name).unlink(missing_ok=True)
    proc = start_node_launcher(tmp_path, save_s=60.0)
    os.killpg(proc.pid, signal.SIGTERM)  # launcher and rank, as SLURM signals a job step
    wait_for(lambda: (tmp_path / "rank.got").exists(), 30, "the rank to see the request")
    time.sleep(2.5)
    assert proc.poll() is None  # still waiting for the save
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert time.monotonic() - t0 < 10 and not (tmp_path / "rank.saved").exists()
    assert liveness.group_members(proc.pid) == []
