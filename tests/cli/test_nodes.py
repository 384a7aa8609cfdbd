"""A run on two nodes over real ssh keeps every promise of one node: stop, preemption, faults.

The nodes are 127.0.0.1 and 127.0.0.2 reached through the tests' own sshd (tests/cluster/ssh.py,
the `ssh_nodes` fixture: skipped without root, a failure in CI), one CPU rank each. Real launches
through `longspec run DIR base --hostfile H` (the tiny preset, its base stage switched to ZeRO-3):
- `longspec stop` mid-stage: every rank saves at its step (0 steps lost), exit 130, no process of
  the run left on either node, and a second run from the same Python (a stand-in trainer on both
  nodes, through the same launch path) goes on untouched; `stop --now` then ends that one, unsaved;
- the rerun resumes there; SIGUSR1 to node 2's rank alone saves every rank at one step: exit 5;
- the rerun resumes; SIGKILL to node 2's rank: exit 4 within seconds naming 127.0.0.2, rank 1 and
  SIGKILL and the checkpoint a rerun resumes from, nothing left, `status` says failed;
- the rerun resumes and finishes the stage at world size 2.
And without training: a node that does not answer (127.0.0.3: no sshd there) and a master port in
use fail in seconds, naming them.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from longspec.runs import runfolder
from tests.cli.test_run import FAKE_TRAINER, LONGSPEC, ROOT, flat, last_step, wait_for

STEPS = ["max_steps=14", "save_steps=1000", "eval_steps=0", "global_batch_size=16"]  # 2 ranks x 8

SECOND_RUN = textwrap.dedent('''
    import sys
    from pathlib import Path
    from longspec_cli.launch import argv as A, nodes as N, process as P

    hostfile, out, fake = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    p = A.Placement(hostfile=hostfile)
    r = A.resolve_resources(p, [], env={"DS_ACCELERATOR": "cpu"})
    cmd = N.build_launch(p, r, ["--module", "fake_trainer", f"output_dir={out}", "max_steps=2000", "step_s=0.3"],
                         fake)
    res = P.run_stage_process(cmd, out, "base", [], quiet=True)
    sys.exit(130 if res.stopped else res.returncode)
''')


def node_env(ssh_nodes, *extra_path: str) -> dict[str, str]:
    path = ":".join([*extra_path, str(ROOT)])
    return {**ssh_nodes.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def tiny_zero3(tmp_path: Path, env: dict) -> Path:
    proj = tmp_path / "tiny"
    res = subprocess.run([*LONGSPEC, "init", str(proj), "--preset", "tiny", "--no-input"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    base = proj / "conf" / "exp" / "base.yaml"
    base.write_text(base.read_text().replace("zero1_offload_cosine", "zero3_offload_cosine"))
    return proj


def cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*LONGSPEC, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start_run(proj: Path, hostfile: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*LONGSPEC, "run", str(proj), "base", *STEPS, "--hostfile", str(hostfile), "--quiet",
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_id(out: Path) -> str:
    return json.loads((out / "run.json").read_text())["run_id"]


def processes_of(rid: str, needle: str | None = None) -> list[psutil.Process]:
    """Every live process of this machine (both "nodes") with the run's id in its environment, or
    (needle) its folder on its command line."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("LONGSPEC_RUN_ID") == rid or (needle and needle in " ".join(p.cmdline())):
                out.append(p)
        except psutil.Error:
            continue
    return out


def rank_on(rid: str, rank: int) -> psutil.Process:
    """The training rank `rank` of the run; it must have been started over ssh on its node."""
    for p in processes_of(rid):
        env = p.environ()
        if env.get("RANK") == str(rank) and "longspec.train" in p.cmdline():
            return p
    raise AssertionError(f"no rank {rank} of {rid}")


def lifecycle(out: Path) -> list[dict]:
    return [e for e in runfolder.RunDir(out).events() if e["event"] in ("start", "resume", "preempted", "end")]


def checkpoint_steps(out: Path) -> list[int]:
    return [c.step for c in runfolder.RunDir(out).checkpoints()]


def base_status(proj: Path, env: dict) -> dict:
    res = json.loads(cli(env, "status", str(proj), "--json").stdout)
    return next(s for s in (res["stages"] if isinstance(res, dict) else res) if s["name"] == "base")


@pytest.mark.slow
def test_stop_preemption_and_a_killed_rank_across_two_nodes_then_the_stage_finishes(ssh_nodes, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "fake_trainer.py").write_text(FAKE_TRAINER)
    (fake / "second.py").write_text(SECOND_RUN)
    env = node_env(ssh_nodes, str(fake))
    proj = tiny_zero3(tmp_path, env)
    out = proj / "runs" / "base"
    hostfile = ssh_nodes.hostfile(tmp_path / "hosts")

    # A second run from the same Python on both nodes (a stand-in trainer, the same launch path).
    out2 = tmp_path / "second" / "runs" / "base"
    second = subprocess.Popen([sys.executable, str(fake / "second.py"), str(hostfile), str(out2), str(fake)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # 1. `longspec stop` mid-stage: every rank saves at its step, nothing is left on either node.
    run = start_run(proj, hostfile, env)
    wait_for(lambda: last_step(out) >= 2 or run.poll() is not None, 600, "step 2")
    assert run.poll() is None, run.communicate()
    rid = run_id(out)
    info = json.loads((out / "run.json").read_text())
    assert info["hosts"] == ["127.0.0.1", "127.0.0.2"] and info["kind"] == "local"
    assert rank_on(rid, 1).environ()["SSH_CONNECTION"].split()[2] == "127.0.0.2"  # rank 1 runs on node 2
    rid2 = run_id(out2)
    second_procs = processes_of(rid2)
    assert {p.environ().get("SSH_CONNECTION", "").split()[2] for p in second_procs} == {"127.0.0.1", "127.0.0.2"}
    t0 = time.monotonic()
    res = cli(env, "stop", str(proj))
    assert res.returncode == 0 and "checkpoint saved" in res.stdout, res.stdout + res.stderr
    stdout, stderr = run.communicate(timeout=120)
    stop_s = time.monotonic() - t0
    assert run.returncode == 130, stdout[-3000:] + stderr[-3000:]
    assert "no process of it is left on 127.0.0.1, 127.0.0.2" in flat(stderr)
    assert processes_of(rid, needle=str(proj)) == []
    stopped = lifecycle(out)[-1]
    n = stopped["step"]
    assert stopped["event"] == "preempted" and checkpoint_steps(out) == [n] and last_step(out) == n  # 0 lost
    assert stop_s < 120
    assert all(p.is_running() for p in second_procs), "the first run's stop ended the second run"
    assert second.poll() is None

    # 2. The rerun resumes at N; SIGUSR1 to node 2's rank alone: every rank saves at one step, exit 5.
    run = start_run(proj, hostfile, env)
    wait_for(lambda: last_step(out) >= n + 2 or run.poll() is not None, 600, f"step {n + 2}")
    rank_on(run_id(out), 1).send_signal(signal.SIGUSR1)
    stdout, stderr = run.communicate(timeout=180)
    assert run.returncode == 5, stdout[-3000:] + stderr[-3000:]
    events = lifecycle(out)
    assert (events[-2]["event"], events[-2]["step"]) == ("resume", n)
    m = events[-1]["step"]
    assert events[-1]["event"] == "preempted" and m >= n + 2
    assert checkpoint_steps(out)[-1] == m and last_step(out) == m
    assert f"at step {m} and saved checkpoint-{m}" in flat(stderr)
    assert processes_of(run_id(out), needle=str(proj)) == []

    # 3. The rerun resumes at M; SIGKILL to node 2's rank: exit 4 in seconds, naming it.
    run = start_run(proj, hostfile, env)
    wait_for(lambda: last_step(out) >= m + 1 or run.poll() is not None, 600, f"step {m + 1}")
    rid = run_id(out)
    rank_on(rid, 1).kill()
    t0 = time.monotonic()
    stdout, stderr = run.communicate(timeout=120)
    fail_s = time.monotonic() - t0
    text = flat(stderr)
    assert run.returncode == 4, stdout[-3000:] + stderr[-3000:]
    assert "rank 1 on 127.0.0.2 (node 1) was killed by SIGKILL" in text, text
    assert f"checkpoint-{m} (step {m}); a rerun resumes from it" in text
    assert "no process of it is left on 127.0.0.1, 127.0.0.2" in text
    assert fail_s < 60
    assert processes_of(rid, needle=str(proj)) == []
    assert base_status(proj, env)["state"] == "failed"

    # 4. The rerun resumes at M and finishes the stage on both nodes.
    run = start_run(proj, hostfile, env)
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert lifecycle(out)[-2]["event"] == "resume" and lifecycle(out)[-2]["step"] == m
    assert json.loads((out / "stage_complete.json").read_text())["steps"] == 14
    log = (out / "train.log").read_text()
    assert "ZeRO-3 partitioned" in log and "127.0.0.2: " in log and "dist_world_size=2" in log

    # The second run was never touched; `stop --now` ends it on both nodes, without a save.
    assert second.poll() is None and all(p.is_running() for p in second_procs)
    from longspec_cli.launch import group

    stopped = group.stop_run(out2, "base", save=False, grace_int=5, grace_term=5)
    assert stopped is not None and stopped.remaining == []
    assert second.wait(timeout=60) == 130, second.stdout.read()[-3000:]
    assert processes_of(rid2) == []
    print(f"stop -> every process gone on both nodes: {stop_s:.1f} s; SIGKILL -> exit 4: {fail_s:.1f} s")


@pytest.mark.slow
def test_an_unreachable_node_and_a_taken_master_port_fail_in_seconds(ssh_nodes, tmp_path):
    env = node_env(ssh_nodes)
    proj = tiny_zero3(tmp_path, env)
    hosts3 = tmp_path / "hosts3"
    hosts3.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # no sshd listens on 127.0.0.3
    t0 = time.monotonic()
    res = cli(env, "run", str(proj), "base", *STEPS, "--hostfile", str(hosts3))
    took = time.monotonic() - t0
    text = flat(res.stderr)
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    assert "node 1 (127.0.0.3) cannot be reached over ssh" in text, text
    assert "a rerun starts from step 0" in text
    assert took < 120  # the data is prepared first; the launch itself fails in seconds
    assert base_status(proj, env)["state"] == "failed"

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = cli(env, "run", str(proj), "base", *STEPS, "--hostfile", str(ssh_nodes.hostfile(tmp_path / "h")),
                  "--master-port", str(port))
    text = flat(res.stderr)
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"master port {port} is in use on 127.0.0.1 (node 0)" in text, text
    assert processes_of("", needle=str(proj)) == []


# ------------------------------------------------------------------ without ssh: the commands

def test_each_node_gets_its_command_with_the_environment_written_out(tmp_path, monkeypatch):
    import base64
    import shlex

    from deepspeed.launcher import launch

    from longspec_cli.launch import argv as A
    from longspec_cli.launch import fanout
    from longspec_cli.launch import nodes as N

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=4\nnode-b slots=4\n")
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth7\nMY_SETTING=a b\n")
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    p = A.Placement(hostfile=hosts, gpus=2, master_port=29611)
    r = A.resolve_resources(p, [], env={})  # no GPU here, and this machine is a host: CPU
    assert r.cpu and r.world_size == 4 and r.hosts == (("127.0.0.1", (0, 1)), ("node-b", (0, 1)))
    assert r.where() == "2 node(s) (127.0.0.1: 2 slots, node-b: 2 slots), CPU (DS_ACCELERATOR=cpu)"
    assert not A.resolve_resources(A.Placement(hostfile=hosts, num_nodes=1, include=None), [], env={}).hosts[1:]
    assert not N.uses_nodes(A.Placement(hostfile=hosts, launcher="openmpi"))

    trainer = A.trainer_args(tmp_path / "conf", "base", tmp_path / "runs" / "base", ["seed=1"])
    cmd = N.build_launch(p, r, trainer, tmp_path, extra_env={"TORCH_EXTENSIONS_DIR": "/ops"})
    assert cmd.hosts == ("127.0.0.1", "node-b") and cmd.run_id.startswith("ls-")
    lead = fanout.parse(cmd.argv[cmd.argv.index(N.LEADER) + 1:])
    assert [(n.host, n.slots) for n in lead.nodes] == [("127.0.0.1", [0, 1]), ("node-b", [0, 1])]
    assert lead.master_port == 29611 and lead.trainer == trainer and lead.run_id == cmd.run_id
    assert lead.env["DS_ACCELERATOR"] == "cpu" and lead.env["TORCH_EXTENSIONS_DIR"] == "/ops"
    assert lead.env["PYTHONPATH"] == "/some/where" and lead.env["NCCL_SOCKET_IFNAME"] == "eth7"
    assert lead.env["MY_SETTING"] == "a b" and "OMP_NUM_THREADS" not in lead.env  # set per node, from its cores

    # Node 1's command, as the plan prints it: ssh, the project folder, env, the patient launcher.
    ssh = shlex.split(cmd.comments[1].split(": ", 1)[1])
    assert ssh[0] == "ssh" and ssh[-2] == "node-b" and "BatchMode=yes" in ssh
    line = shlex.split(ssh[-1])
    assert line[:4] == ["cd", str(tmp_path), "&&", "exec"] and line[4] == "env"
    assert f"LONGSPEC_RUN_ID={cmd.run_id}" in line and "MY_SETTING=a b" in line
    node = line[line.index("-m") - 2:]
    assert node[2:5] == ["-m", "longspec.nodelaunch", "--control-stdin"]
    monkeypatch.setattr(sys, "argv", ["launch", *node[5:]])
    ns = launch.parse_args()  # what DeepSpeed's launcher reads once nodelaunch drops --control-stdin
    assert (ns.node_rank, ns.master_port, ns.module, ns.no_local_rank, ns.training_script) == \
        (1, 29611, True, True, "longspec.train")
    assert json.loads(base64.urlsafe_b64decode(ns.world_info)) == {"127.0.0.1": [0, 1], "node-b": [0, 1]}


def test_nodectl_ends_only_the_processes_of_its_run(tmp_path):
    import os

    sleepers = {rid: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                      env={**os.environ, "LONGSPEC_RUN_ID": rid})
                for rid in ("ls-one", "ls-two")}
    try:
        ctl = [sys.executable, "-m", "longspec.nodectl"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        listed = json.loads(subprocess.run([*ctl, "list", "ls-one"], env=env, capture_output=True, text=True,
                                           timeout=60).stdout)
        assert [row["pid"] for row in listed["left"]] == [sleepers["ls-one"].pid]
        res = subprocess.run([*ctl, "end", "ls-one", "--wait", "0.5"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0 and json.loads(res.stdout)["left"] == [], res.stdout + res.stderr
        assert sleepers["ls-one"].wait(timeout=10) == -signal.SIGKILL
        assert sleepers["ls-two"].poll() is None  # another run, the same Python: left alone
        probe = json.loads(subprocess.run([*ctl, "probe", "--pick-port"], env=env, capture_output=True,
                                          text=True, timeout=60).stdout)
        assert probe["port_free"] and probe["cores"] >= 1
    finally:
        for p in sleepers.values():
            p.kill()
            p.wait()
