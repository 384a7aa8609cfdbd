"""bench/gpu_check.sh is ready for the first GPU: the shell part parses, the Python part runs on a
CPU in its dry-run mode and writes the JSON the GPU run will write."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_shell_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    proc = subprocess.run([bash, "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_step_benchmark_dry_run_writes_the_report(tmp_path):
    """The step through the trainer's own DeepSpeed engine (its own process: it starts torch.distributed)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "step.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--seq", "48", "--steps", "2", "--warmup", "0"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["kernels"] == {"attention": "sdpa", "linear_cross_entropy": "chunked"}
    assert rep["optimizer"] == "deepspeed" and rep["zero_optimization"]["stage"] == 1
    (r,) = rep["results"]
    assert r["seq_len"] == 48 and r["tokens_per_s"] > 0 and r["finite"]
    assert r["estimate_bytes"] > 0                    # the preflight's estimate for the same shape
    # the real run's shape is Qwen2.5-7B's
    assert mod.QWEN25_7B["num_hidden_layers"] == 28 and mod.QWEN25_7B["hidden_size"] == 3584
