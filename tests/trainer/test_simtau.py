"""Simulated tau (longspec.simtau): the held-out choice, the sampler that never draws it, the
chain formula, and the per-lag agreement counts on a real tiny GLIDE model (fast, no DeepSpeed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longspec import simtau
from longspec.data import make_loader
from tests.trainer.conftest import make_tiny_target


def flat(lengths: list[int]):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = (np.arange(offsets[-1]) % 90 + 3).astype(np.uint16)
    return offsets, tokens


def test_chain_tau_is_one_plus_the_sum_of_running_products():
    assert simtau.chain_tau([]) == 1.0
    assert simtau.chain_tau([1.0, 1.0, 1.0, 1.0]) == 5.0
    assert simtau.chain_tau([0.0, 1.0]) == 1.0
    assert simtau.chain_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_heldout_is_the_tail_up_to_the_token_cap_and_at_most_half_the_records():
    offsets, tokens = flat([100] * 50)
    h = simtau.choose_heldout(offsets, tokens, 450)
    assert (h.start, h.records, h.lengths, h.tokens) == (45, 5, (50, 100, 100, 100, 100), 450)
    # the same data and cap give the same set (and digest); another cap another one
    assert simtau.choose_heldout(offsets, tokens, 450) == h
    assert simtau.choose_heldout(offsets, tokens, 300).sha256 != h.sha256
    # never more than half of the records, whatever the cap
    big = simtau.choose_heldout(offsets, tokens, 10**9)
    assert big.start == 25 and big.records == 25
    assert simtau.choose_heldout(offsets, tokens, 0) is None
    assert simtau.choose_heldout(*flat([100]), 450) is None
    # a token change inside the held-out records changes the digest (a resume would be refused)
    tokens2 = tokens.copy()
    tokens2[-1] += 1
    assert simtau.choose_heldout(offsets, tokens2, 450).sha256 != h.sha256


class _Records(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.tensor([i + 1, i + 2])
        return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_trainers_sampler_never_draws_a_heldout_record(world):
    part = simtau.TrainPart(_Records(40), 32)
    seen = set()
    for rank in range(world):
        for epoch in range(3):
            for batch in make_loader(part, 4, seed=7, rank=rank, world_size=world, pad_token_id=0, epoch=epoch):
                seen.update((batch["input_ids"][:, 0] - 1).tolist())
    assert seen == set(range(32))
    with pytest.raises(IndexError):
        part[32]


def tiny_glide(seed: int = 0):
    from longspec.model import build_glide

    torch.manual_seed(seed)
    return build_glide(make_tiny_target("qwen2"), sliding_window=16, dtype=torch.float32).eval()


def test_agreement_counts_do_not_depend_on_batching_or_padding():
    model = tiny_glide()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 90, (n,), generator=g) for n in (40, 23, 31)]
    one = [(r.unsqueeze(0), torch.tensor([len(r)])) for r in rows]
    ids = torch.zeros(3, 40, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    padded = [(ids, torch.tensor([len(r) for r in rows]))]
    a = simtau.agreement_counts(model, one, 4, torch.device("cpu"))
    b = simtau.agreement_counts(model, padded, 4, torch.device("cpu"))
    assert torch.equal(a, b)
    assert a[1].tolist() == [float(sum(len(r) - 4 for r in rows))] * 4
    # a stand-in row (counted length 0) runs the forwards but counts nothing
    assert simtau.agreement_counts(model, [(ids, torch.zeros(3, dtype=torch.long))], 4,
                                   torch.device("cpu")).sum() == 0


def test_agreement_is_what_the_draft_and_target_predict_at_each_lag():
    """alpha_k against a direct reading: the target's greedy token at t, and the draft's with the
    cross-attention lagged by k (keys up to t - k), at the positions t >= gamma."""
    model = tiny_glide(3)
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(30).unsqueeze(0)
    counts = simtau.agreement_counts(model, [(ids, torch.tensor([30]))], 3, torch.device("cpu"))
    with torch.no_grad():
        logits = model.target.model(ids).logits[0]                      # (T, V): the HF model itself
        want = logits.argmax(-1)[3:]
        tgt = model.target(ids, pos)
        hidden = model.target.embed(ids)
        rope = model.target.rotary(pos, hidden)
        for k in (1, 2, 3):
            h = model.draft(hidden, pos, tgt.k, tgt.v, cross_lag=k, rope=rope)
            got = model.target.lm_head(h)[0].argmax(-1)[3:]
            assert counts[0, k - 1].item() == float((got == want).sum()) and counts[1, k - 1].item() == 27.0


def test_the_shared_lag_forward_equals_one_draft_call_per_lag():
    model = tiny_glide(4)
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        tgt = model.target(ids, pos, attention_mask=mask)
        hidden = model.target.embed(ids)
        rope = model.target.rotary(pos, hidden)
        shared = simtau.draft_all_lags(model.draft, hidden, tgt.k, tgt.v, rope, mask, 3)
        for k, h in enumerate(shared, 1):
            one = model.draft(hidden, pos, tgt.k, tgt.v, cross_lag=k, rope=rope, attention_mask=mask)
            torch.testing.assert_close(h, one, rtol=1e-5, atol=1e-5)
