"""The training command line: `deepspeed <launcher flags> --module longspec.train --config-dir ...`.

One builder for both places that write it: `run` (launch/argv.py adds the placement's flags and
resolves the paths) and `init` (the command comment at the top of every stage file).
"""

from __future__ import annotations

import os
import shlex

TRAINER_MODULE = "longspec.train"


def trainer_args(conf_dir: str | os.PathLike, stage: str, output_dir: str | os.PathLike,
                 overrides: list[str] = (), module: str = TRAINER_MODULE) -> list[str]:
    """What follows the launcher flags: the module and its Hydra arguments."""
    return ["--module", module, "--config-dir", str(conf_dir), f"+exp={stage}", f"output_dir={output_dir}",
            *overrides]


def deepspeed_line(gpus: int, conf_dir: str | os.PathLike, stage: str, output_dir: str | os.PathLike) -> str:
    """The one-node command as a user types it (shell-quoted)."""
    return shlex.join(["deepspeed", f"--num_gpus={gpus}", *trainer_args(conf_dir, stage, output_dir)])
