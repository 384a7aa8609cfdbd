"""`longspec doctor`: the real probe (`python -m longspec.doctor`) on this machine, through the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.needs import module

module("deepspeed")              # the probe runs the trainer side


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longspec_cli", "doctor", *args], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def report() -> dict:
    run = doctor("--json", env={"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_it_reports_every_part_a_stage_needs_with_the_kernels_chosen(report):
    names = [c["name"] for c in report["checks"]]
    for want in ("torch", "deepspeed", "arch list", "flash-attn", "liger-kernel", "kernels", "disk", "memory"):
        assert want in names, names
    assert all(c["status"] in ("ok", "warn", "fail", "info") for c in report["checks"])
    kernels = next(c for c in report["checks"] if c["name"] == "kernels")
    assert "attention" in kernels["detail"] and "linear_cross_entropy" in kernels["detail"]
    assert report["ok"] is True and report["failed"] == []


def test_an_arch_list_deepspeed_cannot_parse_is_named_with_its_fix(report):
    arch = next(c for c in report["checks"] if c["name"] == "arch list")
    assert arch["status"] == "warn" and "9.0a" in arch["detail"] and "8.0;9.0" in arch["fix"]


def test_the_table_and_a_missing_folder_for_the_disk_check(tmp_path):
    run = doctor("--dir", str(tmp_path / "not" / "yet"))
    assert run.returncode == 0, run.stderr
    words = " ".join(run.stdout.split())
    assert "deepspeed" in words and "GiB free under" in words
