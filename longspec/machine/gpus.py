"""The GPUs this process may use, as nvidia-smi lists them: one subprocess, no CUDA context.

Read by `run` (how many ranks a node takes), `eval` (the free memory of the GPU it decodes on) and
`longspec doctor` (each GPU's free memory; torch would open a context on every GPU to say it).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

MIB = 1024 ** 2
# Dense bf16 tensor-core rates (TFLOP/s, without sparsity) from NVIDIA's data sheets, matched in order
# against nvidia-smi's name as whole words (the more specific names first; `RTX A1000` is no A100):
# what `init` prices a GPU step with.
LISTED_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H800 PCIe", 756.0),
                      ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GB200", 2500.0),
                      ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0))


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    memory_mib: int
    free_mib: int | None = None       # None: nvidia-smi did not say


def listed_bf16_tflops(name: str) -> float | None:
    """The data sheet's dense bf16 rate of a GPU by its nvidia-smi name; None for one not listed."""
    return next((rate for key, rate in LISTED_BF16_TFLOPS
                 if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.I)), None)


def detect_gpus(env: dict[str, str] | None = None, timeout: float = 10.0) -> list[Gpu]:
    """nvidia-smi's GPUs, filtered and ordered by CUDA_VISIBLE_DEVICES (indices or UUIDs).

    An empty CUDA_VISIBLE_DEVICES (or -1), no nvidia-smi, or a failing nvidia-smi mean no GPU.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            free = int(float(parts[4])) if len(parts) > 4 else None
            rows.append((parts[0], parts[1], parts[2], int(float(parts[3])), free))
        except ValueError:
            continue
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for w in wanted for r in rows if w in (r[0], r[1])]
    return [Gpu(index=r[0], name=r[2], memory_mib=r[3], free_mib=r[4]) for r in rows]
