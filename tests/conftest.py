"""Fixtures every test folder may use: the machine's own SLURM cluster and ssh nodes (tests/cluster),
and how the suite is shared between pytest-xdist's workers (`make test` runs two).

Every DeepSpeed launch of the suite, direct or through `longspec run`, builds its CPU ops
(the shared-memory comm op, cpu_adam: about 50 s each here) into the one folder `longspec run`
uses, so a fresh machine builds each op once.
"""

import os

import pytest

from longspec.machine.opsdir import ops_build_dir
from tests.cluster.fixtures import slurm_cluster, ssh_nodes  # noqa: F401  (pytest finds them here)

os.environ.setdefault("TORCH_EXTENSIONS_DIR", ops_build_dir())
# On an xdist worker, torch (here and in every process a test starts) takes its share of the
# cores, not all of them: two workers of two threads each on two cores oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


CLUSTER_FIXTURES = {"slurm_cluster", "ssh_nodes"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `-n N --dist loadgroup`, a test file runs whole on one worker (its module fixtures, such
    as a trained run folder, are built once), and every test of the machine's one SLURM cluster and
    sshd runs on the same worker (they are session fixtures: a second worker would start a second
    cluster). On a worker the groups are also put heaviest first (slow tests count 60 to one), so
    that a long end-to-end test does not start last while the other worker sits idle; `make test`
    passes --no-loadscope-reorder, which keeps this order. Runs before xdist reads the groups."""
    groups: dict[str, list] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is None:
            cluster = CLUSTER_FIXTURES & set(item.fixturenames)
            mark = pytest.mark.xdist_group("cluster" if cluster else item.nodeid.split("::")[0])
            item.add_marker(mark)
        groups.setdefault(mark.kwargs.get("name", mark.args[0] if mark.args else ""), []).append(item)
    if hasattr(config, "workerinput"):
        weight = {g: sum(60 if i.get_closest_marker("slow") else 1 for i in its) for g, its in groups.items()}
        items[:] = [i for g in sorted(groups, key=lambda g: -weight[g]) for i in groups[g]]   # stable within a group
