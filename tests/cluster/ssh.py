"""Two "nodes" of this machine reached over real ssh: 127.0.0.1 and 127.0.0.2.

An sshd of the tests' own (its own host key, sshd_config, authorized key, pid file) listens on both
loopback addresses on one free port; root logs in by key only. The client side is a config file
(port, key, known hosts: no prompt, no password) and an `ssh` wrapper first on PATH that passes it
with -F, because DeepSpeed's runner calls plain `ssh HOST ...` (its reachability check and
`hostname -I`) and pdsh's ssh module runs `ssh` from PATH. Nothing under ~/.ssh is read or written.

`SshNodes.env` is the environment for subprocesses: PATH with the wrapper first, PDSH_RCMD_TYPE=ssh,
PDSH_SSH_ARGS_APPEND with the port, key and config (for a pdsh that runs the system ssh itself).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.slurm import ClusterError, free_ports, wait_until

HOSTS = ("127.0.0.1", "127.0.0.2")
PROGRAMS = ("sshd", "ssh", "ssh-keygen", "pdsh")

SSHD_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey {root}/ssh_host_ed25519_key
PidFile {root}/sshd.pid
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 100:30:200
MaxSessions 100
LogLevel ERROR
"""

CLIENT_CONFIG = """\
Host 127.0.0.1 127.0.0.2 localhost
    Port {port}
    User root
    IdentityFile {root}/client_key
    IdentitiesOnly yes
    UserKnownHostsFile {root}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
    LogLevel ERROR
"""


def missing_programs() -> list[str]:
    return [n for n in PROGRAMS if shutil.which(n) is None and not os.access(f"/usr/sbin/{n}", os.X_OK)]


@dataclass
class SshNodes:
    root: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    hosts: tuple[str, ...] = HOSTS
    _proc: subprocess.Popen | None = None

    @property
    def config(self) -> Path:
        return self.root / "ssh_config"

    @classmethod
    def start(cls, root: Path | None = None, timeout: float = 30.0) -> "SshNodes":
        root = Path(root or tempfile.mkdtemp(prefix="longspec-ssh-"))
        root.mkdir(parents=True, exist_ok=True)
        (port,) = free_ports(1)
        for key in ("ssh_host_ed25519_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"longspec-tests-{key}",
                            "-f", str(root / key)], check=True, capture_output=True, timeout=30)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        host_pub = (root / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        (root / "known_hosts").write_text("".join(f"[{h}]:{port} {' '.join(host_pub)}\n"
                                                  for h in (*HOSTS, "localhost")))
        (root / "sshd_config").write_text(SSHD_CONFIG.format(port=port, root=root))
        (root / "ssh_config").write_text(CLIENT_CONFIG.format(port=port, root=root))
        ssh = shutil.which("ssh") or "/usr/bin/ssh"
        bindir = root / "bin"
        bindir.mkdir(exist_ok=True)
        wrapper = bindir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {ssh} -F {root}/ssh_config "$@"\n')
        wrapper.chmod(0o755)
        env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               "PDSH_RCMD_TYPE": "ssh",
               "PDSH_SSH_ARGS_APPEND": f"-F {root}/ssh_config -p {port} -i {root}/client_key"}
        nodes = cls(root=root, port=port, env=env)
        # sshd refuses to start without its privilege separation folder (the service unit makes it)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        log = open(root / "sshd.log", "ab")
        nodes._proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(root / "sshd_config")], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            wait_until(lambda: nodes._proc.poll() is not None or all(nodes.reachable(h) for h in HOSTS), timeout,
                       "sshd to accept logins on both addresses", interval=0.3)
            if nodes._proc.poll() is not None:
                raise ClusterError(f"sshd exited {nodes._proc.returncode}: "
                                   + (root / "sshd.log").read_text(errors="replace")[-2000:])
        except BaseException:
            nodes.stop()
            raise
        return nodes

    def reachable(self, host: str) -> bool:
        try:
            return self.ssh(host, "true", timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def ssh(self, host: str, command: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", host, command], env=self.env, capture_output=True, text=True, timeout=timeout)

    def pdsh(self, command: str, hosts=HOSTS, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(["pdsh", "-S", "-w", ",".join(hosts), command], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        """A DeepSpeed hostfile naming both addresses."""
        path.write_text("".join(f"{h} slots={slots}\n" for h in HOSTS))
        return path

    def stop(self, timeout: float = 15.0) -> list[int]:
        """End sshd and every session it started; returns the session processes that had to be killed."""
        if self._proc is None:
            return []
        left = self.session_pids()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)
        killed = []
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def session_pids(self) -> list[int]:
        """Processes this sshd started (its connections and what they run), still alive."""
        import psutil

        if self._proc is None or self._proc.poll() is not None:
            return []
        try:
            return [p.pid for p in psutil.Process(self._proc.pid).children(recursive=True)]
        except psutil.Error:
            return []
