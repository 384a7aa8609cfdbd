"""Tau while a stage trains: `eval`'s chain tau for the current draft (longspec.measure.chainwalk), and
the stage's best draft.

Held-out records: the last records of the stage's prepared data, taken from the end until
`eval_tokens` tokens are reached (the last one taken is cut to fit; at most half of the records).
The trainer's sampler draws from the records before them only (`TrainPart`), so they are never
trained on. The choice depends on the data and `eval_tokens` alone, so a resumed run gets the same
set: heldout.json in the run folder records it (range, token counts, sha256 of the tokens) and a
resume that would hold out other tokens is refused. `eval` replays the sampler over the records
before them, so its default prompts come from these never-drawn records first.

When: at step 0, at the last step, and every `eval_steps` optimizer steps at the closest, spaced
further so that tau stays within `eval_share` of the stage's time (default 5%). Two rules, the
stricter wins: the pace (each walk is timed, not the first, which also ran the target over the
held-out rows the later walks reuse, so the next one is timed instead; a regular evaluation waits
until the steps since the last one took long enough for it), and the account (a regular
evaluation waits until everything tau spent, the continuations and the first walk included, is
within its share of the stage's time so far; the log says when one is deferred). Every rank
decides alike: the largest need over the ranks. The evaluations at step 0 and at the last step
are always made, so a stage much shorter than its first evaluation stays over its share.
`eval_share: 0` evaluates every `eval_steps`, as set. The start line says which; each simtau
record carries `every` and the `share` so far.

The figure: the prompts of
`eval`'s default measurement for the run's step count (longspec.measure.prompts.default_prompts, read
from the training_config.yaml eval reads), the target's greedy continuation of each (made once per
run, kept in continuations.json), and the block walk of greedy chain decoding over the draft's
teacher-forced guesses at lags 1..eval_gamma (longspec.measure.chainwalk). Each rank walks its share of the
prompts (at sequence_parallel_size > 1 too: whole prompts, the target under transformers' own
attention, longspec.model.seqpar.plain_attention); the counts are all-reduced, and every rank runs the same number of forwards (ZeRO-3
gathers parameters in each one). Rank 0 writes one `{"record": "simtau", ...}` metrics line (tau,
tau by length bucket, the acceptance rate at each draft position), and, when tau beats the best
so far, the draft into best/ and best.json (its step, tau and sha256) after it. A resume from a
checkpoint older than best.json's step drops that best draft (its steps are rolled back) and
measures the resumed draft at once.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from longspec.runs import runfolder
from longspec.files.atomic import atomic_write_json

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


class SimTau:
    """One rank's tau evaluation while training and best-draft keeping (`longspec.train` calls it)."""

    def __init__(self, conf: dict, dataset, out, rank: int, world: int, resumed: bool):
        self.every, self.gamma = int(conf["eval_steps"]), int(conf["eval_gamma"])
        self.share = float(conf.get("eval_share") or 0.0)   # tau's most share of the stage's time; 0: every eval_steps
        self.gap = self.every                        # steps between evaluations now (a multiple of eval_steps)
        self.last_step: int | None = None            # the last evaluation's step, and when it ended
        self.last_end = 0.0
        self.walk_s: float | None = None             # the last evaluation's walk (what spaces the next ones)
        self.owing = False                           # a regular evaluation is deferred until tau's account allows
        self.spent = 0.0                             # every evaluation's seconds, continuations included
        self.began: float | None = None
        self.out, self.rank, self.world, self.resumed = out, rank, world, resumed
        self.batch = int(conf["per_gpu_train_batch_size"])
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
        self.prompts: list | None = None             # eval's default prompts, once the first evaluation is due
        self.lengths: list[int] = []
        self.conts: dict = {}
        self.frozen: dict = {}                       # the target's outputs of the held-out rows (chainwalk.chain_counts)
        self.continuations_s: float | None = None    # generating them, in this process (None: reused or not yet)
        self.reused = 0                              # continuations read back (whole file, or the prompts shared)
        self.cached = 0                              # of them, from the host's shared cache (longspec.measure.contcache)
        self.redo = False                            # a dropped best: measure the resumed draft at once
        self.target_copy = None                      # a whole copy of the frozen target until the first evaluation
        self.copy_draft = False                      # evaluate a whole copy of the draft (ZeRO-3, when it fits)

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.heldout is not None

    def commit(self) -> None:
        """Rank 0, before the first step: a fresh run drops an earlier run's best/ and writes heldout.json."""
        if self.rank != 0:
            return
        d = self.out.dir
        if not self.resumed:
            self._drop_best()
        if self.heldout is not None:
            atomic_write_json(d / runfolder.HELDOUT, self.heldout.to_json())
        else:
            (d / runfolder.HELDOUT).unlink(missing_ok=True)

    def _drop_best(self) -> None:
        d = self.out.dir
        (d / runfolder.BEST_INFO).unlink(missing_ok=True)
        shutil.rmtree(d / runfolder.BEST_DIR, ignore_errors=True)

    def after_resume(self, step: int) -> None:
        """Every rank, after the checkpoint of ``step`` is loaded: a best draft from a later step
        was made by steps this run rolls back, so it goes, and the resumed draft is measured."""
        import torch

        from longspec.model import comm

        best = self.out.read.best()
        later = torch.tensor([1 if best is not None and int(best.get("step", -1)) > step else 0])
        later = comm.all_reduce(later)                    # every rank decides alike
        if not later.item():
            return
        if self.rank == 0:
            self._drop_best()
            from longspec.training.rank import print0

            print0(f"[resume] best.json was from step {best['step']}, after the checkpoint at step {step}: "
                   "dropped, the resumed draft is measured now")
        self.best_tau, self.redo = -math.inf, self.enabled

    def _prompts(self, session) -> tuple[list | None, list[int], str | None, str | None]:
        """(eval's default prompts for this run, their lengths, the target's path, why there are
        none): rank 0 builds them from the resolved config `eval` reads and the stage's last
        records (longspec.measure.prompts: a cost that does not grow with the data), every rank gets them."""
        from longspec.measure import prompts as P
        from longspec.model import comm
        from longspec.measure.runread import EvalError, read_run

        got: list = [None]
        if self.rank == 0:                          # training_config.yaml and heldout.json are written
            try:
                conf, _ = read_run(self.out.dir)
                prompts, _, lengths = P.default_prompts(
                    Path(conf["train_file"]), session.pre.tokenizer, conf, session.total)
                got = [(prompts, lengths, str(conf["model_name_or_path"]), None)]
            except (EvalError, P.PromptError) as e:
                got = [(None, [], None, e.message)]
        return comm.broadcast_object(got[0], src=0)

    def _prepare(self, session) -> None:
        """eval's default prompts for this run, and the target's greedy continuations: read back
        when continuations.json holds them (the same prompts, or, prompt by prompt, those a run
        before made with the same target, tokens, new-token limit and stops: another max_steps
        changes which records were drawn, not a shared prompt's continuation), then from the host's
        shared cache (any run folder's, by target, dtype and device kind), the rest made now, once,
        and kept in both. Under ZeRO-3,
        whole copies of the frozen target (for the continuations and the first evaluation) and of
        the draft (each evaluation) are used when they fit (longspec.model.zero.whole_copy)."""
        import torch

        from longspec.measure import chainwalk, contcache
        from longspec.model import comm
        from longspec.model.zero import fits_whole, meta_shell, partitioned

        prompts, self.lengths, target, why = self._prompts(session)
        if prompts is None:
            self.prompts, self.every = [], 0
            from longspec.training.rank import print0

            print0(f"[{session.conf['stage']}] note: no tau while training: {why}")
            return
        self.prompts = prompts
        module, device = session.engine.module, session.engine.device
        path = self.out.dir / runfolder.CONTINUATIONS
        digest = chainwalk.continuation_digest(Path(target), self.prompts)
        target_digest = chainwalk.continuation_digest(Path(target), [])
        hf = module.target.model
        reused: dict = {}
        cached: set = set()                               # of them, read from the host's shared cache
        whole = False                                     # continuations.json is this run's already
        shared = contcache.shared_folder(Path(target), str(hf.dtype), device.type,
                                         str(getattr(hf.config, "_attn_implementation", ""))) if self.rank == 0 else None
        if self.rank == 0:                                # the same prompts, or those a run before shared
            conts = chainwalk.read(path, digest, self.prompts, self.gamma)
            whole = conts is not None
            reused = {i: c.tokens for i, c in conts.items()} if conts is not None else \
                chainwalk.read_reusable(path, target_digest, self.prompts, self.gamma)
            from_cache = contcache.read_shared(shared, self.prompts, self.gamma, skip=reused)
            reused, cached = {**reused, **from_cache}, set(from_cache)
        reused, cached = comm.broadcast_object((reused, cached), src=0)
        missing = [i for i in range(len(self.prompts)) if i not in reused]
        shell = meta_shell(lambda: type(hf)(hf.config)) if missing and partitioned(hf) else None
        flags = torch.tensor([0 if missing else 1,
                              int(shell is not None and fits_whole([module.target, module.draft], device)),
                              int(partitioned(module.draft) and fits_whole([module.draft], device))])
        flags = comm.all_reduce(flags, op="min")          # every rank alike
        have, copy_target, self.copy_draft = (bool(f) for f in flags.tolist())
        self.reused, self.cached = len(reused), len(cached)
        if have:
            self.conts = {i: chainwalk.Continuation(t, chainwalk.stop_end(t, p.max_new, p.stops))
                          for i, (p, t) in enumerate(zip(self.prompts, (reused[i] for i in range(len(self.prompts)))))}
            if self.rank == 0 and not whole:              # reused prompt by prompt: the file names this run's
                chainwalk.write(path, digest, self.gamma, self.prompts, self.conts, 0.0, target_digest)
            return
        t0 = time.time()
        if copy_target:
            from longspec.model.target import TargetWrapper
            from longspec.model.zero import whole_copy

            self.target_copy = TargetWrapper(whole_copy(hf, shell, device))
            hf = self.target_copy.model
        mine = chainwalk.generate(hf, [self.prompts[i] for i in missing], self.gamma, device, self.rank, self.world)
        shares = comm.all_gather_object(mine)
        toks = {**reused, **{missing[j]: t for share in shares for j, t in share.items()}}
        self.conts = {i: chainwalk.Continuation(toks[i], chainwalk.stop_end(toks[i], p.max_new, p.stops))
                      for i, p in enumerate(self.prompts)}
        self.continuations_s = time.time() - t0
        if self.rank == 0:
            chainwalk.write(path, digest, self.gamma, self.prompts, self.conts, self.continuations_s, target_digest)
            contcache.write_shared(shared, self.prompts, self.conts, missing)   # what this run decoded

    def _parts(self, session) -> SimpleNamespace:
        """The target and draft one evaluation runs: the whole copies where _prepare chose them."""
        module = session.engine.module
        target = module.target if self.target_copy is None else self.target_copy
        self.target_copy = None                      # the first evaluation is its last use: freed after it
        draft = module.draft
        if self.copy_draft:
            from longspec.model.zero import meta_shell, whole_copy

            draft = whole_copy(draft, meta_shell(lambda: type(draft)(draft.config)), session.engine.device)
        return SimpleNamespace(target=target, draft=draft)

    def plan_text(self) -> str:
        """The start line's words on tau while training."""
        if not self.enabled:
            return "tau while training: off" + (" (eval_steps 0)" if self.every <= 0 else " (no held-out records)")
        if self.share <= 0:
            return f"tau while training: every {self.every} steps (eval_share 0: as set)"
        return (f"tau while training: every {self.every} steps at the closest, spaced after the first evaluation so "
                f"that it stays within {self.share:.0%} of the stage's time (eval_share; 0 = every eval_steps)")

    def _spaced(self, session, step: int) -> bool:
        """Whether a regular evaluation at ``step`` keeps tau within its share. Two rules, the stricter
        wins: the pace (the last walk against the steps' time since it ended: the gap between
        evaluations), and the account (everything tau has spent so far, continuations and the first
        walk included, plus the next walk, within the share of the stage's time so far: what the
        first evaluation cost is earned back before a regular one runs). Collective (every rank
        decides alike)."""
        if self.share <= 0 or self.last_step is None:
            return True
        import torch

        from longspec.model import comm

        now, since = time.time(), step - self.last_step
        step_s = max((now - self.last_end) / max(since, 1), 1e-9)
        walk = self.walk_s or 0.0          # untimed (the first walk also ran the target): the next one is timed
        pace = math.ceil(walk * (1 - self.share) / (self.share * step_s))
        owed = (self.spent + walk) / self.share - walk - (now - self.began)      # training seconds still to earn
        account = since + math.ceil(owed / step_s) if owed > 0 else 0
        need = comm.all_reduce(torch.tensor([pace, account], dtype=torch.int64), op="max").tolist()
        gap = max(self.every, math.ceil(need[0] / self.every) * self.every)
        if gap != self.gap and self.rank == 0:
            from longspec.training.rank import print0

            print0(f"[{session.conf['stage']}] tau every {gap} steps from here: an evaluation walks "
                   f"{walk:.1f} s, a step takes {step_s:.2f} s (eval_share {self.share:.0%})")
        self.gap = gap
        if since >= gap and need[1] > since:
            if not self.owing and self.rank == 0:
                from longspec.training.rank import print0

                over = f"; with the next walk (~{walk:.1f} s) it would be over" if walk else ", over"
                print0(f"[{session.conf['stage']}] tau at step {step} deferred: tau took {self.spent:.1f} s of the "
                       f"stage's {now - self.began:.1f} s so far{over} its {self.share:.0%} (eval_share) until about "
                       f"step {self.last_step + need[1]}")
            self.owing = True
            return False
        self.owing = False
        return since >= gap

    def maybe(self, session, force: bool = False) -> bool:
        """Evaluate when the step is due (every rank calls it at the same steps). True when it ran."""
        step = session.step
        if not self.enabled:
            return False
        if self.began is None:
            self.began = time.time()
        due = force or step == session.total or (step % self.every == 0 and self._spaced(session, step))
        if not due:
            return False
        self.redo = False
        from longspec.measure import chainwalk

        from longspec.model.seqpar import plain_attention

        t0, first = time.time(), self.prompts is None
        with plain_attention():                      # SP: each rank decodes its prompts whole
            if first:
                self._prepare(session)
                if not self.enabled:
                    return False
            t1, fills = time.time(), not self.frozen
            counts = chainwalk.chain_counts(self._parts(session), self.prompts, self.conts, self.lengths,
                                            self.gamma, session.engine.device, self.rank, self.world, self.batch,
                                            self.frozen)
        from longspec.model import comm

        counts = comm.all_reduce(counts)
        fig = chainwalk.figures(counts, self.lengths, self.prompts, self.gamma)
        tau = fig["tau"]
        record = {"record": runfolder.SIMTAU, "step": int(step), "total_steps": int(session.total),
                  "tau": tau, "alpha": fig["alpha"], "gamma": self.gamma, "by_length": fig["by_length"],
                  "blocks": fig["blocks"], "prompts": len(self.prompts), "records": self.heldout.records}
        best = tau > self.best_tau
        if best:
            self.best_tau = tau
            self._save_best(session, step, tau, fig)
        record["best"] = best
        now = time.time()
        self.spent, self.last_step, self.last_end = self.spent + now - t0, step, now
        # a walk that also ran the target over the held-out rows (kept for the later ones) does not
        # say what the next ones cost: the next regular evaluation is timed instead
        self.walk_s = None if fills and self.frozen.get("keep") else now - t1
        share = self.spent / max(now - self.began, 1e-9)
        if self.rank == 0:
            # the first evaluation builds the prompts and makes (or reads back) the continuations
            extra = {"continuations_s": round(t1 - t0, 3), "continuations_made": self.continuations_s is not None,
                     "continuations_reused": self.reused, "continuations_cached": self.cached} if first else {}
            self.out.record({**record, **extra, "eval_s": round(now - t1, 3), "every": self.gap,
                             "share": round(share, 4)})
            from longspec.training.rank import print0

            print0(f"[{session.conf['stage']}] step {step}: tau {tau:.3f} (eval's chain, {len(self.prompts)} prompts; "
                   + ", ".join(f"{b['length']}: {b['tau']:.2f}" for b in fig["by_length"]) + "; accepted at position "
                   + " ".join(f"{a:.2f}" for a in fig["alpha"]) + ")" + (", best so far: best/" if best else ""))
            if step == session.total:
                print0(f"[{session.conf['stage']}] tau while training took {self.spent:.1f} s of the stage's "
                       f"{now - self.began:.1f} s so far ({share:.1%})")
        return True

    def _save_best(self, session, step: int, tau: float, fig: dict) -> None:
        """The draft into best/ (weights first, best.json last, both atomic). Collective under ZeRO-3."""
        from longspec.model.weights import save_draft
        from longspec.files.atomic import sha256_file

        state = session.draft_state()
        if self.rank != 0:
            return
        d = self.out.dir
        weights = save_draft(state, d / runfolder.BEST_DIR)
        atomic_write_json(d / runfolder.BEST_INFO, {
            "stage": session.conf["stage"], "step": int(step), "tau": tau, "alpha": fig["alpha"],
            "by_length": fig["by_length"], "gamma": self.gamma,
            "weights": str(weights.relative_to(d)), "sha256": sha256_file(weights),
            "config_sha256": session.origin.config_sha256, "time": time.time()})
