"""Tree speculative decoding with a GLIDE draft (greedy and sampled), and plain sampling.

Tree shape ``(w_1, ..., w_D)``, as in the paper's inference (default 4 16 16 16 16): level d of
the token tree holds ``w_d`` nodes IN TOTAL (not per parent); D is the depth, the most draft
tokens one round can accept. Level 1 is the draft's top ``w_1`` tokens after the last verified
token. Level d+1 takes the best ``w_{d+1}`` (parent, token) pairs over ALL level-d parents, a
pair scored by the sum of draft log-probabilities along its path (a beam over the level), so
likely branches get many children and unlikely ones none. ``(1,) * gamma`` is the chain.

One round (batch 1):

    verified  x_0 .. x_{n-1}       target cache holds x_0 .. x_{n-2}; x_{n-1} is the tree's root
    draft     level by level: the draft block reads the target's cached K/V (cross-attention)
              and, in its windowed self-attention, its own cache plus the node's tree ancestors;
              a node at depth d sits at position n - 1 + d
    verify    ONE target forward of [root, nodes...] with position ids (n - 1) + depth and a
              tree mask over the cached prefix (longspec.decode.tree_attn): logits at every node
    accept    greedy: walk from the root, at each node to the child equal to the target's argmax;
              the new tokens are that path plus the target's token after its end (the bonus)
    rollback  the target cache keeps the root and the accepted path (their K/V moved into place),
              the draft keeps its own cache (it catches up on the accepted tokens next round)

tau = tokens per verify forward = accepted draft tokens + 1 (the bonus token), averaged over the
verify forwards: the paper's chain script counts the same; its tree script also counts the
prefill as one forward that yields one token, which lowers tau slightly for short outputs (by
(tau - 1) / (rounds + 1)). Greedy output equals the target's greedy output token for token (up
to floating point; compare in fp32).

Sampling (temperature T > 0), what this module implements and why it is exact: the target's
distribution at a node is p = softmax(logits / T), the draft's q = softmax(draft logits / T).
Children of a node are drawn from q WITHOUT replacement (Gumbel top-k, in draw order); how many
children a node gets is fixed by the same beam over the level before they are drawn (from the
path scores and the node's own sorted q, never from the drawn tokens), so it cannot bias them.
Verification is recursive rejection sampling (SpecInfer's multi-candidate rule, in its
without-replacement form): try the children in draw order; accept child x with probability
min(1, p(x) / q(x)); on a rejection set p <- norm(max(p - q, 0)) and remove x from q
(renormalised); when every child is rejected, or the node has none, draw the next token from
the current p. Each step is an exact speculative-sampling step for its own target, so the token
emitted after every accepted prefix follows the target's distribution. With one child per node
(the chain) it is the Leviathan / Chen rule. (The paper's script samples children as ranked
top-k and never updates q after a rejection; that is not exact, so it is not reproduced.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn as nn

from longspec.decode import tree_attn
from longspec.model.glide import apply_rope
from longspec.decode.chain import (
    DecodeResult, Decoding, GlideProposer, _cache_kwarg, _check_prompt, cache_length, crop_cache,
    last_layer_kv, target_logits,
)

DEFAULT_TREE_SHAPE = (4, 16, 16, 16, 16)
MAX_TREE_NODES = 1024


def parse_tree_shape(values: Iterable[int]) -> tuple[int, ...]:
    """Validated tree shape (nodes per level); ValueError with the reason."""
    shape = tuple(int(v) for v in values)
    if not shape:
        raise ValueError("tree shape needs at least one level")
    if any(w < 1 for w in shape):
        raise ValueError(f"tree shape {list(shape)}: every level needs >= 1 node")
    if sum(shape) > MAX_TREE_NODES:
        raise ValueError(f"tree shape {list(shape)}: {sum(shape)} nodes, at most {MAX_TREE_NODES}")
    return shape


def chain_shape(gamma: int) -> tuple[int, ...]:
    return (1,) * gamma


# ----------------------------------------------------------------------------- the tree

@dataclass
class TokenTree:
    """Node 0 is the root (the last verified token); nodes are stored level by level."""
    tokens: list[int]
    parent: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    children: list[list[int]] = field(default_factory=lambda: [[]])
    q: dict[int, torch.Tensor] = field(default_factory=dict)   # node -> draft distribution (V,), sampling only
    _mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(int(token))
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """(N, N) bool: [i, j] = node j is node i or one of its ancestors (cached until the tree grows)."""
        n = len(self.tokens)
        if self._mask is None or self._mask.shape[0] != n:
            idx, par, dep = torch.arange(n), torch.tensor(self.parent), torch.tensor(self.depth)
            mask = torch.zeros(n, n, dtype=torch.bool)
            mask[idx, idx] = True
            for d in range(1, int(dep.max()) + 1):            # parents come first: one level at a time
                rows = idx[dep == d]
                mask[rows] |= mask[par[rows]]
            self._mask = mask
        return self._mask.to(device)


def grow_level(logp: torch.Tensor, scores: torch.Tensor, width: int, sample: bool,
               generator: torch.Generator | None) -> list[tuple[int, int, float]]:
    """The next level: ``width`` (parent row, token, path score) picks from ``logp`` (m, V), the
    log of the proposal at each of the m parents, and their path ``scores`` (m,). The beam picks
    the best ``width`` pairs; greedy keeps those tokens, sampling keeps only how many each parent
    got and draws that many tokens from its q without replacement (see the module docstring)."""
    m, V = logp.shape
    k = min(width, V)
    top_lp, top_tok = logp.topk(k, dim=-1)                                   # (m, k) each
    cand = scores.to(logp.device)[:, None] + top_lp                          # (m, k)
    best = cand.flatten().topk(min(width, cand.numel())).indices            # (w,)
    rows, ranks = (best // k).tolist(), (best % k).tolist()
    if not sample:
        return [(r, int(top_tok[r, j]), float(cand[r, j])) for r, j in zip(rows, ranks)]
    picks = []
    counts = torch.bincount(torch.tensor(rows, dtype=torch.long), minlength=m).tolist()
    for r, c in enumerate(counts):
        finite = int(torch.isfinite(logp[r]).sum())
        c = min(c, finite)
        if c == 0:
            continue
        u = torch.rand(V, generator=generator).clamp_min(1e-20).to(logp.device)     # CPU draws: seedable
        gumbel = -torch.log(-torch.log(u))
        drawn = (logp[r] + gumbel).topk(c).indices.tolist()                 # draw order
        picks += [(r, t, float(scores[r] + logp[r, t])) for t in drawn]
    return picks


def _log_proposal(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature if temperature > 0 else logits.float(), dim=-1)


# ----------------------------------------------------------------------------- proposers

class TreeProposer(Protocol):
    def start(self, prompt: torch.Tensor, cache) -> None: ...

    def propose_tree(self, seq: torch.Tensor, cache, shape: Sequence[int], temperature: float,
                     generator: torch.Generator | None) -> TokenTree:
        """``seq`` (1, n) verified tokens (the last one not yet in ``cache``) -> a tree rooted at it."""

    def rollback(self, valid: int) -> None: ...


class GlideTreeProposer(GlideProposer):
    """The GLIDE draft growing a token tree; its self-attention state is GlideProposer's."""

    @torch.no_grad()
    def propose_tree(self, seq, cache, shape, temperature=0.0, generator=None) -> TokenTree:
        tk, tv = last_layer_kv(cache)                        # (1, kvh, S, hd) the target's verified tokens
        n = seq.shape[1]
        if self.end > n - 1:
            raise RuntimeError(f"draft state covers {self.end} tokens but only {n} are verified")
        h = self._step(seq[:, self.end:], tk, tv)            # catch up + the root at position n - 1
        tree = TokenTree([int(seq[0, -1])])
        logits = self._logits_rows(h[0])                     # (1, V)
        parents, scores = [0], torch.zeros(1, device=logits.device)    # path scores, beside the logits
        tree_kv: list[torch.Tensor] = []                     # draft self-attn K, V of nodes 1..N
        for d, width in enumerate(shape, 1):
            logp = _log_proposal(logits, temperature)        # (m, V)
            if temperature > 0:
                for row, node in enumerate(parents):
                    tree.q[node] = logp[row].exp()
            picks = grow_level(logp, scores, width, temperature > 0, generator)
            level = [tree.add(parents[r], tok) for r, tok, _ in picks]
            scores = torch.tensor([s for _, _, s in picks], device=logits.device)
            if d == len(shape) or not level:
                break
            h = self._tree_step(tree, level, n - 1 + d, tk, tv, tree_kv)    # (1, m, H)
            logits, parents = self._logits_rows(h[0]), level
        return tree

    def _tree_step(self, tree: TokenTree, level: list[int], pos: int, tk, tv, tree_kv: list) -> torch.Tensor:
        """Draft outputs (1, m, H) at the ``level`` nodes (all at position ``pos``)."""
        d, W = self.draft, self.window
        ids = torch.tensor([[tree.tokens[i] for i in level]], device=tk.device)           # (1, m)
        h = self.target.embed(ids).to(d.input_layernorm.weight.dtype)                     # (1, m, H)
        cos, sin = self.target.rotary(torch.full_like(ids, pos), h)                       # (1, m, hd)
        sa = d.self_attn
        x = d.input_layernorm(h)
        k_new = apply_rope(sa.heads(sa.k_proj, x), cos, sin)                              # (1, kvh, m, hd)
        v_new = sa.heads(sa.v_proj, x)
        if tree_kv:
            tree_kv[0], tree_kv[1] = torch.cat([tree_kv[0], k_new], 2), torch.cat([tree_kv[1], v_new], 2)
        else:
            tree_kv += [k_new, v_new]
        Lc, N = self.k.shape[2], len(tree) - 1
        key_pos = torch.cat([torch.arange(self.end - Lc, self.end),
                             torch.tensor(tree.depth[1:]) + (pos - tree.depth[level[0]])])  # (Lc + N,)
        visible = (pos - key_pos < W)[None].repeat(len(level), 1)                          # the window
        visible[:, Lc:] &= tree.ancestor_mask()[level][:, 1:]                              # the tree
        q = apply_rope(sa.heads(sa.q_proj, x), cos, sin)                                   # (1, nh, m, hd)
        keys, values = torch.cat([self.k, tree_kv[0]], 2), torch.cat([self.v, tree_kv[1]], 2)
        h = h + sa.out(tree_attn.masked_attention(q, keys, values, visible.to(q.device)))
        ca = d.cross_attn
        q = apply_rope(ca.heads(ca.q_proj, d.post_self_attention_layernorm(h)), cos, sin)
        if tk.shape[2] > 0:
            from longspec.model import attention as attn_ladder

            h = h + ca.out(attn_ladder.attention(q, tk, tv, causal=False))
        return h + d.mlp(d.post_cross_attention_layernorm(h))                             # (1, m, H)

    def _logits_rows(self, h: torch.Tensor) -> torch.Tensor:
        w = self.target.lm_head.weight
        return (h.to(w.dtype) @ w.T).float()                                              # (m, V)


# ----------------------------------------------------------------------------- target side

@torch.no_grad()
def prefill_logits(model: nn.Module, prompt: torch.Tensor, cache) -> torch.Tensor:
    """Prefill ``prompt`` (1, P) into ``cache``; only the last position's logits (V,) fp32."""
    return target_logits(model, prompt, cache, last_only=True)[-1]


@torch.no_grad()
def verify_tree(model: nn.Module, tree: TokenTree, cache) -> torch.Tensor:
    """One target forward over the whole tree on top of ``cache``: logits (N, V) fp32 per node.
    The cache grows by N (the tree's K/V, in node order; keep_path drops the rejected ones)."""
    P = cache_length(cache)
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    ids = torch.tensor([tree.tokens], device=dev)                                       # (1, N)
    pos = (torch.tensor(tree.depth) + P)[None].to(dev)                                  # (1, N)
    anc = tree.ancestor_mask(dev)
    mask = tree_attn.verify_mask(P, anc, dtype)
    kwargs = {_cache_kwarg(model): cache}
    # with tree_attn installed (CUDA + flash-attn) the hybrid path runs; else the model's own
    # attention applies the same mask (the reference)
    ctx = tree_attn.verifying(anc, tree_attn.verify_impl(dev, dtype)) if tree_attn.installed(model) \
        else contextlib.nullcontext()
    with ctx:
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **kwargs)
    return out.logits[0].float()


def keep_path(cache, tree_len: int, keep: list[int]) -> None:
    """After verify_tree: of the last ``tree_len`` cache positions keep the nodes ``keep``
    (increasing, node 0 first), moved to the front of the tree block; drop the rest."""
    idx = torch.tensor(keep)
    if keep != list(range(len(keep))):
        for k, v in _cache_layers(cache):
            base = k.shape[2] - tree_len
            for t in (k, v):
                t[:, :, base:base + len(keep)] = t.index_select(2, (idx + base).to(t.device))
    crop_cache(cache, cache_length(cache) - (tree_len - len(keep)))


def _cache_layers(cache):
    if hasattr(cache, "layers"):                                     # transformers 5
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    return list(zip(cache.key_cache, cache.value_cache))


# ----------------------------------------------------------------------------- acceptance

def accept_greedy(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(accepted path nodes, new tokens = their tokens + the bonus token)."""
    best = logits.argmax(-1).tolist()
    path, v = [], 0
    while True:
        nxt = next((c for c in tree.children[v] if tree.tokens[c] == best[v]), None)
        if nxt is None:
            return path, [tree.tokens[c] for c in path] + [best[v]]
        path.append(nxt)
        v = nxt


def accept_sampled(tree: TokenTree, logits: torch.Tensor, temperature: float,
                   generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling down the tree (module docstring)."""
    path, v = [], 0
    while True:
        p = torch.softmax(logits[v].float() / temperature, dim=-1).cpu()               # (V,) only on the path
        chosen = None
        if tree.children[v]:
            q = tree.q[v].float().cpu().clone()
            for c in tree.children[v]:
                x = tree.tokens[c]
                if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
                    chosen = c
                    break
                residual = (p - q).clamp_min(0.0)
                q[x] = 0.0
                if float(residual.sum()) > 0:
                    p = residual / residual.sum()
                else:                                        # p == q up to rounding: x was a near-miss
                    p[x] = 0.0
                    p = p / p.sum()
                if float(q.sum()) <= 0:
                    break
                q = q / q.sum()
        if chosen is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return path, [tree.tokens[c] for c in path] + [bonus]
        path.append(chosen)
        v = chosen


def _first_token(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    return int(torch.multinomial(p, 1, generator=generator))


# ----------------------------------------------------------------------------- decoding loops

@torch.no_grad()
def tree_decode(model: nn.Module, proposer: TreeProposer, prompt: torch.Tensor, shape: Sequence[int],
                max_new_tokens: int, eos_token_id: int | None = None, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> DecodeResult:
    """Tree speculative decoding (greedy at temperature 0, else speculative sampling)."""
    prompt = _check_prompt(prompt)
    shape = parse_tree_shape(shape)
    run = Decoding(prompt, max_new_tokens, eos_token_id)
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    cache = run.cache
    first = _first_token(prefill_logits(model, prompt, cache), temperature, generator)
    seq, tokens, done = run.prefilled(first, proposer)                              # seq: (1, n) verified
    accepted: list[int] = []
    while not done:
        tree = proposer.propose_tree(seq, cache, shape, temperature, generator)
        logits = verify_tree(model, tree, cache)                                   # (N, V)
        if temperature > 0:
            path, new = accept_sampled(tree, logits, temperature, generator)
        else:
            path, new = accept_greedy(tree, logits)
        keep_path(cache, len(tree), [0] + path)            # root + accepted nodes; the bonus is not cached
        accepted.append(len(new))
        seq = torch.cat([seq, seq.new_tensor([new])], dim=1)
        proposer.rollback(seq.shape[1] - 1)
        tokens, done = run.finish(tokens + new)
    return run.result(tokens, len(accepted), accepted)


@torch.no_grad()
def sample_decode(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float,
                  eos_token_id: int | None = None, generator: torch.Generator | None = None) -> DecodeResult:
    """Plain sampling from the target, one forward per token (temperature 0 = greedy)."""
    run = Decoding(prompt, max_new_tokens, eos_token_id)
    prompt, cache = run.prompt, run.cache
    tok = _first_token(prefill_logits(model, prompt, cache), temperature, generator)
    _, tokens, done = run.prefilled(tok)
    forwards = 0
    while not done:
        tok = _first_token(prefill_logits(model, prompt.new_tensor([[tok]]), cache), temperature, generator)
        forwards += 1
        tokens, done = run.finish(tokens + [tok])
    return run.result(tokens, forwards, [1] * forwards)


__all__ = [
    "DEFAULT_TREE_SHAPE", "TokenTree", "TreeProposer", "GlideTreeProposer", "parse_tree_shape", "chain_shape",
    "grow_level", "prefill_logits", "verify_tree", "keep_path", "accept_greedy", "accept_sampled",
    "tree_decode", "sample_decode",
]
