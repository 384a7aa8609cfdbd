"""Session fixtures for the cluster tests: `slurm_cluster` (tests/cluster/slurm.py) and `ssh_nodes`
(tests/cluster/ssh.py), imported by tests/conftest.py so that every test folder can use them.

Both need root and the programs that tests/cluster/install.sh installs (`make test` runs it). Without
them the tests that use a fixture skip with the reason; with LONGSPEC_REQUIRE_CLUSTER=1 (CI) they
fail instead, so a cluster test can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests import needs
from tests.cluster import slurm, ssh

REQUIRE = needs.REQUIRE
KEEP = os.environ.get("LONGSPEC_KEEP_CLUSTER", "") not in ("", "0")  # leave the folders for a post-mortem


def unavailable(why: str) -> None:
    needs.unavailable(why + " (tests/cluster/install.sh installs them as root)")


def _needs(missing: list[str]) -> None:
    if os.geteuid() != 0:
        unavailable("the cluster tests run their daemons as root")
    if missing:
        unavailable("not installed: " + ", ".join(missing))


@pytest.fixture(scope="session")
def slurm_cluster():
    """slurmctld + slurmd node1, node2 + munged of the tests' own; `.env` has SLURM_CONF."""
    _needs(slurm.missing_programs())
    cluster = slurm.SlurmCluster.start()
    try:
        yield cluster
    finally:
        killed = cluster.stop()
        left = cluster.alive() + [f"slurmstepd {p}" for p in cluster.stepd_pids()]
        if not KEEP and not left:
            shutil.rmtree(cluster.root, ignore_errors=True)
        assert not left, f"daemons still alive after the cluster's stop: {left}"
        assert not killed, f"had to kill at the cluster's stop: {killed}\n{cluster.logs()}"


@pytest.fixture(scope="session")
def ssh_nodes():
    """An sshd of the tests' own on 127.0.0.1 and 127.0.0.2; `.env` makes ssh and pdsh reach both."""
    _needs(ssh.missing_programs())
    nodes = ssh.SshNodes.start()
    try:
        yield nodes
    finally:
        left = nodes.stop()
        if not KEEP:
            shutil.rmtree(nodes.root, ignore_errors=True)
        assert not left, f"processes of the test sshd still alive at its stop (killed): {left}"
