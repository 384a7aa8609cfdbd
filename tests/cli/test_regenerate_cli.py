"""`longspec regenerate` on a real tiny project: the child `python -m longspec.regenerate` writes the
rows, `--use` changes the stage file's train_file line and nothing else, the folder is then
prepared as the stage's data; mistakes are one panel and an exit code, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LONGSPEC = [sys.executable, "-m", "longspec_cli"]
pytest.importorskip("torch")


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*LONGSPEC, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def test_regenerate_use_then_prepare_and_refusals(tmp_path):
    proj = tmp_path / "proj"
    res = cli("init", str(proj), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    stage_file = proj / "conf" / "exp" / "longcot.yaml"
    before = stage_file.read_text().splitlines()

    res = cli("regenerate", str(proj), "longcot", "--limit", "4", "--use", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)["stages"][0]
    out = proj / "data" / "regen" / "longcot"
    assert r["complete"] and r["done"] == 4 and r["kept"] > 0 and Path(r["out"]) == out
    assert (out / "manifest.json").is_file() and list(out.glob("part-*.parquet"))
    after = stage_file.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1
    assert changed[0][1] == f"train_file: {out}" and changed[0][0].startswith("train_file:")

    res = cli("prepare", str(proj), "longcot", "--json")               # the trainer reads the folder
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["stages"][0]["records"] == r["kept"]

    # the stage's train_file is now the folder itself: it is never read while it is written
    res = cli("regenerate", str(proj), "longcot", "--force")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    words = " ".join(res.stderr.split())
    assert "is the regeneration folder itself" in words and str(proj / "assets" / "data") in words
    assert list(out.glob("part-*.parquet"))

    res = cli("regenerate", str(proj), "nosuchstage")
    assert res.returncode != 0 and "Traceback" not in res.stdout + res.stderr
    assert "nosuchstage" in res.stdout + res.stderr
