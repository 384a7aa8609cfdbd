"""Faults on two nodes over real ssh: stop, a killed rank, an unreachable node.

    python bench/bench_nodes.py [--at-step 2]          (root: it starts an sshd of its own)

The nodes are 127.0.0.1 and 127.0.0.2 through an sshd on its own port (tests/cluster/ssh.py), one
CPU rank each, the tiny preset's base stage under ZeRO-3 (`longspec run DIR base --hostfile H`).
Prints
    stop -> every process gone (s)     `longspec stop` at step N until `run` has exited and no
                                       process carrying the run's id is left on either node
    steps lost on stop                 last step record - the checkpoint's step (goal 0)
    SIGKILL rank 1 on node 2 -> exit 4 (s), and `run`'s message
    unreachable node -> exit 4 (s)     a hostfile naming 127.0.0.3 (no sshd there), launch only
    leftovers                          processes of each run left afterwards (goal 0)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from longspec.runs import runfolder  # noqa: E402
from tests.cluster.ssh import SshNodes  # noqa: E402

CLI = [sys.executable, "-m", "longspec_cli"]
STEPS = ["max_steps=200", "save_steps=1000", "eval_steps=0", "global_batch_size=16"]


def wait_for(pred, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:.0f} s")


def last_step(out: Path) -> int:
    rec = runfolder.RunDir(out).last_step_record()
    return rec["step"] if rec else 0


def of_run(rid: str) -> list[int]:
    pids = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("LONGSPEC_RUN_ID") == rid:
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--at-step", type=int, default=2)
    a = ap.parse_args()
    nodes = SshNodes.start()
    tmp = Path(tempfile.mkdtemp(prefix="longspec-bench-nodes-"))
    env = {**nodes.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        proj = tmp / "tiny"
        subprocess.run([*CLI, "init", str(proj), "--preset", "tiny", "--no-input"], env=env, check=True,
                       capture_output=True, timeout=900)
        base = proj / "conf" / "exp" / "base.yaml"
        base.write_text(base.read_text().replace("zero1_offload_cosine", "zero3_offload_cosine"))
        out = proj / "runs" / "base"
        hosts = nodes.hostfile(tmp / "hosts")
        run_cmd = [*CLI, "run", str(proj), "base", *STEPS, "--hostfile", str(hosts), "--quiet"]

        run = subprocess.Popen(run_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: last_step(out) >= a.at_step or run.poll() is not None, 900)
        rid = json.loads((out / "run.json").read_text())["run_id"]
        t0 = time.monotonic()
        subprocess.run([*CLI, "stop", str(proj)], env=env, capture_output=True, timeout=900)
        run.communicate(timeout=300)
        wait_for(lambda: not of_run(rid), 60)
        stop_s = time.monotonic() - t0
        ckpt = runfolder.RunDir(out).checkpoints()[-1].step
        print(f"stop at step >= {a.at_step} -> every process gone on both nodes: {stop_s:.1f} s (run exit "
              f"{run.returncode}); steps lost: {last_step(out) - ckpt}; leftovers: {len(of_run(rid))}")

        run = subprocess.Popen(run_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: last_step(out) >= ckpt + 1 or run.poll() is not None, 900)
        rid = json.loads((out / "run.json").read_text())["run_id"]
        rank1 = next(p for p in map(psutil.Process, of_run(rid))
                     if p.environ().get("RANK") == "1" and "longspec.train" in p.cmdline())
        node = rank1.environ().get("SSH_CONNECTION", "? ? ?").split()[2]
        t0 = time.monotonic()
        rank1.kill()
        _, err = run.communicate(timeout=300)
        kill_s = time.monotonic() - t0
        flat = " ".join(err.replace("│", " ").replace("╰", " ").replace("─", " ").replace("╮", " ").split())
        said = flat[flat.find("stage base failed"):flat.find(" hint:")] if "stage base failed" in flat else flat[-400:]
        print(f"SIGKILL to rank 1 (on {node}) -> exit {run.returncode}: {kill_s:.1f} s; leftovers: "
              f"{len(of_run(rid))}\n  {said}")

        bad = tmp / "hosts3"
        bad.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")
        t0 = time.monotonic()
        res = subprocess.run([*CLI, "run", str(proj), "base", *STEPS, "--hostfile", str(bad), "--quiet"], env=env,
                             capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
        leader = runfolder.read_json(out / "run.json")[0] or {}
        launch_s = (leader.get("ended_unix") or 0) - (leader.get("started_unix") or 0)
        print(f"unreachable node (127.0.0.3) -> exit {res.returncode}: {launch_s:.1f} s from the launch "
              f"({took:.1f} s for the whole `run` command); leftovers: {len(of_run(leader.get('run_id', '')))}")
    finally:
        nodes.stop()


if __name__ == "__main__":
    main()
