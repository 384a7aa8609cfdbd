"""The trainer's collectives (longspec/model/comm.py): one owner, tensors on the backend's device.

NCCL refuses a CPU tensor ("No backend type associated with device type cpu") where gloo takes it,
so a collective called straight on a CPU-made tensor passes every CPU test and fails at the first
GPU step. Four such calls once reached an H200 (the loop's step sums, tau's resume flag, its
prepare flags and its counts). Only comm.py calls torch.distributed's collectives now; the AST
check below finds any call elsewhere, however it is spelled.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longspec.model import comm

ROOT = Path(__file__).resolve().parents[2] / "longspec"
OWNER = ROOT / "model" / "comm.py"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def direct_collectives(source: str) -> list[str]:
    """`name (line N)` for each torch.distributed collective called or imported in ``source``."""
    tree = ast.parse(source)
    aliases = {"torch.distributed", "dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed", "deepspeed.comm"):
            found += [f"{a.name} (line {node.lineno})" for a in node.names if a.name in COLLECTIVES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            base = _dotted(node.func.value)
            if base in aliases or base.endswith(("distributed", "deepspeed.comm")):
                found.append(f"{base}.{node.func.attr} (line {node.lineno})")
    return found


def test_only_comm_calls_torch_distributed_collectives():
    offenders = {str(p.relative_to(ROOT)): hits for p in sorted(ROOT.rglob("*.py")) if p != OWNER
                 for hits in [direct_collectives(p.read_text(encoding="utf-8"))] if hits}
    assert not offenders, f"call longspec.model.comm instead: {offenders}"


@pytest.mark.parametrize("source", [
    "import torch\ndef f(x):\n    torch.distributed.all_reduce(x)\n",
    "import torch.distributed as d\nd.broadcast_object_list([1], src=0)\n",
    "from torch.distributed import all_gather_object\n",
    "import torch.distributed as dist\ndist.all_reduce(t, op=dist.ReduceOp.MIN)\n",
])
def test_the_check_sees_each_spelling_of_a_direct_call(source):
    assert direct_collectives(source)


def test_the_device_each_backend_takes():
    gpu = torch.device("cuda", 3)
    assert comm.comm_device("nccl", gpu) == gpu
    assert comm.comm_device("gloo", gpu).type == "cpu"
    assert comm.comm_device("cpu:gloo,cuda:nccl", gpu).type == "cpu"
    assert comm.comm_device("cuda:nccl", gpu) == gpu


def test_on_a_real_gloo_group_results_come_back_where_the_tensor_lives(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        t = torch.tensor([3.0, 1.0], dtype=torch.float64)
        out = comm.all_reduce(t)
        assert out.device == t.device and out.dtype == t.dtype and out.tolist() == [3.0, 1.0]
        assert out.data_ptr() != t.data_ptr()              # the input is never written
        assert comm.all_reduce(torch.tensor([2, 5]), op="min").tolist() == [2, 5]
        assert comm.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
        assert comm.all_gather_object(("r0", 7)) == [("r0", 7)]
    finally:
        dist.destroy_process_group()
