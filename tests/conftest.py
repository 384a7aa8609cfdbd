"""Fixtures every test folder may use: the machine's own SLURM cluster and ssh nodes (tests/cluster).

Every DeepSpeed launch of the suite, direct or through `longspec run`, builds its CPU ops
(the shared-memory comm op, cpu_adam: about 50 s each here) into the one folder `longspec run`
uses, so a fresh machine builds each op once.
"""

import os

from longspec_cli.launch.execute import ops_build_dir
from tests.cluster.fixtures import slurm_cluster, ssh_nodes  # noqa: F401  (pytest finds them here)

os.environ.setdefault("TORCH_EXTENSIONS_DIR", ops_build_dir())
