"""The chain tau `eval` measures, computed while a stage trains: the target's greedy continuation
of each prompt once, then the block walk of greedy chain decoding over the draft's teacher-forced
guesses.

Prompts: `eval`'s default measurement of the stage (longspec.measure.prompts.default_prompts with the
run's step count: the same records, cuts, length buckets, new-token limits and stop tokens).

Continuations, once per run: the frozen target decodes each prompt greedily for max_new + gamma
tokens, without stopping, a rank's share of the prompts in one left-padded batch (every rank runs the same number of forwards, which ZeRO-3's parameter
gathering needs; the tokens after a stop are what the target's verify forward sees beyond it).
`end` = where decoding stops: after the first stop token, or at max_new. They are kept in the run
folder (continuations.json) with a digest of what made them (continuation_digest: the target's
config and weight files, the tokenizer files, every prompt's tokens, limit and stop tokens); a
resume with the same digest reuses them, and `eval` checks its own greedy output against them.
Each is also kept in a cache any run on the host reads (longspec.measure.contcache), so a new run
folder of the same stage does not decode them again.

The walk. Greedy chain decoding (longspec.decode.chain.speculative_decode with GlideProposer) with
g tokens generated (prompt P tokens, continuation c_0 .. c_{g-1} verified; the target's cache ends
at c_{g-2}) proposes d_j, j = 1..gamma, from the draft at position P + g - 2 + j with input token
c_{g-2+j} (d_{j-1} = c_{g-2+j} whenever proposal j is reached), its self-attention over its own
inputs, and its cross-attention on the target's K/V of positions 0 .. P + g - 2: the lag-j mask of
training (keys up to t - j). So d_j is the draft's teacher-forced greedy token at lag j on
prompt + continuation, read at position P + g - 2 + j; it is accepted when it equals c_{g-1+j}.
k accepted gives k + 1 tokens (the bonus), and the next block starts with g + k + 1. tau = tokens
over blocks, summed over prompts (as eval's figures): eval's chain tau for this draft, up to
floating point (a teacher-forced forward and a cached one round differently).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = 1
ARGMAX_ROWS = 1024          # rows of hidden states per vocabulary projection (no (T, V) logits at 32k)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


@dataclass
class Continuation:
    tokens: list[int]           # max_new + gamma greedy tokens after the prompt (no stop applied)
    end: int                    # tokens decoding keeps: after the first stop token, or max_new


def continuation_digest(target: Path, prompts: list) -> str:
    """sha256 of what makes the continuations: the target's config.json and its weight files
    (names and sizes: a 60 GB target is not re-read), the tokenizer files, and every prompt's
    tokens, new-token limit and stop tokens (longspec.measure.prompts.Prompt)."""
    h = hashlib.sha256(f"chainwalk {VERSION}\n".encode())
    target = Path(target)
    for f in sorted(target.iterdir()) if target.is_dir() else ():
        if f.name == "config.json" or f.name in _TOKENIZER_FILES:
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        elif f.suffix in WEIGHT_SUFFIXES:
            h.update(f"{f.name}\0{f.stat().st_size}".encode())
    for p in prompts:
        h.update(json.dumps([p.ids, p.max_new, list(p.stops)]).encode())
    return h.hexdigest()


def stop_end(tokens: list[int], max_new: int, stops) -> int:
    """How many of ``tokens`` greedy decoding keeps (longspec.decode.chain's own stop rule)."""
    from longspec.decode.chain import finish_tokens

    return len(finish_tokens(tokens, max_new, stops)[0])


GEN_BATCH = 64               # prompts decoded together, left-padded (one forward per token for all of them)
GEN_TOKENS = 131072          # at most this many positions (rows x (longest prompt + tokens)) in one decode batch


def generate(model, prompts: list, gamma: int, device, rank: int = 0, world: int = 1,
             batch: int = GEN_BATCH, tokens: int = GEN_TOKENS) -> dict[int, list[int]]:
    """{prompt index: max_new + gamma greedy tokens} for this rank's share (round-robin) of
    ``prompts``; ``model`` is the target's transformers model. The share is decoded in left-padded
    batches (greedy_batch; longest prompts first, at most ``batch`` rows and ``tokens`` positions),
    so a continuation costs max_new + gamma forwards per batch whatever the prompts' lengths: one
    batch per rank up to 32k-token prompts of a few prompts per rank. Every rank runs the same
    number of batches of the same number of forwards (stand-in batches make up a smaller share)."""
    n = max(p.max_new for p in prompts) + gamma
    plans = [decode_batches([i for i in range(r, len(prompts), world)], prompts, n, batch, tokens)
             for r in range(world)]
    out: dict[int, list[int]] = {}
    for k in range(max(len(p) for p in plans)):
        chunk = plans[rank][k] if k < len(plans[rank]) else []
        toks = greedy_batch(model, [prompts[i].ids for i in chunk or [0]], n, device)
        for i, t in zip(chunk, toks):
            out[i] = t[:prompts[i].max_new + gamma]
    return out


def decode_batches(share: list[int], prompts: list, n: int, batch: int, tokens: int) -> list[list[int]]:
    """``share`` cut into decode batches: longest prompts first, each batch at most ``batch`` rows and
    ``tokens`` positions (rows x (its longest prompt + n); a longer prompt alone)."""
    order = sorted(share, key=lambda i: -len(prompts[i].ids))
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < batch and (len(out[-1]) + 1) * (len(prompts[out[-1][0]].ids) + n) <= tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def greedy_batch(model, ids: list[list[int]], n: int, device) -> list[list[int]]:
    """Greedy decoding of the prompts ``ids`` for exactly n tokens each, no stop: one left-padded
    batch (the attention mask hides the padding, position ids count from each prompt's first
    token, as transformers' generate does), n forwards: the prefill, then one token at a time with
    the KV cache. Each row is its prompt's own greedy decoding up to floating point (in fp32 the
    same tokens: eval.json's `continuations` reports how many prompts match eval's unpadded
    decoding)."""
    import torch

    from longspec.decode.chain import _cache_kwarg, _keep_last_kwarg, new_cache

    B, T = len(ids), max(len(r) for r in ids)
    inp = torch.zeros(B, T, dtype=torch.long)
    mask = torch.ones(B, T + n, dtype=torch.long)
    for b, r in enumerate(ids):
        inp[b, T - len(r):] = torch.tensor(r)
        mask[b, :T - len(r)] = 0
    inp, mask = inp.to(device), mask.to(device)
    pos = (mask[:, :T].cumsum(-1) - 1).clamp(min=0)
    padded = bool((mask[:, :T] == 0).any())
    cache = new_cache()
    kw = {_cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        logits = model(input_ids=inp, attention_mask=mask[:, :T] if padded else None, position_ids=pos,
                       use_cache=True, **kw, **_keep_last_kwarg(model)).logits[:, -1]
        tok = logits.float().argmax(-1)                                     # (B,)
        out.append(tok)
        for k in range(1, n):
            pos = pos[:, -1:] + 1
            tok = model(input_ids=tok[:, None], attention_mask=mask[:, :T + k] if padded else None,
                        position_ids=pos, use_cache=True, **kw).logits[:, -1].float().argmax(-1)
            out.append(tok)
    return torch.stack(out, 1).tolist()


def walk(cont: list[int], end: int, guess: list[list[int]], gamma: int) -> tuple[list[int], list[int], list[int]]:
    """Greedy chain decoding's blocks over a continuation: (tokens per block, proposals reached per
    draft position, proposals accepted per draft position). guess[j - 1][m - 1] = the draft's greedy
    token at lag j that predicts cont[m] (teacher-forced at position P + m - 1)."""
    accepted, reached, agreed = [], [0] * gamma, [0] * gamma
    g = 1                                          # the prefill gave cont[0]
    while g < end:
        k = 0
        while k < gamma:
            reached[k] += 1
            if guess[k][g + k - 1] != cont[g + k]:
                break
            agreed[k] += 1
            k += 1
        accepted.append(k + 1)
        g += k + 1
    return accepted, reached, agreed


def draft_guesses(module, rows: list[tuple[list[int], int, int]], gamma: int, device,
                  frozen: tuple | None = None) -> tuple[list[list[list[int]]], tuple]:
    """For rows [(prompt + continuation tokens, P, L)]: per row, per lag j = 1..gamma, the draft's
    greedy tokens at positions P .. P + L - 1 (a list of L ids; L = 0: a stand-in row); and what
    the frozen target gave for these rows (its last-layer K/V, the embeddings), which ``frozen``
    hands back on the next call with the same rows instead of running the target again. One
    padded batch: the target forward, the draft's lags from the first selected position
    (draft_all_lags), the argmax over the target's lm_head (gathered under ZeRO-3: every rank
    must call this as often, and pass ``frozen`` alike)."""
    import torch

    from longspec.model.zero import gathered

    target, draft = module.target, module.draft
    dtype = draft.input_layernorm.weight.dtype
    B, T = len(rows), max(len(r[0]) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    real = torch.zeros(B, T, dtype=torch.bool)
    sel = torch.zeros(B, T, dtype=torch.bool)
    for b, (toks, p, n) in enumerate(rows):
        ids[b, :len(toks)] = torch.tensor(toks)
        real[b, :len(toks)] = True
        sel[b, p:p + n] = True
    start = min((p for _, p, n in rows if n), default=0)
    ids, real, sel = ids.to(device), real.to(device), sel[:, start:].to(device)
    with torch.no_grad():
        mask = real.long() if bool((~real).any()) else None
        pos = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
        if frozen is None:
            tgt = target(ids, pos, attention_mask=mask)
            frozen = (tgt.k, tgt.v, target.embed(ids).to(dtype))
        k, v, hidden = frozen
        outs = draft_all_lags(draft, hidden, k, v, target.rotary(pos, hidden), mask, gamma, start)
        with gathered(target.lm_head.weight) as w:
            per_lag = [_argmax(h[sel], w).tolist() if bool(sel.any()) else [] for h in outs]
    out, a = [], 0
    for _, _, n in rows:
        out.append([lag[a:a + n] for lag in per_lag])
        a += n
    return out, frozen


def draft_all_lags(draft, hidden, target_k, target_v, rope, mask, gamma: int, start: int = 0) -> list:
    """GlideDraft.forward at cross-attention lags 1..gamma (a list of (B, T - start, H): the
    positions start .. T - 1), sharing what does not depend on the lag (self-attention, the
    cross-attention queries); then per lag the cross-attention, its output projection and the MLP.
    The same values as gamma calls of draft(...) (tests/trainer/test_simtau.py holds them equal);
    with ``start``, the positions before it are only keys of the self-attention."""
    from longspec.model import attention as attn_ladder
    from longspec.model.glide import apply_rope

    cos, sin = rope
    x = draft.input_layernorm(hidden)
    sa = draft.self_attn
    k = apply_rope(sa.heads(sa.k_proj, x), cos, sin)
    v = sa.heads(sa.v_proj, x)
    cos, sin, x, hidden = cos[:, start:], sin[:, start:], x[:, start:], hidden[:, start:]
    q = apply_rope(sa.heads(sa.q_proj, x), cos, sin)
    W = draft.config.sliding_window
    if start:
        y = attn_ladder.attention_rows(q, k, v, start, window=W, key_padding_mask=mask)
    else:
        y = attn_ladder.attention(q, k, v, causal=True, window=W, key_padding_mask=mask)
    hidden = hidden + sa.out(y)
    ca = draft.cross_attn
    q = apply_rope(ca.heads(ca.q_proj, draft.post_self_attention_layernorm(hidden)), cos, sin)
    outs = []
    for lag in range(1, gamma + 1):          # one lag at a time: the MLP's activations of one forward
        if start:
            y = attn_ladder.attention_rows(q, target_k, target_v, start, lag=lag, key_padding_mask=mask)
        else:
            y = attn_ladder.attention(q, target_k, target_v, causal=True, lag=lag, key_padding_mask=mask)
        h = hidden + ca.out(y)
        outs.append(h + draft.mlp(draft.post_cross_attention_layernorm(h)))
    return outs


def _argmax(hidden, weight):
    import torch

    rows = [torch.argmax(hidden[a:a + ARGMAX_ROWS].float() @ weight.float().t(), dim=-1)
            for a in range(0, hidden.shape[0], ARGMAX_ROWS)]
    return torch.cat(rows)


FROZEN_BYTES = 1 << 30       # the target's K/V and embeddings of the held-out rows are kept up to this, per rank


def chain_counts(module, prompts: list, conts: dict[int, Continuation], lengths: list[int], gamma: int,
                 device, rank: int = 0, world: int = 1, batch: int = 1, memo: dict | None = None) -> Any:
    """float64 (len(lengths) + 2, max(2, gamma)) of this rank's share of ``prompts`` (round-robin,
    longest first, ``batch`` rows at a time): rows 0..len(lengths)-1 = [tokens, blocks] per length
    bucket; then the proposals accepted and reached per draft position. Every rank runs the same
    number of batches (stand-ins count nothing). ``memo`` (a dict the caller keeps between
    evaluations): the frozen target's outputs of each batch, kept when every rank's share fits in
    FROZEN_BYTES, so later evaluations run the draft alone (the same values: the same rows)."""
    import torch

    nb = len(lengths)
    counts = torch.zeros(nb + 2, max(2, gamma), dtype=torch.float64)
    per_rank = math.ceil(len(prompts) / world)

    def share(r: int) -> list[int]:
        return sorted(range(r, len(prompts), world), key=lambda i: -len(prompts[i].ids))

    def rows_of(chunk: list[int]) -> list:
        rows = []
        for i in chunk or [0]:                     # a stand-in batch: prompt 0, nothing counted
            n = conts[i].end + gamma - 1 if chunk else 0
            rows.append((prompts[i].ids + conts[i].tokens[:n], len(prompts[i].ids), n))
        return rows

    mine = share(rank)
    for a in range(0, per_rank, batch):
        chunk = mine[a:a + batch]
        frozen = memo.get(a) if memo is not None else None
        guesses, frozen = draft_guesses(module, rows_of(chunk), gamma, device, frozen)
        if memo is not None and a not in memo and memo.get("keep", True):
            if "keep" not in memo:                 # the same decision on every rank: the largest share
                per_pos = sum(t.nelement() * t.element_size() for t in frozen) / (frozen[0].shape[0] * frozen[0].shape[2])
                most = max(sum(len(rows_of(s[b:b + batch])) * max(len(r[0]) for r in rows_of(s[b:b + batch]))
                               for b in range(0, per_rank, batch)) for s in map(share, range(world)))
                memo["keep"] = most * per_pos <= FROZEN_BYTES
            if memo["keep"]:
                memo[a] = frozen
        for i, g in zip(chunk, guesses):
            acc, reached, agreed = walk(conts[i].tokens, conts[i].end, g, gamma)
            b = lengths.index(prompts[i].bucket)
            counts[b, 0] += sum(acc)
            counts[b, 1] += len(acc)
            counts[nb, :gamma] += torch.tensor(agreed, dtype=torch.float64)
            counts[nb + 1, :gamma] += torch.tensor(reached, dtype=torch.float64)
    return counts


def figures(counts, lengths: list[int], prompts: list, gamma: int) -> dict:
    """tau over all prompts, by length bucket, and the acceptance rate at each draft position
    (accepted / reached) from summed chain_counts."""
    nb = len(lengths)
    tok, blocks = float(counts[:nb, 0].sum()), float(counts[:nb, 1].sum())
    agreed, reached = counts[nb, :gamma].tolist(), counts[nb + 1, :gamma].tolist()
    by = []
    for b, n in enumerate(lengths):
        k = sum(1 for p in prompts if p.bucket == n)
        if k:
            t, s = float(counts[b, 0]), float(counts[b, 1])
            by.append({"length": n, "prompts": k, "tau": round(t / s, 4) if s else 0.0})
    return {"tau": round(tok / blocks, 4) if blocks else 0.0, "blocks": int(blocks),
            "alpha": [round(a / r, 4) if r else 0.0 for a, r in zip(agreed, reached)], "by_length": by}


# ----------------------------------------------------------------------------- the run folder's file

def prompt_key(p) -> str:
    """sha256 of what one prompt's continuation depends on besides the target: its tokens, its
    new-token limit and its stop tokens."""
    return hashlib.sha256(json.dumps([p.ids, p.max_new, list(p.stops)]).encode()).hexdigest()


def write(path: Path, digest: str, gamma: int, prompts: list, conts: dict[int, Continuation], seconds: float,
          target_digest: str | None = None) -> None:
    """continuations.json; with `target_digest` (continuation_digest of the target alone) and each
    prompt's key, so that a later run with other prompts reuses those it shares (read_reusable)."""
    from longspec.files.atomic import atomic_write_json

    atomic_write_json(path, {
        "version": VERSION, "digest": digest, "target": target_digest, "gamma": gamma, "seconds": round(seconds, 3),
        "prompts": [{"record": p.record, "kind": p.kind, "bucket": p.bucket, "prompt_tokens": len(p.ids),
                     "max_new": p.max_new, "end": conts[i].end, "key": prompt_key(p), "tokens": conts[i].tokens}
                    for i, p in enumerate(prompts)]})


def read_reusable(path: Path, target_digest: str, prompts: list, gamma: int) -> dict[int, list[int]]:
    """{prompt index: tokens} of the prompts whose continuation ``path`` already holds: made by the
    same target (`target_digest`) for a prompt with the same key, long enough for ``gamma``."""
    from longspec.runs import runfolder

    data, _ = runfolder.read_json(path)
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("target") != target_digest \
            or not isinstance(data.get("prompts"), list):
        return {}
    have = {rec["key"]: rec["tokens"] for rec in data["prompts"]
            if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("tokens"), list)}
    out = {}
    for i, p in enumerate(prompts):
        toks = have.get(prompt_key(p))
        if toks is not None and len(toks) >= p.max_new + gamma:
            out[i] = toks[:p.max_new + gamma]
    return out


def read(path: Path, digest: str, prompts: list, gamma: int) -> dict[int, Continuation] | None:
    """The continuations in ``path`` when they were made from the same digest and are long enough for
    ``gamma``; None otherwise."""
    from longspec.runs import runfolder

    data, _ = runfolder.read_json(path)
    if not data or data.get("digest") != digest or not isinstance(data.get("prompts"), list) \
            or len(data["prompts"]) != len(prompts):
        return None
    out = {}
    for i, (p, rec) in enumerate(zip(prompts, data["prompts"])):
        toks = rec.get("tokens") if isinstance(rec, dict) else None
        if not isinstance(toks, list) or len(toks) < p.max_new + gamma:
            return None
        out[i] = Continuation(toks, stop_end(toks, p.max_new, p.stops))
    return out


def same_as_training(run_dir: Path, target: Path, prompts: list, rows: list[dict]) -> dict | None:
    """The trainer's continuations of these prompts (longspec.measure.chainwalk; what its tau walked): None
    when the run has none; else whether they were made from these prompts, this target and these
    limits (`same_digest`), and on how many prompts this measurement's greedy output equals them."""
    from longspec.runs import runfolder

    path = run_dir / runfolder.CONTINUATIONS
    if not path.is_file():
        return None
    conts = read(path, continuation_digest(target, prompts), prompts, 0)
    if conts is None:
        return {"file": path.name, "same_digest": False}
    same = sum(1 for i, r in enumerate(rows) if r["_raw"]["tokens"] == conts[i].tokens[:conts[i].end])
    return {"file": path.name, "same_digest": True, "prompts": len(rows), "same_greedy_output": same}
