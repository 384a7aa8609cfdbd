"""Does `eval`'s longest length bucket fit on the device it decodes on? Arithmetic on the target's
config.json, nothing loaded (`longspec eval` asks before it starts `python -m longspec.evaluate`,
and longspec.evaluate asks again before it loads a weight).

One prompt is decoded at a time, so one device holds, at the bucket's length L plus the new tokens:

    weights      target + draft parameters x bytes
    KV cache     tokens x (target layers + 1 draft layer) x kv_heads x head_dim x 2 (K and V) x bytes
    prefill      one layer's transient over the prompt: tokens x (2 hidden + 3 intermediate) x bytes
                 (as longspec/machine/memory.py's phase A)
    runtime      CUDA context and allocator slack (2 GiB), or 0.5 GiB for the process on the CPU

bytes: eval's dtype (fp32 on the CPU, the stage's precision on CUDA). Available: the CPU's
MemAvailable, or the GPU's free memory. A bucket fits when its total is at most 95% of that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from longspec.machine.memory import PRECISION_BYTES, RUNTIME_BYTES, ModelSize, gib

CPU_RUNTIME_BYTES = 512 * 1024 ** 2
MIN_BUCKETS = 2
MARGIN = 0.95


@dataclass(frozen=True)
class EvalNeed:
    tokens: int
    bytes_per_value: int
    weights: int
    kv: int
    prefill: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefill + self.runtime


def need(size: ModelSize, tokens: int, nbytes: int, cuda: bool) -> EvalNeed:
    weights = (size.target_params() + size.draft_params()[0]) * nbytes
    kv = tokens * (size.layers + 1) * size.kv_heads * size.hd * 2 * nbytes
    prefill = tokens * (2 * size.hidden + 3 * size.intermediate) * nbytes
    return EvalNeed(tokens, nbytes, weights, kv, prefill, RUNTIME_BYTES if cuda else CPU_RUNTIME_BYTES)


def label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_lengths(text: str) -> list[int]:
    """'1k,4k,16k,32768' -> [1024, 4096, 16384, 32768] (ValueError for anything else)."""
    out = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"{part!r} is not a token count (e.g. 512, 1k, 32k)")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return sorted(set(out))


def default_lengths(max_seq: int) -> list[int]:
    """eval's default buckets: powers of two from 1k up to max_seq, and max_seq; halved from the
    bottom to two at least (longspec.measure.report)."""
    out, n = [], 1024
    while n < max_seq:
        out.append(n)
        n *= 2
    out.append(max_seq)
    while len(out) < MIN_BUCKETS and out[0] >= 16:
        out.insert(0, out[0] // 2)
    return out


def refusal(size: ModelSize, lengths: list[int], max_new: int, nbytes: int, available: int,
            where: str, cuda: bool) -> tuple[str, str] | None:
    """(message, hint) when the longest bucket of ``lengths`` does not fit in ``available`` bytes
    on ``where``; None when it does."""
    lengths = sorted(lengths)
    n = need(size, lengths[-1] + max_new, nbytes, cuda)
    if n.total <= MARGIN * available:
        return None
    fits = [L for L in lengths if need(size, L + max_new, nbytes, cuda).total <= MARGIN * available]
    message = (f"the {label(lengths[-1])} length bucket needs about {gib(n.total)} on {where} and "
               f"{gib(available)} is available: weights {gib(n.weights)}, KV cache {gib(n.kv)} "
               f"({n.tokens:,} tokens x {size.layers + 1} layers x {size.kv_heads} KV heads x {size.hd} x 2 x "
               f"{nbytes} bytes), prefill {gib(n.prefill)}, runtime {gib(n.runtime)}")
    if fits:
        hint = f"--lengths {','.join(label(L) for L in fits)} leaves out the buckets that do not fit"
    else:
        hint = "not even the shortest bucket fits: evaluate on a device with more memory"
    return message, hint


def cpu_available() -> int | None:
    """The memory available to a new process in bytes (psutil: MemAvailable on Linux); None when
    the platform does not say."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None


def default_max_new(max_seq: int, max_new_tokens: int | None) -> int:
    """The most tokens eval generates per prompt: --max-new-tokens, else its largest default."""
    return max_new_tokens if max_new_tokens else max(1, min(1024, max_seq // 8))
