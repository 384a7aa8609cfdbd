"""DeepSpeed ZeRO-3 and parameter helpers: whole parameters out of partitions, bytes held per
rank, the training dtype of a ZeRO-3 config, and telling transformers that it loads under ZeRO-3.

Plain (unpartitioned) parameters pass through every helper unchanged, so the same code runs with
and without ZeRO-3. deepspeed and transformers are imported only when a helper needs them.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def gathered(param: nn.Parameter) -> Iterator[torch.Tensor]:
    """The full parameter, also when DeepSpeed ZeRO-3 has partitioned it (read-only gather)."""
    if hasattr(param, "ds_id"):
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if param.ds_status == ZeroParamStatus.AVAILABLE:
            # Already fetched by ZeRO-3's hooks for the running forward: gathering again would
            # free it on exit while DeepSpeed still counts it as in use.
            yield param
            return
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param
    else:
        yield param


def gathered_for_update(params: list[nn.Parameter]):
    """A context in which ``params`` are whole and writable; under ZeRO-3 rank 0's values are
    broadcast and re-partitioned on exit (every rank must enter it). Plain parameters: no-op."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)


def parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole parameters). Under ZeRO-3 a rank
    holds its partition (``ds_tensor``) plus any parameter that is currently gathered."""
    held = whole = 0
    for p in module.parameters():
        part = getattr(p, "ds_tensor", None)
        held += p.numel() * p.element_size() + (0 if part is None else part.numel() * part.element_size())
        whole += getattr(p, "ds_numel", p.numel()) * p.element_size()
    return held, whole


def partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 has partitioned any of the module's parameters."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


WHOLE_SHARE = 0.6            # a whole copy is made when it needs at most this share of the free memory


def fits_whole(modules: list[nn.Module], device: torch.device) -> bool:
    """Whether whole copies of ``modules`` fit beside what this rank holds: their bytes at most
    WHOLE_SHARE of the device's free memory (the CPU: the host's available memory over the ranks
    on this host). This rank's answer; callers agree on one across ranks."""
    import os

    need = sum(parameter_bytes(m)[1] for m in modules)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
        free //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1))
    return need <= WHOLE_SHARE * free


def meta_shell(build) -> nn.Module | None:
    """``build()`` on the meta device (nothing allocated): the empty module whole_copy fills, or
    None when the module cannot be built from its config alone (then no copy is made)."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:                      # any constructor's failure means: run on the original
        return None


def whole_copy(module: nn.Module, shell: nn.Module, device: torch.device) -> nn.Module:
    """A plain, frozen copy of ``module`` on ``device`` with the same parameters and buffers, also
    when ZeRO-3 has partitioned it: ``shell`` (meta_shell) gets each parameter, gathered in turn
    (under ZeRO-3 every rank must call this, in step). Tied parameters stay tied. The copy runs
    without ZeRO-3's per-module hooks, which cost more than the arithmetic on a small or short
    forward."""
    out = shell
    sources = dict(module.named_parameters(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}
    for name, _ in list(out.named_parameters(remove_duplicate=False)):
        src = sources[name]
        if id(src) not in made:
            with gathered(src) as w:
                made[id(src)] = nn.Parameter(w.detach().to(device, copy=True), requires_grad=False)
        owner, leaf = _owner(out, name)
        setattr(owner, leaf, made[id(src)])
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for name, _ in list(out.named_buffers(remove_duplicate=False)):
        owner, leaf = _owner(out, name)
        setattr(owner, leaf, buffers[name].detach().to(device, copy=True))
    sources_m = dict(module.named_modules())
    for name, m in out.named_modules():           # plain tensor attributes (a rotary table's original)
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(m, key, getattr(sources_m[name], key).detach().to(device, copy=True))
    return out.eval()


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    for part in path:
        root = getattr(root, part)
    return root, leaf


# transformers keeps only a weak reference to the object that says "ZeRO-3" (it then loads under
# deepspeed.zero.Init); this one keeps it alive for the rest of the process.
_zero3_marker: Any = None


class _Zero3Marker:
    """What transformers' loading reads of an HfDeepSpeedConfig (``config``, ``is_zero3()``);
    stands in for it when `accelerate`, which HfDeepSpeedConfig requires, is not installed."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return True


def zero3_dtype(ds_config: dict) -> torch.dtype:
    """The dtype deepspeed.zero.Init gives parameters under this config (its bf16 / fp16 blocks)."""
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def announce_zero3(ds_config: dict) -> None:
    """Tell transformers that models load under ZeRO-3 from now on (from_pretrained then builds
    them inside deepspeed.zero.Init with this config)."""
    global _zero3_marker
    from transformers.integrations import HfDeepSpeedConfig, set_hf_deepspeed_config

    try:
        _zero3_marker = HfDeepSpeedConfig(copy.deepcopy(ds_config))
    except ImportError:                   # accelerate missing or too old
        _zero3_marker = _Zero3Marker(copy.deepcopy(ds_config))
        set_hf_deepspeed_config(_zero3_marker)


__all__ = ["gathered", "gathered_for_update", "parameter_bytes", "zero3_dtype", "announce_zero3", "partitioned",
           "fits_whole", "meta_shell", "whole_copy"]
