"""TORCH_CUDA_ARCH_LIST as DeepSpeed's own op builders parse it (longspec/machine/cudaarch.py).

Many Hopper images set `9.0a`; DeepSpeed 0.19.8 fails on it in every op it compiles. The check
is DeepSpeed's real parser (FusedAdamBuilder.compute_capability_args, JIT mode, no GPU needed),
in a fresh process with the image's value in its environment.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longspec.machine import cudaarch

ROOT = Path(__file__).resolve().parents[2]

PARSE = """
import sys
{fix}
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
b = FusedAdamBuilder(); b.jit_mode = True
try:
    b.compute_capability_args()
except ValueError as e:
    print("refused:", e); sys.exit(1)
import os; print("parsed:", os.environ["TORCH_CUDA_ARCH_LIST"])
"""


def parse_in_deepspeed(value: str, fix: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": value, "DS_ACCELERATOR": "cpu"}
    code = PARSE.format(fix="from longspec.machine import cudaarch; cudaarch.fix_environ()" if fix else "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("value,want", [
    ("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("10.0f 12.0a", "10.0;12.0"),
    ("9.0 9.0a", "9.0"), ("8.6", "8.6"), ("7.5;8.0+PTX", "7.5;8.0+PTX"),
])
def test_suffixes_go_and_architectures_stay(value, want):
    assert cudaarch.deepspeed_arch_list(value) == want


def test_fix_environ_says_what_it_changed_and_leaves_a_good_list_alone():
    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    note = cudaarch.fix_environ(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0" and "9.0a" in note
    good = {"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}
    assert cudaarch.fix_environ(good) is None and good["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert cudaarch.fix_environ({}) is None


def test_deepspeed_refuses_the_image_value_and_parses_the_fixed_one():
    raw = parse_in_deepspeed("8.0;9.0a", fix=False)
    assert raw.returncode == 1 and "invalid literal for int()" in raw.stdout, raw.stdout + raw.stderr
    fixed = parse_in_deepspeed("8.0;9.0a", fix=True)
    assert fixed.returncode == 0 and "parsed: 8.0;9.0+PTX" in fixed.stdout, fixed.stdout + fixed.stderr


@pytest.mark.parametrize("module,func", [("longspec/training/loop.py", "main"), ("longspec/evaluate.py", "main"),
                                         ("longspec/regenerate.py", "main"), ("longspec/prepare.py", "main")])
def test_each_process_that_may_build_an_op_fixes_its_environment_first(module, func):
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func)
    calls = [n for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "fix_environ"]
    assert calls, f"{module}:{func}() does not call cudaarch.fix_environ()"
