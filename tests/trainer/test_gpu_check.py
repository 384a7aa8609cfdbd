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


@pytest.mark.parametrize("zero", [1, 3])
def test_step_benchmark_dry_run_measures_the_estimate_against_the_real_engine(tmp_path, zero):
    """The step through the trainer's own DeepSpeed engine (its own process: it starts
    torch.distributed) on a one-layer Qwen2.5-0.5B-shaped target in bf16, as on a GPU, under ZeRO-1
    (the base stage) and ZeRO-3 (the long ones): the live tensors' peak (hostmem.TensorPeak) within
    15% of the preflight's estimate at two lengths, and DeepSpeed's reduce bucket sized to the
    draft (its default, 5e8 elements, is allocated whatever the model: 1 GB in bf16, 60x this
    draft's gradients)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "step.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--target", "qwen2.5-0.5b", "--layers", "1", "--precision", "bf16", "--zero", str(zero),
                           "--seq", "256", "1024", "--steps", "1", "--warmup", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["kernels"] == {"attention": "sdpa", "linear_cross_entropy": "chunked"}
    assert rep["optimizer"] == "deepspeed" and rep["zero_optimization"]["stage"] == zero
    assert rep["engine_reduce_bucket_size"] == rep["draft_trainable_params"]
    assert [r["seq_len"] for r in rep["results"]] == [256, 1024]
    for r in rep["results"]:
        assert r["tokens_per_s"] > 0 and r["finite"]
        assert 0.85 <= r["measured_over_estimate"] <= 1.15, r
    # the real run's shape is Qwen2.5-7B's
    assert mod.QWEN25_7B["num_hidden_layers"] == 28 and mod.QWEN25_7B["hidden_size"] == 3584


def test_tensor_peak_counts_live_storages():
    """hostmem.TensorPeak: what was live at the start, each new storage from its op to its release."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import hostmem

    w = torch.ones(256, 1024)                         # 1 MiB, live before
    with hostmem.TensorPeak() as tp:
        a = torch.ones(512, 1024)                     # 2 MiB
        b = a * 2                                     # 2 MiB: 5 live
        del a
        c = b @ w.T                                   # 0.5 MiB: 3.5 live
        del b, c
        d = torch.ones(256, 1024)                     # 1 MiB: 2 live
    assert tp.base >= w.numel() * 4
    assert tp.peak - tp.base == 4 * 1024 * 1024
    assert tp.live - tp.base == 1024 * 1024 and d.sum() > 0
