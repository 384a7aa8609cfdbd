"""Simulated acceptance length (tau) while a stage trains, and the stage's best draft.

Held-out records: the last records of the stage's prepared data, taken from the end until
`eval_tokens` tokens are reached (the last one taken is cut to fit; at most half of the records).
The trainer's sampler draws from the records before them only (`TrainPart`), so they are never
trained on. The choice depends on the data and `eval_tokens` alone, so a resumed run gets the same
set: heldout.json in the run folder records it (range, token counts, sha256 of the tokens) and a
resume that would hold out other tokens is refused.

The estimate, every `eval_steps` optimizer steps (and at step 0 and the last step): one target
forward over a held-out record gives the target's greedy token at every position t; the draft,
teacher-forced on the same tokens, cross-attends to the target's last-layer K/V lagged by k
(keys up to t - k, as in training with the noisy lag and as the k-th token of a chain is drafted
in decoding), k = 1..eval_gamma, and gives its greedy token. alpha_k = the fraction of positions
t >= gamma where the two agree; tau = 1 + sum_k prod_{i<=k} alpha_i (docs/DESIGN.md says why this
estimates eval's chain tau, and its bias). Each rank measures its share of the records; the counts
are all-reduced, and every rank runs the same number of forwards (ZeRO-3 gathers parameters in
each one). Rank 0 writes one `{"record": "simtau", ...}` metrics line, and, when tau beats the best
so far, the draft into best/ and best.json (its step, tau and sha256) after it.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

from longspec_cli.core import runfolder
from longspec_cli.core.atomic import atomic_write_json

ARGMAX_ROWS = 1024          # rows of hidden states per vocabulary projection (no (T, V) logits at 32k)
MIN_PIECE = 16              # a held-out record is not cut shorter than this


class HeldoutChanged(Exception):
    """A resume would evaluate other held-out tokens than the run began with."""


@dataclass(frozen=True)
class Heldout:
    start: int                  # records [start, start + records) are held out
    records: int
    lengths: tuple[int, ...]    # tokens used of each held-out record (the last one may be cut)
    sha256: str                 # of those tokens
    eval_tokens: int

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def to_json(self) -> dict:
        return {**asdict(self), "lengths": list(self.lengths), "tokens": self.tokens}


def choose_heldout(offsets, token_array, eval_tokens: int) -> Heldout | None:
    """The held-out records of a prepared dataset (its `offsets` and flat `tokens`): the last ones,
    up to `eval_tokens` tokens, at most half of the records. None when there are none."""
    n = len(offsets) - 1
    if eval_tokens <= 0 or n < 2:
        return None
    left, lengths, i = eval_tokens, [], n - 1
    while i >= (n + 1) // 2 and left >= MIN_PIECE:
        size = int(offsets[i + 1]) - int(offsets[i])
        use = min(size, left)
        lengths.append(use)
        left -= use
        i -= 1
    if not lengths:
        return None
    start = i + 1
    h = hashlib.sha256()
    for j, use in enumerate(reversed(lengths)):
        a = int(offsets[start + j])
        h.update(bytes(token_array[a:a + use].astype("<i8").tobytes()))
    return Heldout(start, len(lengths), tuple(reversed(lengths)), h.hexdigest(), eval_tokens)


class TrainPart:
    """The records the trainer's sampler may draw: the dataset without its held-out tail."""

    def __init__(self, dataset, n: int):
        self.dataset, self.n = dataset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.dataset[i]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def chain_tau(alpha: list[float]) -> float:
    """1 + sum_k prod_{i<=k} alpha_i: the expected tokens per target forward of a greedy chain."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return tau


def agreement_counts(module, batches: list[tuple[Any, Any]], gamma: int, device) -> Any:
    """float64 (2, gamma): agreeing positions and positions counted per lag k = 1..gamma, over
    `batches` = [(token ids (B, T) right-padded, counted tokens per row (B,): 0 = a stand-in row)].
    Position t of a row counts when gamma <= t < its counted length. `module` is the training model
    (longspec.model.GlideModel); under ZeRO-3 every rank must pass the same number of batches."""
    import torch

    from longspec.zero import gathered

    counts = torch.zeros(2, gamma, dtype=torch.float64)
    target, draft = module.target, module.draft
    dtype = draft.input_layernorm.weight.dtype
    with torch.no_grad():
        for ids, lengths in batches:
            B, T = ids.shape
            ids = ids.to(device)
            t = torch.arange(T, device=device)
            real = t.unsqueeze(0) < lengths.to(device).unsqueeze(1)              # (B, T)
            mask = real.long() if bool((~real).any()) else None
            pos = t.unsqueeze(0).expand(B, T)                                     # (B, T)
            tgt = target(ids, pos, attention_mask=mask)
            hidden = target.embed(ids).to(dtype)                                  # (B, T, H)
            rope = target.rotary(pos, hidden)
            outs = draft_all_lags(draft, hidden, tgt.k, tgt.v, rope, mask, gamma)
            keep = real & (t.unsqueeze(0) >= gamma)                                # (B, T)
            # Every rank enters the gather (a ZeRO-3 collective), a stand-in batch with nothing to count too.
            with gathered(target.lm_head.weight) as w:
                if not bool(keep.any()):
                    continue
                want = _argmax(tgt.last_hidden[keep], w)                          # (N,)
                for k, h in enumerate(outs):
                    counts[0, k] += float((_argmax(h[keep], w) == want).sum())
                    counts[1, k] += float(want.numel())
    return counts


def draft_all_lags(draft, hidden, target_k, target_v, rope, mask, gamma: int) -> list:
    """GlideDraft.forward at cross-attention lags 1..gamma (a list of (B, T, H)), sharing what does not depend on the lag
    (self-attention, the cross-attention queries); then per lag the cross-attention, its output
    projection and the MLP. The same values as gamma calls of draft(...)
    (tests/trainer/test_simtau.py holds them equal)."""
    from longspec import kernels
    from longspec.model import apply_rope

    cos, sin = rope
    x = draft.input_layernorm(hidden)
    sa = draft.self_attn
    q = apply_rope(sa.heads(sa.q_proj, x), cos, sin)
    k = apply_rope(sa.heads(sa.k_proj, x), cos, sin)
    y = kernels.attention(q, k, sa.heads(sa.v_proj, x), causal=True, window=draft.config.sliding_window,
                          key_padding_mask=mask)
    hidden = hidden + sa.out(y)
    ca = draft.cross_attn
    q = apply_rope(ca.heads(ca.q_proj, draft.post_self_attention_layernorm(hidden)), cos, sin)
    outs = []
    for lag in range(1, gamma + 1):          # one lag at a time: the MLP's activations of one forward
        h = hidden + ca.out(kernels.attention(q, target_k, target_v, causal=True, lag=lag, key_padding_mask=mask))
        outs.append(h + draft.mlp(draft.post_cross_attention_layernorm(h)))
    return outs


def _argmax(hidden, weight):
    import torch

    rows = [torch.argmax(hidden[a:a + ARGMAX_ROWS].float() @ weight.float().t(), dim=-1)
            for a in range(0, hidden.shape[0], ARGMAX_ROWS)]
    return torch.cat(rows)


class SimTau:
    """One rank's simulated-tau evaluation and best-draft keeping (`longspec.train` calls it)."""

    def __init__(self, conf: dict, dataset, out, rank: int, world: int, resumed: bool):
        self.every, self.gamma = int(conf["eval_steps"]), int(conf["eval_gamma"])
        self.out, self.rank, self.world, self.resumed = out, rank, world, resumed
        self.dataset, self.batch = dataset, int(conf["per_gpu_train_batch_size"])
        self.pad_id = 0
        self.heldout = choose_heldout(dataset.offsets, dataset.tokens, int(conf["eval_tokens"])) \
            if hasattr(dataset, "offsets") else None
        self.train_part = dataset if self.heldout is None else TrainPart(dataset, self.heldout.start)
        recorded, _ = runfolder.read_json(out.dir / runfolder.HELDOUT)
        if resumed and recorded is None:
            self.heldout, self.train_part = None, dataset    # a run begun without a held-out set keeps its sampler
        elif resumed:
            now = self.heldout.to_json() if self.heldout else None
            if now is None or recorded.get("sha256") != now["sha256"] or recorded.get("start") != now["start"]:
                raise HeldoutChanged(
                    f"{out.dir}: the held-out records of the simulated-tau evaluation differ from those the run "
                    f"began with ({out.dir / runfolder.HELDOUT}): the data or eval_tokens changed")
        best = out.read.best() if resumed else None
        self.best_tau = float(best["tau"]) if best else -math.inf

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.heldout is not None

    def commit(self) -> None:
        """Rank 0, before the first step: a fresh run drops an earlier run's best/ and writes heldout.json."""
        if self.rank != 0:
            return
        d = self.out.dir
        if not self.resumed:
            (d / runfolder.BEST_INFO).unlink(missing_ok=True)
            shutil.rmtree(d / runfolder.BEST_DIR, ignore_errors=True)
        if self.heldout is not None:
            atomic_write_json(d / runfolder.HELDOUT, self.heldout.to_json())
        else:
            (d / runfolder.HELDOUT).unlink(missing_ok=True)

    def batches(self) -> list[tuple[Any, Any]]:
        """This rank's share of the held-out records (round-robin), in batches of the training
        micro-batch size; stand-in batches (counted length 0) so every rank runs as many forwards."""
        import torch

        h = self.heldout
        items = [(h.start + j, use) for j, use in enumerate(h.lengths)]
        mine = items[self.rank::self.world]
        per_rank = math.ceil(len(items) / self.world)
        out = []
        for a in range(0, per_rank, self.batch):
            chunk = mine[a:a + self.batch] or items[:1]
            rows = [self.dataset[i]["input_ids"][:use] for i, use in chunk]
            ids = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, :len(r)] = r
            counted = torch.tensor([len(r) if mine[a:a + self.batch] else 0 for r in rows])
            out.append((ids, counted))
        return out

    def maybe(self, session) -> bool:
        """Evaluate when the step is due (every rank calls it at the same steps). True when it ran."""
        step = session.step
        if not self.enabled or not (step % self.every == 0 or step == session.total):
            return False
        t0, h = time.time(), self.heldout
        self.pad_id = session.pad_id
        counts = agreement_counts(session.engine.module, self.batches(), self.gamma, session.engine.device)
        import torch

        torch.distributed.all_reduce(counts)
        alpha = [float(a / n) if n > 0 else 0.0 for a, n in zip(counts[0].tolist(), counts[1].tolist())]
        tau = chain_tau(alpha)
        record = {"record": runfolder.SIMTAU, "step": int(step), "total_steps": int(session.total),
                  "tau": round(tau, 4), "alpha": [round(a, 4) for a in alpha], "gamma": self.gamma,
                  "positions": int(counts[1, 0].item()), "records": h.records}
        best = tau > self.best_tau
        if best:
            self.best_tau = tau
            self._save_best(session, step, tau, alpha)
        record["best"] = best
        if self.rank == 0:
            self.out.record({**record, "eval_s": round(time.time() - t0, 3)})
            from longspec.dist import print0

            print0(f"[{session.conf['stage']}] step {step}: simulated tau {tau:.3f} (alpha "
                   + " ".join(f"{a:.2f}" for a in alpha) + ")" + (", best so far: best/" if best else ""))
        return True

    def _save_best(self, session, step: int, tau: float, alpha: list[float]) -> None:
        """The draft into best/ (weights first, best.json last, both atomic). Collective under ZeRO-3."""
        from longspec.checkpoint import save_draft
        from longspec_cli.core.atomic import sha256_file

        state = session.draft_state()
        if self.rank != 0:
            return
        d = self.out.dir
        weights = save_draft(state, d / runfolder.BEST_DIR)
        atomic_write_json(d / runfolder.BEST_INFO, {
            "stage": session.conf["stage"], "step": int(step), "tau": round(tau, 4),
            "alpha": [round(a, 4) for a in alpha], "gamma": self.gamma,
            "weights": str(weights.relative_to(d)), "sha256": sha256_file(weights),
            "config_sha256": session.origin.config_sha256, "time": time.time()})
