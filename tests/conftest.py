"""Fixtures every test folder may use: the machine's own SLURM cluster and ssh nodes (tests/cluster)."""

from tests.cluster.fixtures import slurm_cluster, ssh_nodes  # noqa: F401  (pytest finds them here)
