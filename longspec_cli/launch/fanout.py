"""`python -m longspec_cli.launch.fanout`: the leader of a run on several nodes (launch/nodes.py).

`longspec run --hostfile` starts it as the run's process group (run.json names it); it
1. asks every node at once over ssh (`longspec.nodectl probe`): a node that cannot be reached, or
   cannot run this Python in the project folder, ends the run here, before any rank starts; node 0
   picks the master port (or checks the one given: a taken port is named), and every node is told it;
2. starts each node's launcher over ssh (`longspec.nodelaunch --control-stdin`, its own session),
   passing each node's output on to train.log (node 0 as it is, the others after `HOST: `);
3. follows them. A stop request (SIGTERM, SIGINT or SIGUSR1 to this process: `longspec stop`, Ctrl-C
   in `run`, a scheduler's signal to the group) is written to every node's launcher (`save`): every
   rank finishes its step, saves and exits 5. A second request later than 2 s, or SIGUSR2 (`stop
   --now`), ends every rank now (`kill`). A node that ends with another code (a rank killed, a
   launcher gone, a lost connection) is a fault: after a short grace for the others to say how they
   ended, every other node's ranks are ended now;
4. checks on every host that no process carrying the run's id is left (`longspec.nodectl end`),
   ending any that is, and writes one last line, `LONGSPEC-NODES {json}`: the exit code, the fault
   (host, rank, signal or exit status), what is left where. Exit: 0, 5 (saved on a stop signal),
   130 (ended without saving), 4 (a fault).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import threading
import time

from longspec_cli.launch import nodes as N

FAULT_GRACE_S = 2.0  # after a node's fault: time for the others to end (and say how) by themselves
KILL_WAIT_S = 10.0  # after `kill`: time for the nodes' launchers to end before the hosts are cleaned up
PREEMPT_WAIT_S = 600.0  # after a node saved and exited 5: time for the others to do the same
ECHO_S = 2.0  # a second stop request within this is the same request (longspec/training/preempt.py)
NODE_MARK = "LONGSPEC-NODE "  # longspec/nodelaunch.py's report
EXIT_OK, EXIT_FAULT, EXIT_PREEMPTED, EXIT_STOPPED = 0, 4, 5, 130


def say(text: str) -> None:
    print(f"[nodes] {text}", flush=True)


class Requests:
    """Stop requests arriving as signals; the main loop acts on them."""

    def __init__(self) -> None:
        self.save_at: float | None = None
        self.now = False
        self.pending: list[str] = []

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._save)
        signal.signal(signal.SIGUSR2, self._now)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _save(self, signum, frame) -> None:
        t = time.monotonic()
        if self.save_at is None:
            self.save_at = t
            self.pending.append(f"{signal.Signals(signum).name}: every rank on every node saves at its step")
        elif t - self.save_at >= ECHO_S and not self.now:
            self._now(signum, frame)

    def _now(self, signum, frame) -> None:
        if not self.now:
            self.now = True
            self.pending.append(f"{signal.Signals(signum).name}: every rank on every node ends now, unsaved")


class Node:
    def __init__(self, index: int, host: str, slots: list[int]) -> None:
        self.index, self.host, self.slots = index, host, slots
        self.proc: subprocess.Popen | None = None
        self.report: dict | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.code: int | None = None
        self.ended_at: float | None = None
        self.reader: threading.Thread | None = None

    def send(self, word: str) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.stdin.write(word + "\n")
                self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def read(self, out) -> None:
        prefix = "" if self.index == 0 else f"{self.host}: "
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(NODE_MARK):
                try:
                    self.report = json.loads(line[len(NODE_MARK):])
                except ValueError:
                    pass
                continue
            self.tail.append(line)
            try:
                out.write(prefix + line + "\n")
                out.flush()
            except (OSError, ValueError):
                pass

    def describe(self, port: int | None) -> str:
        """How this node ended, in one clause: host, rank, signal or status."""
        where = f"{self.host} (node {self.index})"
        text = "\n".join(self.tail)
        port_note = (f" (master port {port} is in use on {self.host})" if port is not None and self.index == 0
                     and ("EADDRINUSE" in text or "address already in use" in text.lower()) else "")
        first = (self.report or {}).get("first_failed")
        if first:
            return f"rank {first['rank']} on {where} {_how(first['returncode'])}{port_note}"
        if self.report is not None:
            return f"the launcher on {where} {_how(self.report.get('code'))}{port_note}"
        last = next((x.strip() for x in reversed(self.tail) if x.strip()), "")
        return (f"the launcher on {where} ended without a report (ssh exit {self.code}: killed, or the node or "
                f"its connection was lost){': ' + last if last else ''}")


def _how(code) -> str:
    if isinstance(code, int) and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if isinstance(code, int) and code > 128:
        try:
            return f"exited with status {code} ({signal.Signals(code - 128).name}?)"
        except ValueError:
            pass
    return f"exited with status {code}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {N.LEADER}")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--cwd", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--host", action="append", required=True, help="HOST=SLOT[,SLOT...] in node order")
    ap.add_argument("--master-addr")
    ap.add_argument("--master-port", type=int)
    ap.add_argument("--env", action="append", default=[], help="K=V for every node")
    ap.add_argument("trainer", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    a.trainer = a.trainer[1:] if a.trainer[:1] == ["--"] else a.trainer
    a.nodes = []
    for i, spec in enumerate(a.host):
        host, _, slots = spec.rpartition("=")
        a.nodes.append(Node(i, host, [int(s) for s in slots.split(",") if s]))
    a.env = dict(e.split("=", 1) for e in a.env)
    return a


def main(argv: list[str] | None = None) -> int:
    req = Requests()
    req.install()  # before anything slow: a stop request is never lost
    a = parse(argv)
    hosts = [n.host for n in a.nodes]
    kw = dict(python=a.python, cwd=a.cwd, env=a.env)
    say(f"run {a.run_id}: {len(hosts)} node(s): " + ", ".join(f"{n.host} ({len(n.slots)} slot(s))" for n in a.nodes))
    started = time.monotonic()

    def probe_words(i: int, host: str) -> list[str]:
        if i:
            return ["probe"]
        return ["probe", *(["--port", str(a.master_port)] if a.master_port else ["--pick-port"]),
                *([] if a.master_addr or N._is_address(host) else ["--addr"])]

    probes = N.ctl_all(hosts, probe_words, **kw)
    bad = [r for r in probes.values() if not r.ok]
    if bad:
        cause = "; ".join(f"node {hosts.index(r.host)} ({r.host}) " + (
            "cannot be reached over ssh" if "(ssh exit 255)" in r.error or "no answer" in r.error
            else f"cannot run {a.python} -m longspec.nodectl in {a.cwd} there") + f": {r.error}" for r in bad)
        return finish(a, EXIT_FAULT, cause, started, checked=False)
    p0 = probes[hosts[0]].data
    port = p0.get("port")
    if not p0.get("port_free"):
        return finish(a, EXIT_FAULT, f"master port {port} is in use on {hosts[0]} (node 0); pass a free one "
                      "with --master-port, or leave it out to have one picked", started, checked=False)
    addr = a.master_addr or (hosts[0] if N._is_address(hosts[0]) else p0.get("addr") or hosts[0])
    say(f"master {addr}:{port} ({'given' if a.master_port else 'free on ' + hosts[0]}), "
        f"reachable: {', '.join(hosts)} in {time.monotonic() - started:.1f} s")
    if req.pending:
        say(req.pending.pop(0) + " (before any rank started)")
        return finish(a, EXIT_STOPPED, None, started, checked=False)

    world = {n.host: n.slots for n in a.nodes}
    for n in a.nodes:
        env = dict(a.env)
        if "OMP_NUM_THREADS" not in env and env.get("DS_ACCELERATOR") == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, int(probes[n.host].data.get("cores") or 1) // max(1, len(n.slots))))
        env[N.RUN_ID_ENV] = a.run_id
        line = N.remote_command(a.cwd, env, N.node_launch_argv(a.python, world, n.index, addr, port, a.trainer))
        say(f"node {n.index} ({n.host}): ssh {n.host} {line}")
        n.proc = subprocess.Popen(N.ssh_argv(n.host, line), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        n.reader = threading.Thread(target=n.read, args=(sys.stdout,), daemon=True)
        n.reader.start()
    code, cause = follow(a, req, port)
    return finish(a, code, cause, started)


def follow(a: argparse.Namespace, req: Requests, port: int | None) -> tuple[int, str | None]:
    """Until every node's launcher has ended: (exit code, the fault or None)."""
    fault_at = killed_at = preempted_at = None
    saving = stopping = False
    live = list(a.nodes)
    while live:
        while req.pending:
            say(req.pending.pop(0))
        if req.save_at is not None and not saving:
            saving = True
            for n in live:
                n.send("save")
        if req.now and not stopping:
            stopping = True
            killed_at = killed_at or time.monotonic()
            for n in live:
                n.send("kill")
        for n in list(live):
            if n.proc.poll() is not None:
                n.reader.join(timeout=5)
                n.code, n.ended_at = n.proc.returncode, time.monotonic()
                live.remove(n)
                if n.code == EXIT_PREEMPTED and preempted_at is None:
                    preempted_at = n.ended_at
                elif n.code not in (EXIT_OK, EXIT_PREEMPTED) and fault_at is None and not (saving or stopping):
                    fault_at = n.ended_at
                    say(f"{n.describe(port)}: ending the other node(s)")
        t = time.monotonic()
        if live and killed_at is None and (
                (fault_at is not None and t - fault_at >= FAULT_GRACE_S)
                or (preempted_at is not None and t - preempted_at >= PREEMPT_WAIT_S)):
            killed_at = t
            for n in live:
                n.send("kill")
        if live and killed_at is not None and t - killed_at >= KILL_WAIT_S:
            for n in live:  # its launcher does not answer: the hosts' cleanup ends what it started
                n.proc.kill()
        time.sleep(0.1)
    if fault_at is not None:
        faulty = [n for n in a.nodes if n.code not in (EXIT_OK, EXIT_PREEMPTED, None)
                  and n.ended_at is not None and n.ended_at <= fault_at + FAULT_GRACE_S]
        # A rank killed by a signal is the cause; the others' errors (a peer gone) follow from it.
        faulty.sort(key=lambda n: (not _signalled(n), n.ended_at))
        cause = faulty[0].describe(port)
        also = [n.describe(port) for n in faulty[1:]]
        return EXIT_FAULT, cause + (f" (then: {'; '.join(also)})" if also else "")
    if all(n.code == EXIT_OK for n in a.nodes):
        return EXIT_OK, None
    if any(n.code == EXIT_PREEMPTED for n in a.nodes) and not stopping:
        return EXIT_PREEMPTED, None
    return EXIT_STOPPED, None


def _signalled(n: Node) -> bool:
    first = (n.report or {}).get("first_failed")
    return bool(first) and isinstance(first.get("returncode"), int) and first["returncode"] < 0


def finish(a: argparse.Namespace, code: int, cause: str | None, started: float, checked: bool = True) -> int:
    """Check every host (ending what is left of the run there), then the last line and the exit code.
    Before any launcher started (checked=False) there is nothing of the run on any host to look for."""
    hosts = [n.host for n in a.nodes]
    left: dict = {}
    unasked: dict = {}
    if checked:
        left, unasked = N.end_everywhere(hosts, a.run_id, python=a.python, cwd=a.cwd, env=a.env, wait=5.0)
    if cause:
        say(f"fault: {cause}")
    say(f"ended in {time.monotonic() - started:.1f} s, exit {code}; "
        + N.leftovers_sentence({"left": left, "unasked": unasked}, tuple(hosts)))
    print(N.OUTCOME_MARK + json.dumps({"code": code, "fault": cause, "hosts": hosts, "left": left,
                                       "unasked": unasked, "checked": checked, "run_id": a.run_id}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
