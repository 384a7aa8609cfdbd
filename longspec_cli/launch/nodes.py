"""A run on several nodes over ssh: each node's command, its environment, and the small per-host
requests (`python -m longspec.nodectl` over ssh) that find exactly one run's processes there.

`run --hostfile H` (with DeepSpeed's default launcher, pdsh) does not go through DeepSpeed's runner:
its pdsh fan-out ends a run with `pkill -f "<python> -u -m deepspeed.launcher.launch"` on every host
(every run of that Python), never tells the nodes of a stop, and waits out a rendezvous timeout when
a node cannot start. Instead `run` starts one leader (`python -m longspec_cli.launch.fanout`, the
process group that run.json names) which starts, over `ssh HOST`, on every node

    cd PROJECT && exec env K=V ... LONGSPEC_RUN_ID=<id> PYTHON -u -m longspec.nodelaunch --control-stdin
        --world_info=<DeepSpeed's> --node_rank=N --master_addr=A --master_port=P --no_local_rank
        --module longspec.train --config-dir ... +exp=STAGE output_dir=... [overrides]

which is what DeepSpeed's runner runs per node (deepspeed/launcher/multinode_runner.py), with the
environment written out: DS_ACCELERATOR, OMP_NUM_THREADS (the node's cores / its ranks unless set),
TORCH_EXTENSIONS_DIR, PYTHONPATH, what DeepSpeed's runner exports (NCCL*, PYTHON*, UCX*, MV2*,
MLFLOW*) and the lines of `~/.deepspeed_env` and `./.deepspeed_env`, as its runner reads them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from longspec_cli.launch.argv import LaunchCommand, Placement, Resources
from longspec_cli.launch.argv import encode_world_info as encode_world

RUN_ID_ENV = "LONGSPEC_RUN_ID"  # longspec/nodectl.py reads the same name
LEADER = "longspec_cli.launch.fanout"
NODE_LAUNCHER = "longspec.nodelaunch"
NODECTL = "longspec.nodectl"
OUTCOME_MARK = "LONGSPEC-NODES "  # the leader's last line in train.log: how the run ended on each node
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3")
CTL_TIMEOUT_S = 30.0  # one request to a node (ssh connect, python, psutil), beyond its own waiting
# What DeepSpeed's runner passes on to the nodes (runner.py EXPORT_ENVS + the CUDA accelerator's
# NCCL), and what longspec's ranks read.
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "UCX", "MV2", "LONGSPEC_", "HF_", "TRANSFORMERS_")
EXPORT_NAMES = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME",
                "CUDA_LAUNCH_BLOCKING", "TORCH_DISTRIBUTED_DEBUG")


def uses_nodes(p: Placement) -> bool:
    """A hostfile with DeepSpeed's default launcher (pdsh): longspec starts the nodes itself.
    openmpi, mvapich and slurm (`--launcher`) still go through DeepSpeed's runner."""
    return p.multi_node and p.launcher in (None, "pdsh")


def new_run_id() -> str:
    return "ls-" + uuid.uuid4().hex[:16]


# ------------------------------------------------------------------------------ environment

def deepspeed_env_files(cwd: Path) -> list[Path]:
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    return [p for p in (Path.home() / name, Path(cwd) / name) if p.is_file()]


def node_env(r: Resources, cwd: Path, extra: dict[str, str] | None = None,
             environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every node's launcher gets, written out (the rest of a node's environment
    is its own login's)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if (k.startswith(EXPORT_PREFIXES) or k in EXPORT_NAMES) and k != RUN_ID_ENV}
    for path in deepspeed_env_files(cwd):
        for line in path.read_text(errors="replace").splitlines():
            key, eq, val = line.strip().partition("=")
            if eq and key and not key.startswith("#"):
                env[key.strip()] = val.strip()
    own = {"DS_ACCELERATOR": "cpu"} if r.cpu else {}  # OMP_NUM_THREADS: the leader sets it per node
    return {**env, **own, **(extra or {})}


# ---------------------------------------------------------------------------------- commands

def remote_command(cwd: str, env: dict[str, str], argv: list[str]) -> str:
    """One shell line for `ssh HOST LINE`: go to the project, then exec the command with `env`."""
    words = ["env", *(f"{k}={v}" for k, v in env.items()), *argv] if env else list(argv)
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def ssh_argv(host: str, line: str) -> list[str]:
    return ["ssh", *SSH_OPTIONS, host, line]


def node_launch_argv(python: str, world: dict[str, list[int]], node_rank: int, addr: str, port: int | str,
                     trainer: list[str]) -> list[str]:
    return [python, "-u", "-m", NODE_LAUNCHER, "--control-stdin", f"--world_info={encode_world(world)}",
            f"--node_rank={node_rank}", f"--master_addr={addr}", f"--master_port={port}", "--no_local_rank",
            *trainer]


def build_launch(p: Placement, r: Resources, trainer: list[str], cwd: Path, *,
                 extra_env: dict[str, str] | None = None, python: str | None = None,
                 run_id: str | None = None) -> LaunchCommand:
    """The leader's command (what run.json names), and each node's command as comments."""
    python = python or sys.executable
    run_id = run_id or new_run_id()
    cwd = Path(cwd).resolve()
    env = node_env(r, cwd, extra_env)
    argv = [python, "-u", "-m", LEADER, "--run-id", run_id, "--cwd", str(cwd), "--python", python]
    for host, slots in r.hosts:
        argv += ["--host", f"{host}={','.join(str(s) for s in slots)}"]
    if p.master_addr:
        argv += ["--master-addr", p.master_addr]
    if p.master_port is not None:
        argv += ["--master-port", str(p.master_port)]
    for k, v in env.items():
        argv += ["--env", f"{k}={v}"]
    argv += ["--", *trainer]
    world = {h: list(s) for h, s in r.hosts}
    first = r.hosts[0][0]
    addr = p.master_addr or (f"<{first}'s first address>" if not _is_address(first) else first)
    port = p.master_port if p.master_port is not None else f"<a free port on {first}>"
    comments = tuple(f"node {i} ({h}, {len(s)} slot(s)): " + shlex.join(ssh_argv(h, remote_command(
        str(cwd), {**env, RUN_ID_ENV: run_id}, node_launch_argv(python, world, i, addr, port, trainer))))
        for i, (h, s) in enumerate(r.hosts))
    return LaunchCommand(argv=argv, env={}, world_size=r.world_size, cpu=r.cpu,
                         hosts=tuple(h for h, _ in r.hosts), run_id=run_id, comments=comments)


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


# ------------------------------------------------------------------ requests to every node

@dataclass
class Reply:
    host: str
    ok: bool
    data: dict | None = None
    error: str = ""  # why there is no answer: ssh's last words and its exit code


def ctl(host: str, words: list[str], *, python: str, cwd: str, env: dict[str, str],
        timeout: float = CTL_TIMEOUT_S) -> Reply:
    """Run `python -m longspec.nodectl WORDS` on `host` over ssh; its JSON line, or why not."""
    keep = {k: v for k, v in env.items() if k.startswith("PYTHON")}
    line = remote_command(cwd, keep, [python, "-m", NODECTL, *words])
    try:
        res = subprocess.run(ssh_argv(host, line), capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Reply(host, False, error=f"no answer within {timeout:.0f} s")
    except OSError as e:
        return Reply(host, False, error=f"cannot run ssh: {e.strerror or e}")
    for out in reversed(res.stdout.splitlines()):
        if out.startswith("{"):
            try:
                return Reply(host, True, json.loads(out))
            except ValueError:
                break
    said = [x for x in (res.stderr.strip().splitlines() or res.stdout.strip().splitlines()) if x.strip()]
    return Reply(host, False, error=f"{said[-1].strip() if said else 'no output'} (ssh exit {res.returncode})")


def ctl_all(hosts: list[str], words_of, **kw) -> dict[str, Reply]:
    """ctl() on every host at once; words_of(index, host) gives each host's words."""
    out: dict[str, Reply] = {}

    def one(i: int, h: str) -> None:
        out[h] = ctl(h, words_of(i, h), **kw)

    threads = [threading.Thread(target=one, args=(i, h), daemon=True) for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {h: out[h] for h in hosts}


def end_everywhere(hosts: list[str], run_id: str, *, python: str, cwd: str, env: dict[str, str],
                   wait: float = 10.0, signal_name: str | None = None) -> tuple[dict[str, list], dict[str, str]]:
    """Wait up to `wait` s for the run's processes on every host to end, SIGKILL the rest, check.
    Returns (processes still there per host, hosts that could not be asked: why)."""
    words = ["end", run_id, "--wait", str(wait)] + (["--signal", signal_name] if signal_name else [])
    replies = ctl_all(hosts, lambda i, h: words, python=python, cwd=cwd, env=env, timeout=wait + CTL_TIMEOUT_S)
    left = {h: r.data.get("left", []) for h, r in replies.items() if r.ok and r.data.get("left")}
    unasked = {h: r.error for h, r in replies.items() if not r.ok}
    return left, unasked


def read_outcome(lines: list[str]) -> dict | None:
    """The leader's last report (OUTCOME_MARK line) among train.log's last lines, or None."""
    for line in reversed(lines):
        if line.startswith(OUTCOME_MARK):
            try:
                return json.loads(line[len(OUTCOME_MARK):])
            except ValueError:
                return None
    return None


def leftovers_sentence(outcome: dict | None, hosts: tuple[str, ...]) -> str:
    """What run says about the run's processes once it is over (checked on each host by the leader)."""
    if outcome is None:
        return "its processes on " + ", ".join(hosts) + " could not be checked"
    left, unasked = outcome.get("left") or {}, outcome.get("unasked") or {}
    parts = [f"{len(v)} process(es) still on {h}" for h, v in left.items()]
    parts += [f"{h} could not be checked ({why})" for h, why in unasked.items()]
    return "; ".join(parts) if parts else f"no process of it is left on {', '.join(hosts)}"
