"""Greedy speculative decoding with a GLIDE draft, and the plain greedy baseline it must equal.

One verify step (batch 1):

    verified  x_0 .. x_{n-1}        target cache holds x_0 .. x_{n-2} (x_{n-1} is the last bonus token)
    propose   d_1 .. d_g            the proposer (GLIDE draft) runs g steps on its own small state
    verify    target([x_{n-1}, d_1 .. d_g])  -> greedy argmax a_0 .. a_g   (ONE forward, g + 1 tokens)
    accept    k = longest prefix with d_i == a_{i-1};  new tokens d_1 .. d_k, a_k  (k + 1 tokens)
    rollback  target cache and proposer state back to x_0 .. x_{n-1}, d_1 .. d_k

Every token that survives is the target's own argmax after a prefix of target-verified tokens,
so the output is the target's plain greedy output whatever the proposer does (up to floating
point: run in fp32 to compare token for token).

The GLIDE proposer: the draft block reads the target's last-layer K/V cache (post-RoPE, every
verified token the target has processed) through its cross-attention -- all of it, no artificial
lag: the cache simply ends before the bonus token, which the noisy-lag training (lag j in 1..4)
prepares the draft for. Its self-attention keeps a K/V cache of its own over the last
`sliding_window + 1` tokens (the training window: flash-attn's `window_size=(W, -1)`). Because the draft is one block, those self-attention K/V depend only on
(token, position), so rolling back is a crop and catching up is one batched projection.

The decoding loop takes any `Proposer` (start / propose / rollback), so tests can plug in an
oracle that proposes with the target itself and must reach tau = gamma + 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

from longspec.model import attention as attn_ladder
from longspec.model.glide import GlideDraft, apply_rope
from longspec.model.target import TargetWrapper


# ----------------------------------------------------------------------------- results

@dataclass
class DecodeResult:
    tokens: list[int]                    # generated token ids (the prompt excluded)
    target_forwards: int                 # target forwards after the prefill (verify steps)
    accepted: list[int] = field(default_factory=list)  # per verify step: tokens it produced (k + 1)
    prefill_s: float = 0.0
    decode_s: float = 0.0                # wall time after the prefill

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (accepted proposals + the target's bonus token)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: tokens after the first one, over the time after the prefill."""
        n = max(0, len(self.tokens) - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0


# ----------------------------------------------------------------------------- cache helpers
# transformers 5 keeps DynamicCache layers in `.layers`; 4.x in key_cache / value_cache lists.

def new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions. A negative argument means "remove that many" in both
    transformers 4.x (where a positive one is a final length) and 5.x (which only takes negatives)."""
    extra = cache_length(cache) - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if extra:
        cache.crop(-extra)


def last_layer_kv(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last-layer K/V: (B, kvh, S, hd) each, post-RoPE."""
    if hasattr(cache, "layers"):
        layer = cache.layers[-1]
        return layer.keys, layer.values
    return cache.key_cache[-1], cache.value_cache[-1]


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x names the cache argument `cache`; before, `past_key_values`."""
    kind = type(model)
    if kind not in _CACHE_KW:
        import inspect

        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _CACHE_KW[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[kind]


_CACHE_KW: dict[type, str] = {}


@torch.no_grad()
def target_logits(model: nn.Module, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
    """ids (1, T) appended to ``cache`` -> logits (T, V) in fp32; ``last_only``: (1, V), and the
    model computes the last position's logits only (a long prompt's prefill never holds
    T x V logits: 32k x 152k in fp32 would be 20 GB)."""
    kw = {_cache_kwarg(model): cache}
    if last_only:
        kw.update(_keep_last_kwarg(model))
    out = model(input_ids=ids, use_cache=True, **kw)
    logits = out.logits[0]
    if last_only:
        logits = logits[-1:]              # a model without the keep argument still gave (T, V)
    return logits.float()


def _keep_last_kwarg(model: nn.Module) -> dict:
    """transformers >= 4.50 calls it logits_to_keep, 4.45-4.49 num_logits_to_keep."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


# ----------------------------------------------------------------------------- proposers

class Proposer(Protocol):
    def start(self, prompt: torch.Tensor, cache) -> None:
        """Called once after the target's prefill of ``prompt`` (1, P)."""

    def propose(self, seq: torch.Tensor, cache, gamma: int) -> list[int]:
        """``seq`` (1, n) every verified token (the last one not yet in ``cache``) -> gamma ids."""

    def rollback(self, valid: int) -> None:
        """Only the first ``valid`` tokens of the sequence are still valid."""


class GlideProposer:
    """Greedy proposals from a GLIDE draft block on top of a frozen HF target."""

    def __init__(self, target: TargetWrapper, draft: GlideDraft):
        self.target, self.draft = target, draft
        self.window = draft.config.sliding_window + 1   # keys a query sees, its own included
        self.k: torch.Tensor | None = None      # (1, kvh, W + 1, hd) draft self-attn keys, post-RoPE
        self.v: torch.Tensor | None = None      # (1, kvh, W + 1, hd)
        self.end = 0                            # positions [end - W - 1, end) are cached

    def start(self, prompt: torch.Tensor, cache) -> None:
        P = prompt.shape[1]
        lo = max(0, P - self.window)            # older keys are outside every future window
        self.k = self.v = None
        self.end = lo
        self._append_kv(prompt[:, lo:])                # P >= 1: at least one token

    def rollback(self, valid: int) -> None:
        if valid < self.end:
            cut = self.end - valid
            self.k, self.v = self.k[:, :, :-cut], self.v[:, :, :-cut]
            self.end = valid
        if self.k is not None and self.k.shape[2] > self.window:
            self.k, self.v = self.k[:, :, -self.window:], self.v[:, :, -self.window:]

    @torch.no_grad()
    def propose(self, seq: torch.Tensor, cache, gamma: int) -> list[int]:
        tk, tv = last_layer_kv(cache)           # (1, kvh, S, hd): the target's verified tokens
        n = seq.shape[1]
        if self.end > n - 1:
            raise RuntimeError(f"draft state covers {self.end} tokens but only {n} are verified")
        new = seq[:, self.end:]                 # (1, m) tokens the draft has not seen yet
        out: list[torch.Tensor] = []
        for _ in range(gamma):
            h = self._step(new, tk, tv)         # (1, 1, H)
            tok = self._logits(h).argmax(-1)    # () on the device: the next step reads it there
            out.append(tok)
            new = tok.view(1, 1).to(seq.dtype)
        return torch.stack(out).tolist()        # one host sync per proposal, not one per token

    # -- internals

    def _embed(self, ids: torch.Tensor, pos0: int):
        h = self.target.embed(ids).to(self.draft.input_layernorm.weight.dtype)       # (1, m, H)
        pos = torch.arange(pos0, pos0 + ids.shape[1], device=ids.device)[None]     # (1, m)
        cos, sin = self.target.rotary(pos, h)                                        # (1, m, hd)
        return h, cos, sin

    def _append_kv(self, ids: torch.Tensor):
        """Self-attention K/V of ``ids`` (1, m) at positions end.. (they depend on token + position
        only); returns the last token's (embedding, normed input, cos, sin) for a query."""
        h, cos, sin = self._embed(ids, self.end)                                     # (1, m, H), (1, m, hd)
        sa = self.draft.self_attn
        x = self.draft.input_layernorm(h)
        k = apply_rope(sa.heads(sa.k_proj, x), cos, sin)                             # (1, kvh, m, hd)
        v = sa.heads(sa.v_proj, x)                                                   # (1, kvh, m, hd)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.end += ids.shape[1]
        return h[:, -1:], x[:, -1:], cos[:, -1:], sin[:, -1:]

    def _step(self, ids: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` (1, m) at positions end..end+m-1; the draft's output at the last one (1, 1, H)."""
        d = self.draft
        h, x, cos, sin = self._append_kv(ids)                                        # (1, 1, H) x2, (1, 1, hd) x2
        # self-attention: the query sees keys pos - W .. pos (W + 1 of them)
        sa = d.self_attn
        q = apply_rope(sa.heads(sa.q_proj, x), cos, sin)                             # (1, nh, 1, hd)
        y = attn_ladder.attention(q, self.k[:, :, -self.window:], self.v[:, :, -self.window:], causal=False)
        h = h + sa.out(y)
        # cross-attention onto every K/V the target has cached
        ca = d.cross_attn
        q = apply_rope(ca.heads(ca.q_proj, d.post_self_attention_layernorm(h)), cos, sin)
        if tk.shape[2] > 0:
            h = h + ca.out(attn_ladder.attention(q, tk, tv, causal=False))
        return h + d.mlp(d.post_cross_attention_layernorm(h))                       # (1, 1, H)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.target.lm_head.weight
        return (h[0, -1].to(w.dtype) @ w.T).float()                                  # (V,)


# ----------------------------------------------------------------------------- decoding loops

def _check_prompt(prompt: torch.Tensor) -> torch.Tensor:
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty (1, P) tensor of token ids (got {tuple(prompt.shape)})")
    return prompt


def _finish(tokens: list[int], max_new_tokens: int, eos) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) and at max_new_tokens; True when decoding is over.
    ``eos``: one token id, a collection of them (EOS and end of turn), or None."""
    stops = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    hit = next((i for i, t in enumerate(tokens) if t in stops), None)
    if hit is not None:
        return tokens[: hit + 1][:max_new_tokens], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


finish_tokens = _finish      # the stop rule, for longspec.measure.chainwalk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoding:
    """The opening and closing every decode loop shares: the prompt checked (a (1, P) tensor), a new
    KV cache, the prefill timed up to `prefilled(first)` (the proposer started on the prompt, the
    device synchronised), the stop rule (`finish`), and the result timed from the prefill on
    (`result`, after a last synchronisation)."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None):
        self.prompt = _check_prompt(prompt)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.max_new_tokens, self.eos = max_new_tokens, eos_token_id
        self.cache = new_cache()
        self.t0 = self.t1 = time.perf_counter()

    def prefilled(self, first: int, proposer=None) -> tuple[torch.Tensor, list[int], bool]:
        """After the prefill gave `first`: (the verified sequence (1, P + 1), tokens, done)."""
        if proposer is not None:
            proposer.start(self.prompt, self.cache)
        _sync(self.prompt.device)
        self.t1 = time.perf_counter()
        tokens, done = self.finish([first])
        return torch.cat([self.prompt, self.prompt.new_tensor([[first]])], dim=1), tokens, done

    def finish(self, tokens: list[int]) -> tuple[list[int], bool]:
        return _finish(tokens, self.max_new_tokens, self.eos)

    def result(self, tokens: list[int], forwards: int, accepted: list[int]) -> DecodeResult:
        _sync(self.prompt.device)
        return DecodeResult(tokens, forwards, accepted, prefill_s=self.t1 - self.t0,
                            decode_s=time.perf_counter() - self.t1)


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                  eos_token_id: int | None = None) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per token."""
    run = Decoding(prompt, max_new_tokens, eos_token_id)
    prompt, cache = run.prompt, run.cache
    tok = int(target_logits(model, prompt, cache, last_only=True)[-1].argmax())
    _, tokens, done = run.prefilled(tok)
    forwards = 0
    while not done:
        tok = int(target_logits(model, prompt.new_tensor([[tok]]), cache)[-1].argmax())
        forwards += 1
        tokens, done = run.finish(tokens + [tok])
    return run.result(tokens, forwards, [1] * forwards)


@torch.no_grad()
def speculative_decode(model: nn.Module, proposer: Proposer, prompt: torch.Tensor, gamma: int,
                       max_new_tokens: int, eos_token_id: int | None = None) -> DecodeResult:
    """Greedy speculative decoding; the output equals greedy_decode's (see the module docstring)."""
    prompt = _check_prompt(prompt)
    if gamma < 1:
        raise ValueError("gamma must be >= 1")
    run = Decoding(prompt, max_new_tokens, eos_token_id)
    cache = run.cache
    first = int(target_logits(model, prompt, cache, last_only=True)[-1].argmax())
    seq, tokens, done = run.prefilled(first, proposer)                              # seq: (1, n) verified
    accepted: list[int] = []
    while not done:
        drafts = proposer.propose(seq, cache, gamma)                                # gamma ids
        block = torch.cat([seq[:, -1:], seq.new_tensor([drafts])], dim=1)           # (1, gamma + 1)
        verify = target_logits(model, block, cache).argmax(-1).tolist()             # gamma + 1 ids
        k = 0
        while k < gamma and drafts[k] == verify[k]:
            k += 1
        new = drafts[:k] + [verify[k]]
        accepted.append(k + 1)
        seq = torch.cat([seq, seq.new_tensor([new])], dim=1)
        crop_cache(cache, seq.shape[1] - 1)            # the new bonus token is not in the cache
        proposer.rollback(seq.shape[1] - 1)
        tokens, done = run.finish(tokens + new)
    return run.result(tokens, len(accepted), accepted)


__all__ = [
    "DecodeResult", "Decoding", "Proposer", "GlideProposer", "greedy_decode", "speculative_decode",
    "new_cache", "cache_length", "crop_cache", "last_layer_kv", "target_logits", "finish_tokens",
]
