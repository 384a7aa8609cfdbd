"""Shared fixtures for the TUI tests: contract-true projects (tests/tui/fixtures.py), a fixed
system sample, a fixed clock, and a stand-in `longspec` executable that records its argv."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from pathlib import Path

import pytest

from longspec_cli.tui.sysinfo import FixedSampler, SysSample
from tests.tui import fixtures as F

# The clock of a monitor in a snapshot: the moment of the running stage's last record (no stall).
RUNNING_CLOCK = F.T0 + 1e5 + 120 * F.STEP_S

RECORDER = """\
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
"""


@pytest.fixture
def sampler():
    return FixedSampler(SysSample(host="node-a", source="psutil", cpu_percent=12.5, ram_used=8 << 30,
                                  ram_total=32 << 30))


@pytest.fixture
def running(tmp_path) -> Path:
    """demo: base done, long running at step 120/400 (this test process stands in for the trainer)."""
    return F.pipeline(tmp_path / "demo", done=("base",), running="long")


@pytest.fixture
def base_done(tmp_path) -> Path:
    """demo: base done, long not chained and never run."""
    return F.pipeline(tmp_path / "demo", done=("base",))


@pytest.fixture
def fresh(tmp_path) -> Path:
    """demo: scaffolded, no run folder at all."""
    return F.make_project(tmp_path / "demo")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests (Pilot) in a fresh event loop; no async plugin needed."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None


class Recorder:
    """A stand-in for the `longspec` command: appends each argv to a file."""

    def __init__(self, folder: Path):
        self.script = folder / "fake_longspec.py"
        self.script.write_text(RECORDER)
        self.out = folder / "calls.jsonl"

    @property
    def cli(self) -> list[str]:
        return [sys.executable, str(self.script), str(self.out)]

    def calls(self) -> list[list[str]]:
        if not self.out.exists():
            return []
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]


@pytest.fixture
def recorder(tmp_path) -> Recorder:
    return Recorder(tmp_path)
