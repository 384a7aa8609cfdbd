"""The trainer's collectives: every tensor and object exchanged between ranks goes through here.

NCCL takes CUDA tensors only, gloo takes CPU tensors (and CUDA ones on CUDA builds). The trainer
makes its small bookkeeping tensors (loss sums, flags, tau counts) on the CPU, so each collective
here moves its tensor to the device the process group's backend takes, runs there, and returns the
result on the tensor's own device. Nothing else in `longspec/` calls a `torch.distributed` tensor
collective (tests/trainer/test_comm.py holds this).

    init(backend)                      the process group, with this rank's GPU bound (device_id)
    bound_device()                     the device this rank's collectives run on
    comm_device(backend, bound)        which device a backend's collectives take (pure)
    all_reduce(t, op="sum", group)     the reduced tensor, on t's device (t is not changed)
    broadcast_object(obj, src)         rank src's object on every rank
    all_gather_object(obj)             every rank's object, in rank order

Object collectives pickle through a tensor on the current CUDA device under NCCL: `init` sets it
to this rank's GPU first, so they never all land on cuda:0.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_bound: dict[str, torch.device] = {"device": torch.device("cpu")}


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init(backend: str) -> torch.device:
    """Start the default process group (when nobody has) on ``backend``, with this rank's device
    bound: on CUDA, ``torch.cuda.set_device`` and ``device_id`` (NCCL connects at init, one GPU as
    on many; barriers and object collectives know their GPU). DeepSpeed's `init_distributed` then
    adopts the group. Returns the bound device."""
    device = torch.device("cpu")
    if backend != "gloo" and torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    _bound["device"] = device
    # Launched ranks (RANK set) with a GPU: the group is made here, bound. Elsewhere DeepSpeed's own
    # init_distributed makes it as before (gloo on CPU, MPI discovery without a launcher).
    if device.type == "cuda" and "RANK" in os.environ and not dist.is_initialized():
        from datetime import timedelta

        minutes = int(os.environ.get("LONGSPEC_PG_TIMEOUT_MIN", "30"))   # DeepSpeed's default
        dist.init_process_group(backend, device_id=device, timeout=timedelta(minutes=minutes))
    return device


def bound_device() -> torch.device:
    return _bound["device"]


def comm_device(backend: str, bound: torch.device) -> torch.device:
    """The device a backend's tensor collectives take: CPU for gloo and MPI (and a per-device
    mapping such as 'cpu:gloo,cuda:nccl' that names cpu), else the rank's bound device (NCCL)."""
    parts = {p.split(":", 1)[0]: p.split(":", 1)[-1] for p in backend.lower().split(",")}
    if "cpu" in parts or (len(parts) == 1 and next(iter(parts.values())) in ("gloo", "mpi", "ccl")):
        return torch.device("cpu")
    return bound


def _device(group) -> torch.device:
    return comm_device(str(dist.get_backend(group)), _bound["device"])


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The reduction of ``t`` over ``group`` (default: every rank), on ``t``'s device."""
    work = t.detach().to(_device(group), copy=True)
    dist.all_reduce(work, op=OPS[op], group=group)
    return work.to(t.device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device(None))
    return box[0]


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj``, in rank order."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
