"""Tau while training (longspec.training.simtau, longspec.measure.chainwalk): the held-out choice, the sampler that
never draws it, the shared-lag draft forward, and the chain walk against eval's own greedy chain
decoding on a real tiny GLIDE model (fast, no DeepSpeed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longspec.measure import chainwalk
from longspec.training import simtau
from longspec.data.encoding import make_loader
from tests.trainer.conftest import make_tiny_target


def flat(lengths: list[int]):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = (np.arange(offsets[-1]) % 90 + 3).astype(np.uint16)
    return offsets, tokens


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
    from longspec.model.glide import build_glide

    torch.manual_seed(seed)
    return build_glide(make_tiny_target("qwen2"), sliding_window=16, dtype=torch.float32).eval()


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
        shared = chainwalk.draft_all_lags(model.draft, hidden, tgt.k, tgt.v, rope, mask, 3)
        for k, h in enumerate(shared, 1):
            one = model.draft(hidden, pos, tgt.k, tgt.v, cross_lag=k, rope=rope, attention_mask=mask)
            torch.testing.assert_close(h, one, rtol=1e-5, atol=1e-5)
        # from a later position (the earlier ones only keys, the window reaching before it): the same rows
        tail = chainwalk.draft_all_lags(model.draft, hidden, tgt.k, tgt.v, rope, mask, 3, start=9)
        for h, t in zip(shared, tail):
            torch.testing.assert_close(t, h[:, 9:], rtol=1e-5, atol=1e-5)


def walk_draft():
    """A tiny GLIDE whose draft agrees with the target often enough for blocks of every size."""
    model = tiny_glide(0)
    with torch.no_grad():
        for name, p in model.draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.3)
    return model


def walk_prompts():
    from longspec.measure.prompts import Prompt

    g = torch.Generator().manual_seed(1)
    out = [Prompt(torch.randint(3, 90, (n,), generator=g).tolist(), f"r{i}", "document", max_new=m, stops=(30,))
           for i, (n, m) in enumerate([(20, 24), (40, 24), (33, 16), (40, 24)])]   # two of one length: one batch
    for p in out:
        p.bucket = 32 if len(p.ids) <= 32 else 64
    return out


def chain_walk_tau(model, prompts, gamma=4, batch=2):
    from longspec.measure import chainwalk

    cpu = torch.device("cpu")
    toks = chainwalk.generate(model.target.model, prompts, gamma, cpu)
    conts = {i: chainwalk.Continuation(toks[i], chainwalk.stop_end(toks[i], p.max_new, p.stops))
             for i, p in enumerate(prompts)}
    counts = chainwalk.chain_counts(model, prompts, conts, [32, 64], gamma, cpu, batch=batch)
    return chainwalk.figures(counts, [32, 64], prompts, gamma), conts


def test_the_chain_walk_is_evals_greedy_chain_tau():
    """The walk over the target's greedy continuation and the draft's teacher-forced lags gives,
    block for block, what eval's greedy chain decoding (evalmeasure.decoder) gives on the same
    prompts; and it fails to when the stop rule, the limit or the prompts drift apart."""
    from longspec.measure.perprompt import decoder

    model, prompts = walk_draft(), walk_prompts()
    fig, conts = chain_walk_tau(model, prompts)
    chain = decoder(model.target.model, model.target, method="chain", gamma=4, tree_shape=None, temperature=0)
    tok = blocks = 0
    by = {32: [0, 0], 64: [0, 0]}
    for i, p in enumerate(prompts):
        r = chain(model.draft, torch.tensor([p.ids]), None, p.max_new, p.stops)
        assert r.tokens == conts[i].tokens[:conts[i].end]          # the continuation is eval's greedy output
        tok, blocks = tok + sum(r.accepted), blocks + len(r.accepted)
        by[p.bucket][0] += sum(r.accepted)
        by[p.bucket][1] += len(r.accepted)
    assert 1.1 < fig["tau"] < 4 and fig["blocks"] == blocks         # a draft that both accepts and misses
    assert fig["tau"] == round(tok / blocks, 4)
    assert [b["tau"] for b in fig["by_length"]] == [round(by[n][0] / by[n][1], 4) for n in (32, 64)]
    assert fig["alpha"][0] > 0
    assert any(conts[i].end < p.max_new for i, p in enumerate(prompts))   # a stop token ended one of them
    # drift: another stop rule, another limit, other prompts each give another figure
    for change in ({"stops": ()}, {"max_new": 12}):
        other = walk_prompts()
        for p in other:
            for k, v in change.items():
                setattr(p, k, v)
        assert chain_walk_tau(model, other)[0]["tau"] != fig["tau"], change
    assert chain_walk_tau(model, walk_prompts()[:3])[0]["tau"] != fig["tau"]
    # batching and stand-in rows change nothing: nor does decoding one prompt per batch, unpadded
    assert chain_walk_tau(model, prompts, batch=3)[0] == fig
    # the target's outputs kept between evaluations: a changed draft counts as without them
    cpu, memo = torch.device("cpu"), {}
    chainwalk.chain_counts(model, prompts, conts, [32, 64], 4, cpu, batch=2, memo=memo)
    assert memo["keep"] and sorted(k for k in memo if k != "keep") == [0, 2]
    with torch.no_grad():
        model.draft.mlp.down_proj.weight.mul_(2.0)
    fresh = chainwalk.chain_counts(model, prompts, conts, [32, 64], 4, cpu, batch=2)
    assert torch.equal(chainwalk.chain_counts(model, prompts, conts, [32, 64], 4, cpu, batch=2, memo=memo), fresh)
    assert not torch.equal(fresh, chainwalk.chain_counts(walk_draft(), prompts, conts, [32, 64], 4, cpu, batch=2))
    alone = chainwalk.generate(model.target.model, prompts, 4, torch.device("cpu"), tokens=1)
    assert [alone[i] for i in range(4)] == [conts[i].tokens for i in range(4)]
    assert chainwalk.decode_batches([0, 1, 2, 3], prompts, 28, 64, 3 * (40 + 28)) == [[1, 3, 2], [0]]


def test_the_walk_counts_blocks_as_chain_decoding_does():
    from longspec.measure.chainwalk import walk

    cont = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # every proposal right (guess[j-1][m-1] = cont[m]): 2 + 1 tokens per block until 8 tokens are kept
    assert walk(cont, 8, [[cont[m] for m in range(1, 10)]] * 2, 2) == ([3, 3, 3], [3, 3], [3, 3])
    never = [[0] * 9] * 2
    assert walk(cont, 5, never, 2) == ([1, 1, 1, 1], [4, 0], [0, 0])
    assert walk(cont, 1, never, 2) == ([], [0, 0], [0, 0])          # the prefill's token was the last


class _Prepared:
    def __init__(self, lengths):
        self.offsets, self.tokens = flat(lengths)


def test_a_resume_from_before_the_best_step_drops_that_best_draft(tmp_path):
    """best/ written at step 60, the process killed before checkpoint-60: the resume from
    checkpoint-50 rolls step 60 back, so its best draft goes and the resumed draft is measured."""
    import torch.distributed as dist

    from longspec.model.weights import save_draft
    from longspec.training.runwriter import RunWriter
    from longspec.runs import runfolder
    from longspec.files.atomic import atomic_write_json, sha256_file

    run = tmp_path / "run"
    conf = {"eval_steps": 10, "eval_gamma": 4, "per_gpu_train_batch_size": 2, "eval_tokens": 300}
    data = _Prepared([100] * 20)
    fresh = simtau.SimTau(conf, data, RunWriter(run), 0, 1, resumed=False)
    run.mkdir()
    fresh.commit()                                    # heldout.json

    def best_at(step: int) -> None:
        w = save_draft({"w": torch.ones(2)}, run / runfolder.BEST_DIR)
        atomic_write_json(run / runfolder.BEST_INFO, {"step": step, "tau": 2.5, "weights": str(w.relative_to(run)),
                                                      "sha256": sha256_file(w)})

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        best_at(60)
        resumed = simtau.SimTau(conf, data, RunWriter(run), 0, 1, resumed=True)
        assert resumed.best_tau == 2.5
        resumed.after_resume(60)                      # the checkpoint of the best step: kept
        assert runfolder.RunDir(run).best()["step"] == 60 and not resumed.redo
        resumed.after_resume(50)
        assert runfolder.RunDir(run).best() is None and not (run / runfolder.BEST_DIR).exists()
        assert resumed.best_tau == -float("inf") and resumed.redo
    finally:
        dist.destroy_process_group()


def test_a_regular_evaluation_waits_until_the_first_ones_cost_is_earned_back(tmp_path, capsys, monkeypatch):
    """The account rule: the first evaluation took 2 s (continuations, the target over the held-out
    rows); at 5 % a regular one waits until the stage has run 40 s, though the pace (a 0.05 s walk
    against 0.2 s steps) would allow one every 5 steps."""
    import time as clock

    import torch.distributed as dist

    from longspec.training.runwriter import RunWriter

    conf = {"eval_steps": 5, "eval_gamma": 4, "per_gpu_train_batch_size": 2, "eval_tokens": 300, "eval_share": 0.05}
    s = simtau.SimTau(conf, _Prepared([100] * 20), RunWriter(tmp_path / "run"), 0, 1, resumed=False)
    session = type("S", (), {"conf": {"stage": "base"}})()
    now = clock.time()
    monkeypatch.setattr(simtau, "time", type("Clock", (), {"time": staticmethod(lambda: now)}))   # no drift
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        s.spent, s.walk_s, s.last_step = 2.0, 0.05, 0
        s.began, s.last_end = now - 10, now - 8                     # 10 s of stage, 40 steps of 0.2 s
        assert not s._spaced(session, 40) and s.gap == 5
        out = capsys.readouterr().out
        assert "[base] tau at step 40 deferred: tau took 2.0 s of the stage's 10.0 s so far; with the next walk " \
               "(~0.1 s) it would be over its 5% (eval_share)" in out
        assert "until about step 195" in out                       # 31 s more of 0.2 s steps
        assert not s._spaced(session, 45) and "deferred" not in capsys.readouterr().out   # said once
        s.began = now - 50                                          # 50 s in: 2.05 s is within 5 %
        assert s._spaced(session, 40)
        s.walk_s, s.began = None, now - 10        # untimed (the first walk also ran the target): the account alone
        assert not s._spaced(session, 40) and s.gap == 5
        s.began = now - 50
        assert s._spaced(session, 40)
        s.share = 0.0                                               # eval_share 0: every eval_steps, as set
        assert s._spaced(session, 5)
    finally:
        dist.destroy_process_group()


def test_a_module_that_cannot_be_built_from_its_config_gets_no_whole_copy():
    """meta_shell: an empty module to copy into, allocated nowhere; a constructor that fails means
    the evaluation runs on the (partitioned) original, never that training stops."""
    import torch.nn as nn

    from longspec.model.zero import meta_shell, whole_copy

    class NeedsMore(nn.Module):
        def __init__(self, config, extra):
            super().__init__()

    src = nn.Linear(3, 2)
    assert meta_shell(lambda: NeedsMore({})) is None
    shell = meta_shell(lambda: nn.Linear(3, 2))
    assert shell.weight.is_meta
    copy = whole_copy(src, shell, torch.device("cpu"))
    assert torch.equal(copy.weight, src.weight) and copy.weight.data_ptr() != src.weight.data_ptr()
    assert not copy.weight.requires_grad


def test_continuations_are_reused_prompt_by_prompt_for_the_same_target(tmp_path):
    """Another max_steps changes which records the prompts come from, not a shared prompt's
    continuation: those made by the same target for the same tokens, limit and stops are read back."""
    from longspec.measure.prompts import Prompt

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen2"}')
    a, b, c = (Prompt([1, 2, i], f"d.jsonl:{i}", "text", max_new=3, stops=(9,)) for i in (3, 4, 5))
    path = tmp_path / "continuations.json"
    conts = {0: chainwalk.Continuation([7, 7, 7, 8, 8], 3), 1: chainwalk.Continuation([6, 9, 0, 0, 0], 2)}
    key = chainwalk.continuation_digest(target, [])
    chainwalk.write(path, chainwalk.continuation_digest(target, [a, b]), 2, [a, b], conts, 1.0, key)
    assert chainwalk.read_reusable(path, key, [c, b, a], 2) == {1: [6, 9, 0, 0, 0], 2: [7, 7, 7, 8, 8]}
    assert chainwalk.read_reusable(path, key, [a], 3) == {}                       # too short for gamma 3
    longer = Prompt([1, 2, 3], "d.jsonl:3", "text", max_new=4, stops=(9,))
    assert chainwalk.read_reusable(path, key, [longer], 1) == {}                  # another new-token limit
    (target / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8}')
    assert chainwalk.read_reusable(path, chainwalk.continuation_digest(target, []), [a], 2) == {}  # another target


def test_the_shared_continuation_cache_by_target_dtype_and_device_and_what_it_refuses(tmp_path, monkeypatch):
    import os

    from longspec.measure import contcache
    from longspec.measure.prompts import Prompt

    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"0" * 64)
    folder = contcache.shared_folder(target, "torch.float32", "cpu")
    assert folder != contcache.shared_folder(target, "torch.bfloat16", "cpu") != contcache.shared_folder(
        target, "torch.float32", "cuda")
    prompts = [Prompt([5, 6, 7], "f:1", "chat", max_new=4), Prompt([8, 9], "f:2", "chat", max_new=4),
               Prompt([1, 2, 3, 4], "f:3", "chat", max_new=4)]
    conts = {i: chainwalk.Continuation(list(range(10, 18)), 4) for i in range(3)}
    assert contcache.write_shared(folder, prompts, conts, {0, 1, 2}) == 3
    assert contcache.read_shared(folder, prompts, gamma=4) == {i: list(range(10, 18)) for i in range(3)}
    assert contcache.read_shared(folder, prompts, gamma=5) == {}                   # too short for gamma 5
    assert set(contcache.read_shared(folder, prompts, gamma=4, skip={1})) == {0, 2}
    (folder / f"{chainwalk.prompt_key(prompts[0])}.json").write_text('{"version": 1, "tokens": [1, "x"]}')
    (folder / f"{chainwalk.prompt_key(prompts[2])}.json").write_text('{"version": 1, "tok')   # a torn file
    assert set(contcache.read_shared(folder, prompts, gamma=4)) == {1}
    # weights rewritten in place (same size, another mtime) are another target
    os.utime(target / "model.safetensors", ns=(1, 1))
    assert contcache.shared_folder(target, "torch.float32", "cpu") != folder
    # a cache that cannot be written is skipped
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    assert contcache.write_shared(blocked / "x", prompts, conts, {0}) == 0
    assert contcache.read_shared(blocked / "x", prompts, gamma=4) == {}             # nor read: missing
    assert contcache.write_shared(folder, prompts, conts, {0, 1, 2}) == 2          # the two broken ones mended
    assert set(contcache.read_shared(folder, prompts, gamma=4)) == {0, 1, 2}
