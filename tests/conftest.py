"""Fixtures every test folder may use: the machine's own SLURM cluster and ssh nodes (tests/cluster),
and how the suite is shared between pytest-xdist's workers (`make test` runs two).

Every DeepSpeed launch of the suite, direct or through `longspec run`, builds its CPU ops
(the shared-memory comm op, cpu_adam: about 50 s each here) into the one folder `longspec run`
uses, so a fresh machine builds each op once.
"""

import os

import pytest

from longspec_cli.launch.execute import ops_build_dir
from tests.cluster.fixtures import slurm_cluster, ssh_nodes  # noqa: F401  (pytest finds them here)

os.environ.setdefault("TORCH_EXTENSIONS_DIR", ops_build_dir())


CLUSTER_FIXTURES = {"slurm_cluster", "ssh_nodes"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `-n N --dist loadgroup`, a test file runs whole on one worker (its module fixtures, such
    as a trained run folder, are built once), and every test of the machine's one SLURM cluster and
    sshd runs on the same worker (they are session fixtures: a second worker would start a second
    cluster). Runs before xdist reads the groups."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = "cluster" if CLUSTER_FIXTURES & set(item.fixturenames) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
