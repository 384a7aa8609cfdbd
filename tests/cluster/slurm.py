"""A SLURM cluster on this machine for the tests: munged, slurmctld and two slurmd (node1, node2).

Everything lives in one temporary folder: slurm.conf, the state and spool folders, pid files, logs,
its own munge key and munge socket. Every port listens on 127.0.0.1. Clients find the cluster
through SLURM_CONF (`SlurmCluster.env`); nothing of the machine's own configuration is read or
written. No accounting database: a job's state comes from `scontrol show job` (MinJobAge keeps a
finished job visible to it for the tests).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "munge", "slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "sinfo", "scancel", "srun")
NODES = ("node1", "node2")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE")


class ClusterError(RuntimeError):
    pass


def missing_programs(names=DAEMONS) -> list[str]:
    return [n for n in names if shutil.which(n) is None and not os.access(f"/usr/sbin/{n}", os.X_OK)]


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


SLURM_CONF = """\
ClusterName=longspectest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=10
OverTimeLimit=1
MinJobAge=3600
InactiveLimit=0
JobRequeue=1
NodeName=node1 NodeAddr=127.0.0.1 NodeHostname={host} Port={node1_port} CPUs=1 RealMemory=1024 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 NodeHostname={host} Port={node2_port} CPUs=1 RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str] = field(default_factory=dict)   # for clients: SLURM_CONF and the rest of os.environ
    nodes: tuple[str, ...] = NODES
    _procs: list[subprocess.Popen] = field(default_factory=list)

    # ------------------------------------------------------------------------------ start / stop
    @classmethod
    def start(cls, root: Path | None = None, timeout: float = 60.0) -> "SlurmCluster":
        root = Path(root or tempfile.mkdtemp(prefix="longspec-slurm-"))
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)   # munged wants every folder above its socket searchable by all
        for sub in ("munge", "state", "run", "log", *(f"spool/{n}" for n in NODES)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "munge", 0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        ctld, slurmd, n1, n2 = free_ports(4)
        (root / "slurm.conf").write_text(SLURM_CONF.format(root=root, host=socket.gethostname(), ctld_port=ctld,
                                                           slurmd_port=slurmd, node1_port=n1, node2_port=n2))
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del env[k]   # a test run inside a real allocation must not leak it into this cluster
        cluster = cls(root=root, env=env)
        try:
            cluster._start_daemons(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        out = open(self.root / "log" / log, "ab")
        proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        self._procs.append(proc)
        return proc

    def _start_daemons(self, timeout: float) -> None:
        m = self.root / "munge"
        self._spawn([_program("munged"), "--foreground", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                     f"--pid-file={m}/munged.pid", f"--log-file={self.root}/log/munged.log",
                     f"--seed-file={m}/munged.seed"], "munged.out")
        wait_until(lambda: (m / "munge.socket").exists() or self._died(), timeout, "munged's socket")
        self._check_alive("munged")
        self._spawn([_program("slurmctld"), "-D", "-i", "-f", str(self.root / "slurm.conf")], "slurmctld.out")
        wait_until(lambda: self._died() or self.run(["scontrol", "ping"], check=False).stdout.count("UP") > 0,
                   timeout, "slurmctld to answer `scontrol ping`", interval=0.5)
        self._check_alive("slurmctld")
        for node in NODES:
            self._spawn([_program("slurmd"), "-D", "-N", node, "-f", str(self.root / "slurm.conf")], f"slurmd-{node}.out")
        wait_until(lambda: self._died() or self.nodes_idle(), timeout, "both nodes idle", interval=0.5)
        self._check_alive("slurmd")

    def _died(self) -> bool:
        return any(p.poll() is not None for p in self._procs)

    def _check_alive(self, what: str) -> None:
        dead = [p for p in self._procs if p.poll() is not None]
        if dead:
            raise ClusterError(f"{what} did not start (exit {dead[0].returncode}: {' '.join(dead[0].args[:3])})\n"
                               + self.logs())

    def logs(self, lines: int = 30) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def nodes_idle(self) -> bool:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in NODES)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """Cancel every job, end every daemon (SIGTERM, then SIGKILL), return what had to be killed."""
        killed = []
        if any(p.poll() is None for p in self._procs):
            self.run(["scancel", "--full", "--user=root"], check=False, timeout=15)
            # job steps and batch shells run under slurmstepd, which the slurmd stop does not end at once
            try:
                wait_until(lambda: not self.run(["squeue", "-h"], check=False, timeout=10).stdout.strip(), 20,
                           "the jobs to end", interval=0.5)
            except ClusterError:
                pass
        for proc in reversed(self._procs):   # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    killed.append(" ".join(proc.args[:3]))
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        for pid in self.stepd_pids():
            killed.append(f"slurmstepd {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def stepd_pids(self) -> list[int]:
        """slurmstepd processes of this cluster still alive (they name its spool folder)."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"slurmstepd" in cmd.split(b"\0")[0] and _pid_alive(int(d.name)):
                environ = b""
                try:
                    environ = (d / "environ").read_bytes()
                except OSError:
                    pass
                if str(self.root).encode() in environ or str(self.root).encode() in cmd:
                    pids.append(int(d.name))
        return pids

    def alive(self) -> list[str]:
        return [" ".join(p.args[:3]) for p in self._procs if p.poll() is None]

    # ---------------------------------------------------------------------------------- clients
    def run(self, argv: list[str], *, check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed (exit {res.returncode}): {res.stderr.strip()}")
        return res

    def sbatch(self, *args: str, cwd: Path | None = None) -> str:
        res = self.run(["sbatch", "--parsable", *args], cwd=cwd)
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as {key: value} ({} when the controller no longer knows it)."""
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if res.returncode != 0 or not res.stdout.strip():
            return {}
        return parse_record(res.stdout.strip().splitlines()[0])

    def job_state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_job_state(self, job_id: str, states, timeout: float) -> dict[str, str]:
        """Wait until the job's state is one of `states` (a string or several); returns its record.
        A job that reaches another terminal state first ends the wait with an error naming it."""
        states = (states,) if isinstance(states, str) else tuple(states)
        seen: dict[str, str] = {}

        def reached():
            seen.clear()
            seen.update(self.job(job_id))
            state = seen.get("JobState", "")
            if state in states:
                return dict(seen)
            if state in TERMINAL:
                raise ClusterError(f"job {job_id} ended {state} (reason {seen.get('Reason')}) while waiting for "
                                   f"{'/'.join(states)}; exit code {seen.get('ExitCode')}")
            return None

        try:
            return wait_until(reached, timeout, f"job {job_id} to be {'/'.join(states)}", interval=0.5)
        except ClusterError as e:
            raise ClusterError(f"{e}; last seen {seen.get('JobState')!r} (reason {seen.get('Reason')})") from None

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


_FIELD = re.compile(r"(\w[\w:/]*)=(.*?)(?=\s+\w[\w:/]*=|$)")


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line as {key: value} (values may hold spaces, e.g. Command)."""
    return {m.group(1): m.group(2) for m in _FIELD.finditer(line.strip())}
