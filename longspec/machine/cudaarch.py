"""`TORCH_CUDA_ARCH_LIST` in a form DeepSpeed's op builders can parse.

Hopper and Blackwell images often set arch-specific entries (`9.0a`, `10.0a`, `12.0f`). torch's own
extension builder takes them; DeepSpeed 0.19.8 reads each entry's minor part with `int()`, so every
op it compiles (FusedAdam, cpu_adam under offload, ZeRO++ quantizers, aio) fails with
`invalid literal for int() with base 10: '0a'` (DeepSpeed issue 7589). Every longspec process that
may build a DeepSpeed op (`python -m longspec.train` ranks, evaluate, regenerate, export, ...)
calls `fix_environ()` first: the suffix goes, the architecture stays (`9.0a` -> `9.0`, `+PTX` kept).

Pure: no torch, no deepspeed.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

VAR = "TORCH_CUDA_ARCH_LIST"
_ENTRY = re.compile(r"^(\d+)\.(\d+)([a-z]*)(\+PTX)?$", re.IGNORECASE)


def deepspeed_arch_list(value: str) -> str:
    """``value`` with each entry DeepSpeed cannot parse made plain: '9.0a' -> '9.0',
    '8.0;9.0a+PTX' -> '8.0;9.0+PTX', '10.0f 12.0a' -> '10.0;12.0'. Duplicates made by the change
    go; an entry that is no architecture at all is left for DeepSpeed to refuse in its own words."""
    out: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        m = _ENTRY.match(entry)
        if m:
            entry = f"{m.group(1)}.{m.group(2)}{m.group(4) or ''}"
        if entry not in out:
            out.append(entry)
    return ";".join(out)


def fix_environ(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST`` in ``environ`` (default: this process's) when DeepSpeed
    could not parse it. Returns a one-line note saying what changed, None when nothing did."""
    env = os.environ if environ is None else environ
    value = env.get(VAR)
    if not value:
        return None
    fixed = deepspeed_arch_list(value)
    if fixed == ";".join(e for e in value.replace(" ", ";").split(";") if e.strip()):
        return None
    env[VAR] = fixed
    return f"{VAR}={value!r} -> {fixed!r} (DeepSpeed's op builders parse no arch suffix)"
