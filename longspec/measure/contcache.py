"""The host's cache of the target's held-out continuations (what tau while training walks,
longspec.measure.chainwalk): any run on the host reads them, so a new run folder of the same stage
does not decode them again. `<cache root>/continuations/<key>/<prompt key>.json`: the key by the
target's files and what its greedy tokens can differ with (shared_folder), one atomic file per
prompt key (chainwalk.prompt_key: its tokens, new-token limit and stops).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from longspec.measure.chainwalk import WEIGHT_SUFFIXES, VERSION, Continuation, continuation_digest, prompt_key


def shared_folder(target: Path, dtype: str, device: str, attention: str = "") -> Path:
    """Where any run on this host keeps the target's continuations, one file per prompt key: under
    longspec's cache root (files.atomic.cache_root), by the target (config, tokenizer files, weight
    files' names, sizes and modification times: weights rewritten in place are another target)
    and by what its greedy tokens can differ with: the dtype it decodes in, the device (its kind
    and, on a GPU, its name: a cache under a shared home serves nodes with other GPUs too), the
    attention implementation, and the torch and transformers versions."""
    import torch
    import transformers

    from longspec.files.atomic import cache_root

    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else ""
    h = hashlib.sha256(f"chainwalk {VERSION}\n{dtype}\n{device}\n{gpu}\n{attention}\n{torch.__version__}\n"
                       f"{transformers.__version__}\n".encode())
    h.update(continuation_digest(target, []).encode())
    if not Path(target).is_dir():                     # a hub name: nothing to read, the name tells targets apart
        h.update(str(target).encode())
    for f in sorted(Path(target).iterdir()) if Path(target).is_dir() else ():
        if f.suffix in WEIGHT_SUFFIXES:
            h.update(f"{f.name}\0{f.stat().st_mtime_ns}".encode())
    return cache_root() / "continuations" / h.hexdigest()[:32]


def read_shared(folder: Path, prompts: list, gamma: int, skip=()) -> dict[int, list[int]]:
    """{prompt index: tokens} of the prompts (but ``skip``) whose continuation the shared cache holds,
    long enough for ``gamma``; an unreadable or malformed entry is missing."""
    from longspec.runs import runfolder

    out = {}
    for i, p in enumerate(prompts):
        if i in skip:
            continue
        data, _ = runfolder.read_json(folder / f"{prompt_key(p)}.json")
        toks = data.get("tokens") if isinstance(data, dict) and data.get("version") == VERSION else None
        if isinstance(toks, list) and len(toks) >= p.max_new + gamma and all(isinstance(t, int) for t in toks):
            out[i] = toks[:p.max_new + gamma]
    return out


def write_shared(folder: Path, prompts: list, conts: dict[int, Continuation], made) -> int:
    """The continuations of the prompts in ``made`` (those this run decoded) into the shared cache,
    each file atomic; a key the cache holds already, as long and readable, is left as it is; a cache
    that cannot be written is skipped (the run goes on). How many were written."""
    from longspec.files.atomic import atomic_write_json

    n = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for i in sorted(made):
            if read_shared(folder, [prompts[i]], len(conts[i].tokens) - prompts[i].max_new):
                continue                               # held already, as long
            atomic_write_json(folder / f"{prompt_key(prompts[i])}.json",
                              {"version": VERSION, "max_new": prompts[i].max_new, "tokens": conts[i].tokens})
            n += 1
    except OSError:
        pass
    return n
