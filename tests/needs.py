"""What a test needs of the machine beyond Python: root, mount(8), the cluster's programs.

    unavailable(why)          skip with the reason; under LONGSPEC_REQUIRE_CLUSTER=1 (CI, as root,
                              with tests/cluster/install.sh run) fail instead, so a test that CI can
                              run never passes there by skipping
    small_disk(folder, size)  `folder` as a small tmpfs for a while: a disk that fills up
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REQUIRE = os.environ.get("LONGSPEC_REQUIRE_CLUSTER", "") not in ("", "0")


def unavailable(why: str) -> None:
    if REQUIRE:
        pytest.fail(f"LONGSPEC_REQUIRE_CLUSTER=1 but {why}", pytrace=False)
    pytest.skip(why)


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """`folder` as a tmpfs of `size` for the duration."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        unavailable("mounting a small tmpfs (mount -t tmpfs -o size=...) needs root and mount")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def module(name: str):
    """The installed module `name`, or unavailable (the trainer's extra: pip install -e '.[train]')."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        unavailable(f"{name} cannot be imported ({e}); make test installs the train extra")
