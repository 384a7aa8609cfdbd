"""Greedy speculative decoding with a GLIDE draft: lossless against plain greedy, tau bounds, rollback.

Targets are tiny real Qwen2 / Llama models (random init, fp32). Proposers:
- GlideProposer with a random draft (poor proposals: exercises rejection + rollback),
- an oracle that proposes with the target itself (every proposal right: tau must be gamma + 1),
- a "right for j tokens, then wrong" oracle (exact accepted counts: exercises partial rollback).
All go through the same speculative_decode loop.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from longspec.model.glide import DraftConfig, GlideDraft
from longspec.decode.chain import (
    GlideProposer,
    cache_length,
    crop_cache,
    greedy_decode,
    new_cache,
    speculative_decode,
    target_logits,
)
from longspec.model.target import TargetWrapper
from tests.trainer.conftest import TINY_DIMS, make_tiny_target

VOCAB = TINY_DIMS["vocab_size"]


@pytest.fixture(autouse=True)
def _deterministic():
    """Deterministic kernels; one thread (tiny matmuls only get slower with more on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


def prompt(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def random_glide(target, window=6, seed=1, std=None):
    torch.manual_seed(seed)
    draft = GlideDraft(DraftConfig.from_target_config(target.config, sliding_window=window)).float().eval()
    if std is not None:                      # a draft with opinions (std 0.02 proposes near-constants)
        for p in draft.parameters():
            torch.nn.init.normal_(p, std=std)
    return GlideProposer(TargetWrapper(target), draft)


class TargetOracle:
    """Proposes with the target itself, on its own cache: every proposal is the target's argmax.
    ``wrong_after``: propose the right token for that many steps per round, then a wrong one."""

    def __init__(self, model, wrong_after: int | None = None):
        self.model, self.wrong_after = model, wrong_after
        self.cache, self.rounds = None, 0

    def start(self, prompt, cache):
        self.cache = new_cache()
        target_logits(self.model, prompt[:, :-1], self.cache)     # the cache ends before the last token

    def propose(self, seq, cache, gamma):
        new = seq[:, cache_length(self.cache):]                   # catch up on verified tokens
        out = []
        for j in range(gamma):
            tok = int(target_logits(self.model, new, self.cache)[-1].argmax())
            if self.wrong_after is not None and j == self.wrong_after:
                tok = (tok + 1) % VOCAB
            out.append(tok)
            new = seq.new_tensor([[tok]])
        return out

    def rollback(self, valid):
        crop_cache(self.cache, min(valid, cache_length(self.cache)))


# ----------------------------------------------------------------------------- plain greedy

def test_greedy_decode_equals_transformers_generate(family, tiny_target):
    p = prompt()
    ours = greedy_decode(tiny_target, p, 30)
    ref = tiny_target.generate(p, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                               attention_mask=torch.ones_like(p))[0, p.shape[1]:].tolist()
    assert ours.tokens == ref
    assert ours.target_forwards == 29 and ours.tau == 1.0


def test_crop_cache_keeps_the_first_positions(family, tiny_target):
    cache = new_cache()
    target_logits(tiny_target, prompt(10), cache)
    crop_cache(cache, 7)
    assert cache_length(cache) == 7
    with pytest.raises(ValueError):
        crop_cache(cache, 8)


# ----------------------------------------------------------------------------- lossless

@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_random_glide_draft_is_lossless(family, tiny_target, gamma):
    for seed in range(3):
        p = prompt(9 + 5 * seed, seed)
        ref = greedy_decode(tiny_target, p, 40)
        got = speculative_decode(tiny_target, random_glide(tiny_target, std=0.3, seed=seed), p, gamma, 40)
        assert got.tokens == ref.tokens
        assert 1.0 <= got.tau <= gamma + 1
        assert got.target_forwards == len(got.accepted) <= 39


def test_oracle_draft_reaches_maximum_tau(family, tiny_target):
    p = prompt(15, 3)
    for gamma in (1, 2, 4):
        ref = greedy_decode(tiny_target, p, 41)
        got = speculative_decode(tiny_target, TargetOracle(tiny_target), p, gamma, 41)
        assert got.tokens == ref.tokens
        assert got.tau == gamma + 1                                   # every proposal accepted
        assert got.target_forwards == math.ceil(40 / (gamma + 1))     # vs 40 plain forwards


@pytest.mark.parametrize("right", [0, 1, 3])
def test_partially_right_proposals_accept_exactly_the_right_prefix(family, tiny_target, right):
    """Right for `right` tokens then wrong: every round accepts right + 1 (rollback of the rest)."""
    p = prompt(11, 5)
    ref = greedy_decode(tiny_target, p, 37)
    got = speculative_decode(tiny_target, TargetOracle(tiny_target, wrong_after=right), p, 4, 37)
    assert got.tokens == ref.tokens
    assert set(got.accepted) == {right + 1}


def test_stops_at_eos_like_greedy(family, tiny_target):
    p = prompt(10, 7)
    free = greedy_decode(tiny_target, p, 40).tokens
    eos = free[12]                                                    # a token greedy emits mid-way
    ref = greedy_decode(tiny_target, p, 40, eos_token_id=eos)
    assert ref.tokens[-1] == eos and len(ref.tokens) <= 13
    for proposer in (TargetOracle(tiny_target), random_glide(tiny_target, std=0.3)):
        got = speculative_decode(tiny_target, proposer, p, 4, 40, eos_token_id=eos)
        assert got.tokens == ref.tokens


def test_glide_is_lossless_across_the_draft_window(family, tiny_target):
    """A prompt longer than the draft's window: the draft keeps only its window of K/V."""
    p = prompt(40, 11)
    proposer = random_glide(tiny_target, window=5, std=0.3)
    ref = greedy_decode(tiny_target, p, 30)
    got = speculative_decode(tiny_target, proposer, p, 3, 30)
    assert got.tokens == ref.tokens
    assert proposer.k.shape[2] <= 5 + 3                               # bounded, not the whole context


# ----------------------------------------------------------------------------- draft step = training forward

@pytest.mark.parametrize("lag", [1, 2, 4])
def test_incremental_draft_step_matches_training_forward(family, tiny_target, lag):
    """Proposal j of a round sees the target's K/V up to j tokens back: exactly what the training
    forward computes with cross_lag=j. So an inference step must equal GlideDraft.forward there."""
    T, window = 20, 6
    proposer = random_glide(tiny_target, window=window, std=0.2)
    tw, draft = proposer.target, proposer.draft
    ids = prompt(T, 2)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        tgt = tw(ids, pos)
        h = tw.embed(ids)
        ref = draft(h, pos, tgt.k, tgt.v, cross_lag=lag, rope=tw.rotary(pos, h))     # (1, T, H)
        for t in range(lag, T):
            proposer.k = proposer.v = None
            proposer.end = 0
            proposer._append_kv(ids[:, :t])
            S = t - lag + 1                                           # target K/V of positions 0 .. t - lag
            out = proposer._step(ids[:, t:t + 1], tgt.k[:, :, :S], tgt.v[:, :, :S])
            torch.testing.assert_close(out[0, 0], ref[0, t], atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments(tiny_target):
    with pytest.raises(ValueError, match="gamma"):
        speculative_decode(tiny_target, TargetOracle(tiny_target), prompt(), 0, 10)
    with pytest.raises(ValueError, match="prompt"):
        greedy_decode(tiny_target, torch.zeros(1, 0, dtype=torch.long), 10)


def test_llama_and_qwen2_targets_with_a_longer_vocab():
    """Larger vocabulary (closer logits, more chances of a near-tie) still decodes losslessly."""
    for family in ("qwen2", "llama"):
        target = make_tiny_target(family, seed=3, vocab_size=512)
        p = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
        ref = greedy_decode(target, p, 48)
        got = speculative_decode(target, random_glide(target, std=0.3), p, 4, 48)
        assert got.tokens == ref.tokens


# ----------------------------------------------------------------------------- held-out prompts (longspec.evaluate)

def word_tokenizer(words):
    """A real (fast) tokenizer over whole words, built in memory: enough for longspec.data.encoding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.mark.parametrize("n, batch, accum, world, steps", [(30, 4, 1, 1, 5), (37, 3, 2, 2, 4), (10, 4, 1, 1, 9),
                                                             (25, 2, 3, 3, 0)])
def test_replayed_sampler_is_what_the_trainer_draws(n, batch, accum, world, steps):
    from longspec.data.encoding import ShardedBatchSampler
    from longspec.measure.prompts import trained_indices

    conf = {"per_gpu_train_batch_size": batch, "gradient_accumulation_steps": accum,
            "global_batch_size": batch * accum * world, "seed": 7, "data": {"on_bad_record": "error"}}
    drawn = set()
    for rank in range(world):                        # the trainer's way: iterate the sampler, epoch after epoch
        sampler, left = ShardedBatchSampler(n, batch, 7, rank, world), steps * accum
        while left:
            for b in sampler:
                drawn.update(b)
                left -= 1
                if not left:
                    break
    assert trained_indices(n, conf, steps) == drawn
    assert trained_indices(n, {**conf, "data": {"on_bad_record": "skip"}}, steps) is None


def test_replay_deals_only_the_records_before_the_run_folders_heldout_ones(tmp_path):
    from longspec.data.encoding import ShardedBatchSampler
    from longspec.measure.prompts import trained_indices

    conf = {"per_gpu_train_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch_size": 4, "seed": 7,
            "data": {"on_bad_record": "error"}, "output_dir": str(tmp_path)}
    (tmp_path / "heldout.json").write_text(json.dumps({"start": 24, "records": 6}))
    sampler, drawn = ShardedBatchSampler(24, 4, 7), set()       # what the trainer draws: records 0..23
    for b in list(sampler)[:5]:
        drawn.update(b)
    assert trained_indices(30, conf, 5) == drawn and max(drawn) < 24


def test_replay_is_not_trusted_once_prepare_left_untrainable_records_out(tmp_path, monkeypatch):
    from longspec.data import cache
    from longspec.measure.prompts import trained_indices

    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / "cache"))
    tok = word_tokenizer(["the", "cat", "."])
    path = tmp_path / "base.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + "".join(json.dumps({"text": "the cat ."}) + "\n" for _ in range(29)))
    data = {"collator": "short_text", "on_bad_record": "error", "max_seq_length": 32}
    conf = {"per_gpu_train_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch_size": 4, "seed": 3,
            "data": data, "train_file": str(path), "model_name_or_path": str(tmp_path)}
    assert trained_indices(30, conf, 5) is not None              # no cache: nothing says a record was left out
    man = cache.ensure(path, str(tmp_path), data, tokenizer=tok, progress=False)[1]
    assert (man["records"], man["untrainable"]) == (29, 1)
    assert trained_indices(30, conf, 5) is None                  # the prepared data's indices are not the file's


def test_stage_prompts_are_held_out_records_cut_at_each_length(tmp_path):
    from longspec.measure.prompts import stage_prompts, trained_indices

    words = [f"r{i}" for i in range(30)] + ["the", "cat", "sees", "a", "dog", "."]
    tok = word_tokenizer(words)
    path = tmp_path / "base.jsonl"
    path.write_text("".join(json.dumps({"text": f"r{i} " + "the cat sees a dog . " * 4}) + "\n" for i in range(30)))
    conf = {"per_gpu_train_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch_size": 4, "seed": 3,
            "data": {"collator": "short_text", "on_bad_record": "error", "max_seq_length": 32}}
    drawn = trained_indices(30, conf, 5)
    prompts, info = stage_prompts(path, tok, conf, 5, lengths=[12], per_length={12: 4})
    assert info["records"] == 30 and info["records_drawn_in_training"] == 20 == len(drawn)
    assert info["prompts_drawn_in_training"] == 0 and len(prompts) == 4
    firsts = [int(tok.convert_ids_to_tokens(p.ids[0])[1:]) for p in prompts]
    assert not set(firsts) & drawn and firsts == sorted(firsts)         # undrawn, in file order
    assert firsts[-1] == max(set(range(30)) - drawn)                    # the last undrawn record
    assert all(len(p.ids) == 12 and p.kind == "document" for p in prompts)
    assert [p.record for p in prompts] == [f"base.jsonl:{i + 1}" for i in firsts]

    prompts, info = stage_prompts(path, tok, conf, 100, lengths=[12], per_length={12: 3})  # all drawn: said so
    assert len(prompts) == 3 and info["prompts_drawn_in_training"] == 3
    prompts, _ = stage_prompts(path, tok, conf, 5, lengths=[8, 16], per_length={8: 2, 16: 2})
    assert sorted(len(p.ids) for p in prompts) == [8, 8, 16, 16]      # a document gives a prefix per length

    # every document (25 tokens) shorter than the smallest length: each measured whole, and said so
    prompts, info = stage_prompts(path, tok, conf, 5, lengths=[1024, 2048], per_length={1024: 3, 2048: 3})
    assert [len(p.ids) for p in prompts] == [25] * 3 and "at most 1024 tokens" in info["short_documents"]
    from longspec.measure.prompts import PromptError

    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "r1 the"}) + "\n")      # shorter than any prompt
    with pytest.raises(PromptError) as e:
        stage_prompts(tmp_path / "tiny.jsonl", tok, conf, 0, lengths=[1024], per_length={1024: 3})
    assert "--lengths" in e.value.hint and "1024" in e.value.message


def test_evaluate_refuses_a_run_without_finished_draft(tmp_path, capsys):
    from longspec.evaluate import main

    run = tmp_path / "runs" / "base"
    run.mkdir(parents=True)
    (run / "training_config.yaml").write_text("stage: base\nmodel_name_or_path: /nowhere\n")
    assert main([str(run), "--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["error"].startswith("stage base has no finished draft")
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(run), "--gamma", "0"]) == 2


def test_default_prompt_count_follows_a_token_budget():
    from longspec.measure.prompts import MAX_PROMPTS, MIN_PROMPTS, default_num_prompts

    assert default_num_prompts(64) == MAX_PROMPTS      # short prompts: many, tau varies per prompt
    assert default_num_prompts(448) == 9
    assert default_num_prompts(32_000) == MIN_PROMPTS  # 32k prompts: a few
    assert default_num_prompts(64, 2) == 32 and default_num_prompts(128, 2) == 16   # buckets share the budget


def test_prefill_keeps_only_the_last_positions_logits(tiny_target):
    """A long prompt's prefill must not hold (T, V) logits: the model is asked for the last one."""
    from longspec.decode.chain import _keep_last_kwarg

    assert _keep_last_kwarg(tiny_target) in ({"logits_to_keep": 1}, {"num_logits_to_keep": 1})
    ids = prompt(12)
    full = target_logits(tiny_target, ids, new_cache())
    last = target_logits(tiny_target, ids, new_cache(), last_only=True)
    assert full.shape == (12, TINY_DIMS["vocab_size"]) and last.shape == (1, TINY_DIMS["vocab_size"])
    assert last.dtype == torch.float32
    torch.testing.assert_close(last[0], full[-1])


def test_stage_prompts_read_only_the_last_records_when_the_run_gives_the_count(tmp_path, monkeypatch):
    """With heldout.json (the prepared data's record count) the prompts come from the JSONL read
    backwards from its end, and equal those of a whole read."""
    from longspec.data import records
    from longspec.measure.prompts import stage_prompts

    words = [f"r{i}" for i in range(400)] + ["the", "cat", "sees", "a", "dog", "."]
    tok = word_tokenizer(words)
    path = tmp_path / "base.jsonl"
    path.write_text("".join(json.dumps({"text": f"r{i} " + "the cat sees a dog . " * 4}) + "\n" for i in range(400)))
    conf = {"per_gpu_train_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch_size": 4, "seed": 3,
            "data": {"collator": "short_text", "on_bad_record": "error", "max_seq_length": 32},
            "output_dir": str(tmp_path)}
    (tmp_path / "heldout.json").write_text(json.dumps({"start": 398, "records": 2}))
    whole = stage_prompts(path, tok, conf, 60, lengths=[12], per_length={12: 8})

    def no_whole_read(*a, **kw):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(records, "TAIL_WHOLE", 0)
    monkeypatch.setattr(records, "read_records", no_whole_read)
    tail = stage_prompts(path, tok, conf, 60, lengths=[12], per_length={12: 8})
    assert [(p.ids, p.record) for p in tail[0]] == [(p.ids, p.record) for p in whole[0]] and tail[1] == whole[1]
    assert whole[1]["records"] == 400 and whole[1]["prompts_drawn_in_training"] == 0
