"""Anchor-offset position ids, the default offset, and the noisy cross-attention lag."""
from __future__ import annotations

import pytest
import torch

from longspec.training.positions import (
    anchor_offset_position_ids,
    default_max_offset,
    plain_position_ids,
    sample_cross_lag,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_plain_position_ids():
    pos = plain_position_ids(5, 3)
    assert pos.dtype == torch.long and pos.shape == (3, 5)
    assert pos.tolist() == [[0, 1, 2, 3, 4]] * 3


def test_anchor_offset_draws_sinks_per_sequence_and_one_offset_per_batch():
    g = gen(1)
    sinks_seen = set()
    for _ in range(60):
        pos = anchor_offset_position_ids(100, 3, anchors=4, max_offset=5000, generator=g)
        assert pos.shape == (3, 100) and pos.dtype == torch.long
        offset = int(pos[0, -1]) - 99
        assert 0 <= offset <= 5000
        row_sinks = []
        for row in pos:
            # sinks keep 0..a-1, then consecutive positions shifted by the one batch offset
            a = int((row == torch.arange(100)).sum()) if offset else None
            if a is None:
                assert torch.equal(row, torch.arange(100))
                continue
            assert 0 <= a <= 4
            assert torch.equal(row[:a], torch.arange(a))
            assert torch.equal(row[a:], torch.arange(a, 100) + offset)
            row_sinks.append(a)
        sinks_seen.update(row_sinks)
    assert sinks_seen == {0, 1, 2, 3, 4}               # every count 0..anchors occurs
    # rows of one batch do not all share their sink count
    g = gen(9)
    differ = [len({int((r == torch.arange(20)).sum()) for r in anchor_offset_position_ids(
        20, 8, anchors=4, max_offset=1000, generator=g)}) > 1 for _ in range(10)]
    assert any(differ)


def test_offsets_cover_the_whole_range():
    g = gen(2)
    seen = {int(anchor_offset_position_ids(10, 1, anchors=2, max_offset=3, generator=g)[0, 2]) - 2 for _ in range(200)}
    assert seen == {0, 1, 2, 3}


def test_offsets_are_random_across_calls_and_reproducible_with_a_generator():
    a = [int(anchor_offset_position_ids(50, 1, max_offset=30000, generator=gen(7))[0, -1]) for _ in range(3)]
    assert len(set(a)) == 1                      # same seed, same ids
    g = gen(7)
    b = {int(anchor_offset_position_ids(50, 1, max_offset=30000, generator=g)[0, -1]) for _ in range(20)}
    assert len(b) > 10                           # one generator advancing: different offsets


def test_threshold_gives_plain_positions_for_long_sequences():
    g = gen(3)
    long = anchor_offset_position_ids(1201, 2, max_offset=15000, threshold=1200, generator=g)
    assert torch.equal(long, plain_position_ids(1201, 2))
    # at the threshold itself the offset still applies
    shifted = [anchor_offset_position_ids(1200, 1, max_offset=15000, threshold=1200, generator=g)[0, -1] > 1199
               for _ in range(5)]
    assert any(shifted)


def test_zero_anchors_shift_everything():
    pos = anchor_offset_position_ids(6, 1, anchors=0, max_offset=100, generator=gen(5))
    assert torch.equal(pos[0], torch.arange(6) + pos[0, 0])


def test_default_max_offset():
    assert default_max_offset(4096) == 4096           # never past the limit
    assert default_max_offset(16384) == 15000
    assert default_max_offset(16384, seq_len=2000) == 14384
    assert default_max_offset(32768) == 30000
    assert default_max_offset(262144, seq_len=1024) == 30000
    assert default_max_offset(32768, seq_len=4000) == 28768
    assert default_max_offset(1000, seq_len=2000) == 0
    with pytest.raises(ValueError):
        default_max_offset(0)


def test_positions_with_default_offset_stay_inside_the_target_range():
    limit, T = 16384, 1024
    g = gen(6)
    for _ in range(100):
        pos = anchor_offset_position_ids(T, 1, max_offset=default_max_offset(limit, T), generator=g)
        assert int(pos.max()) < limit


def test_sample_cross_lag():
    g = gen(8)
    draws = [sample_cross_lag(4, g) for _ in range(300)]
    assert set(draws) == {1, 2, 3, 4}
    assert sample_cross_lag(0, g) == 0
    assert {sample_cross_lag(1, g) for _ in range(10)} == {1}


@pytest.mark.parametrize("kwargs", [dict(anchors=-1), dict(max_offset=-1)])
def test_bad_arguments_raise(kwargs):
    args = dict(anchors=4, max_offset=10) | kwargs
    with pytest.raises(ValueError):
        anchor_offset_position_ids(10, 1, **args)
    with pytest.raises(ValueError):
        sample_cross_lag(-1)
    with pytest.raises(ValueError):
        plain_position_ids(0, 1)
