"""One rank of a training job: who it is, what it prints, its seeds, and what it is doing.

    rank(), world_size()     from the launcher's environment (RANK, WORLD_SIZE)
    print0(...)              print on rank 0 only
    take_local_rank(argv)    DeepSpeed's --local_rank taken off the command line (Hydra rejects it)
    single_process_env()     a world of one for `python -m longspec.train` without a launcher
    seeded(*parts)           a torch.Generator from (seed, step, ...): the same draws after a resume
    progress                 the last finished step and the path being written (the failure report)
    unlink_shm_buffer()      drop the name of DeepSpeed's CPU shared-memory allreduce buffer
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

progress: dict[str, Any] = {"step": 0, "writing": None}   # the last finished step, the path being written


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args: Any) -> None:
    if rank() == 0:
        print(*args, flush=True)


def take_local_rank(argv: list[str]) -> list[str]:
    """Remove DeepSpeed's `--local_rank=N` / `--local_rank N` (Hydra would reject it); set LOCAL_RANK."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg == "--local_rank" and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def single_process_env() -> None:
    """`python -m longspec.train` without a launcher: a world of one on a free local port. A world
    set by the environment is kept, unless LONGSPEC_WORLD_OF_ONE=1 (`longspec run`'s direct one-rank
    launch: a RANK or WORLD_SIZE inherited from a surrounding job is not this run's)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get("LONGSPEC_WORLD_OF_ONE") != "1":
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = "0" if os.environ.get("LONGSPEC_WORLD_OF_ONE") == "1" else os.environ.get("LOCAL_RANK", "0")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=local,
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def seeded(*parts: int):
    """A torch.Generator seeded from (seed, step, ...): the same numbers after a resume."""
    import torch

    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


SHM_DIR = "/dev/shm"


def shm_buffer_path(rank_: int) -> str:
    """Where DeepSpeed's CPU comm op (ShareMemCommBuilder, `shm.cpp`) keeps this rank's allreduce
    buffer (about 66 MB): `deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}`.
    It exists when every rank of the job is on one machine (WORLD_SIZE == LOCAL_SIZE)."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank_}")
    return os.path.join(SHM_DIR, name)


def unlink_shm_buffer(rank_: int) -> bool:
    """Remove the name of this rank's shared-memory buffer once every local rank has mapped it (call
    after a barrier that follows `deepspeed.init_distributed`). DeepSpeed creates the buffer and
    never unlinks it, so each CPU launch left 66 MB per rank in /dev/shm (RAM) for good. The mapping
    stays valid; the memory is freed when the last rank exits, however it exits. True if removed."""
    try:
        os.unlink(shm_buffer_path(rank_))
        return True
    except FileNotFoundError:   # no shm op (GPU, several nodes, the op not built), or already gone
        return False
