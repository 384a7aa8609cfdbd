"""Position ids and cross-attention lag for GLIDE training.

Anchor offset ("sink + offset", LongSpec sec. 3.3): short training sequences are given position ids
far out in the target's range so a draft trained on 1k-token text has seen the large positions it
meets at inference; the first a tokens (a drawn per sequence from 0..anchors) keep positions
0..a-1 so they act as attention sinks, as real long prompts have them.
"""
from __future__ import annotations

import torch

SHORT_LIMIT = 16384           # targets whose position limit is at most this get the smaller offset
SHORT_OFFSET = 15000
LONG_OFFSET = 30000


def plain_position_ids(seq_len: int, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, T) long: 0..T-1 on every row."""
    _check_positive(seq_len=seq_len, batch=batch)
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len).contiguous()


def default_max_offset(target_max_positions: int, seq_len: int = 0) -> int:
    """15000 for position limits <= 16384, else 30000; never more than limit - seq_len (>= 0)."""
    if target_max_positions <= 0:
        raise ValueError(f"target_max_positions must be > 0 (got {target_max_positions})")
    base = SHORT_OFFSET if target_max_positions <= SHORT_LIMIT else LONG_OFFSET
    return max(0, min(base, target_max_positions - seq_len))


def anchor_offset_position_ids(
    seq_len: int,
    batch: int,
    *,
    anchors: int = 4,
    max_offset: int,
    threshold: int = 1200,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(B, T) long: row b keeps positions 0..a_b-1, then a_b+o, a_b+1+o, ...

    The sink count a_b ~ U{0..anchors} is drawn for every sequence (the reference trainer draws
    it per forward with one sequence per GPU); the offset o ~ U{0..max_offset} is one per batch.
    Sequences longer than ``threshold`` get plain positions.
    """
    _check_positive(seq_len=seq_len, batch=batch)
    if anchors < 0 or max_offset < 0:
        raise ValueError(f"anchors and max_offset must be >= 0 (got anchors={anchors}, max_offset={max_offset})")
    pos = plain_position_ids(seq_len, batch, device)
    if seq_len > threshold or max_offset == 0:
        return pos
    offset = int(torch.randint(0, max_offset + 1, (1,), generator=generator))
    sinks = torch.randint(0, anchors + 1, (batch, 1), generator=generator).to(pos.device)  # (B, 1)
    pos += torch.where(pos >= sinks, offset, 0)
    return pos


def sample_cross_lag(max_lag: int, generator: torch.Generator | None = None) -> int:
    """j ~ U{1..max_lag} for one forward; 0 when max_lag == 0 (noise disabled)."""
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0 (got {max_lag})")
    if max_lag == 0:
        return 0
    return int(torch.randint(1, max_lag + 1, (1,), generator=generator))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0 (got {value})")
