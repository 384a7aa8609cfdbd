"""`longspec prepare` on a real tiny project, then what status and validate say about the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGSPEC = [sys.executable, "-m", "longspec_cli"]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*LONGSPEC, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def prepared(proj: Path, stage: str) -> dict:
    res = cli("status", str(proj), "--json")
    assert res.returncode == 0, res.stderr
    return next(s["prepared"] for s in json.loads(res.stdout)["stages"] if s["name"] == stage)


def test_prepare_then_status_validate_and_a_changed_or_bad_train_file(tmp_path):
    proj = tmp_path / "proj"
    res = cli("init", str(proj), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert prepared(proj, "base")["state"] == "missing"

    res = cli("prepare", str(proj), "base", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)["stages"][0]
    assert r["built"] and r["records"] == 2500 and r["tokens"] >= r["trained_tokens"] > 0
    assert "records 2,500" in res.stderr and "█" in res.stderr and "one epoch =" in res.stderr  # summary, histogram
    st = prepared(proj, "base")
    assert st["state"] == "ready" and st["tokens"] == r["tokens"]
    assert st["epochs"] == r["epochs"] and st["steps_per_epoch"] == r["steps_per_epoch"]
    assert "train_file prepared: 2,500 records" in cli("validate", str(proj)).stdout
    once = cli("monitor", str(proj), "--once", "--json")
    assert json.loads(once.stdout)["stages"][0]["prepared"]["tokens"] == r["tokens"]
    assert "base: data ready" in cli("monitor", str(proj), "--once").stdout

    data = proj / "assets" / "data" / "base.jsonl"
    with data.open("a") as f:
        f.write('{"text": "a record added after preparing"}\n')
    st = prepared(proj, "base")
    assert st["state"] == "stale" and "base.jsonl changed" in st["reason"]
    assert "data stale: base.jsonl changed" in cli("status", str(proj)).stdout

    with data.open("a") as f:
        f.write('{"txet": "misspelt"}\n')
    res = cli("prepare", str(proj), "base")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "base.jsonl:2502: missing field 'text'" in " ".join(res.stderr.split())
    assert prepared(proj, "base")["state"] == "stale"                  # the old cache is not replaced
