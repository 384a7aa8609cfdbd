"""Decode every evaluation prompt plainly and speculatively (chain, tree, the input draft) and
keep per-prompt figures; longspec.measure.report sums them per length bucket and per task."""
from __future__ import annotations

from pathlib import Path

METHODS = ("chain", "tree")


def decoder(model, target, *, method: str, gamma: int, tree_shape, temperature: float):
    """f(draft, prompt (1, P), generator, max_new, stops) -> DecodeResult for one method. The greedy
    chain keeps its own loop; a sampled chain is the tree code with one node per level (the same
    acceptance rule)."""
    from longspec.decode.chain import GlideProposer, speculative_decode
    from longspec.decode.tree import GlideTreeProposer, chain_shape, tree_decode

    if method == "chain" and temperature == 0:
        return lambda d, p, g, n, stops: speculative_decode(model, GlideProposer(target, d), p, gamma, n, stops)
    shape = chain_shape(gamma) if method == "chain" else tuple(tree_shape)
    return lambda d, p, g, n, stops: tree_decode(model, GlideTreeProposer(target, d), p, shape, n, stops,
                                                 temperature, g)


def plain_decoder(model, *, temperature: float):
    from longspec.decode.chain import greedy_decode
    from longspec.decode.tree import sample_decode

    if temperature == 0:
        return lambda p, g, n, stops: greedy_decode(model, p, n, stops)
    return lambda p, g, n, stops: sample_decode(model, p, n, temperature, stops, g)


def measure(model, target, draft, prompts: list, *, gamma: int, device, log=None, baseline=None,
            methods=("chain",), tree_shape=(4, 16, 16, 16, 16), temperature: float = 0.0, seed: int = 0,
            no_stop: bool = False, seconds: dict | None = None) -> list[dict]:
    """Per-prompt rows for `prompts` (longspec.measure.prompts.Prompt, each with its bucket set in
    `.bucket`): plain decoding, each method and the input draft (``baseline``, first method).
    Greedy: a method's output must equal plain greedy's (``lossless``); sampling: None. Each row's
    `_raw` holds the sums report.figures adds up: (tokens after the first, decode seconds,
    accepted, verify forwards). ``seconds`` adds up the wall time of each part: warm-up, plain
    (the target's own decoding), each method, baseline."""
    import time

    import torch

    seconds = {} if seconds is None else seconds
    clock = [time.perf_counter()]

    def lap(part: str) -> None:
        now = time.perf_counter()
        seconds[part] = seconds.get(part, 0.0) + now - clock[0]
        clock[0] = now

    specs = {m: decoder(model, target, method=m, gamma=gamma, tree_shape=tree_shape, temperature=temperature)
             for m in methods}
    plain = plain_decoder(model, temperature=temperature)

    def gen(i):
        return torch.Generator().manual_seed(seed * 100_003 + i)

    warm = torch.tensor([prompts[0].ids[-16:]], device=device)     # first-call costs out of the timing
    plain(warm, gen(0), 8, ())
    for f in specs.values():
        f(draft, warm, gen(0), 8, ())
    lap("warmup")
    rows = []
    for i, pr in enumerate(prompts):
        p = torch.tensor([pr.ids], device=device)
        stops = () if no_stop else pr.stops
        g = plain(p, gen(i), pr.max_new, stops)
        lap("plain")
        raw = {"plain": (max(0, len(g.tokens) - 1), g.decode_s), "tokens": g.tokens}
        row: dict = {"record": pr.record, "kind": pr.kind, "prompt_tokens": len(pr.ids), "bucket": pr.bucket}
        if pr.task:
            row["task"] = pr.task
        for m, f in specs.items():
            s = f(draft, p, gen(i), pr.max_new, stops)
            lap(m)
            raw[m] = (max(0, len(s.tokens) - 1), s.decode_s, sum(s.accepted), len(s.accepted))
            same = None if temperature > 0 else g.tokens == s.tokens
            first_diff = None if same is not False else next(
                (j for j, (a, b) in enumerate(zip(g.tokens, s.tokens)) if a != b), min(len(g.tokens), len(s.tokens)))
            if m == methods[0]:
                row.update({"new_tokens": len(s.tokens), "max_new_tokens": pr.max_new,
                            "stopped": "eos" if s.tokens and s.tokens[-1] in stops else "limit",
                            "tau": round(s.tau, 4), "target_forwards": s.target_forwards,
                            "lossless": same, "first_mismatch": first_diff})
            else:
                row.update({f"{m}_tau": round(s.tau, 4), f"{m}_lossless": same})
        if baseline is not None:
            b = specs[methods[0]](baseline, p, gen(i), pr.max_new, stops)
            lap("baseline")
            raw["baseline"] = (max(0, len(b.tokens) - 1), b.decode_s, sum(b.accepted), len(b.accepted))
            row["baseline_tau"] = round(b.tau, 4)
            row["baseline_lossless"] = None if temperature > 0 else b.tokens == g.tokens
        row["_raw"] = raw
        rows.append(row)
        if log:
            log(f"prompt {i + 1}/{len(prompts)} ({pr.record}): {len(pr.ids)} tokens -> {row['new_tokens']} new "
                f"({row['stopped']}), "
                + ", ".join(f"{m} tau {row['tau'] if m == methods[0] else row[m + '_tau']:.2f}" for m in methods)
                + (f" (input draft {row['baseline_tau']:.2f})" if baseline is not None else "")
                + ("" if row["lossless"] is not False else f", NOT LOSSLESS at token {row['first_mismatch']}"))
        lap("rows")
    return rows


def load_baseline(path: Path, draft, dtype, device):
    """The input draft (the draft_from stage's final draft, same shape), for a same-prompts comparison.
    Raises longspec.model.weights.DraftLoadError for an unusable file."""
    from longspec.model.weights import load_draft_state, load_draft_weights
    from longspec.model.glide import GlideDraft

    other = GlideDraft(draft.config).to(dtype)
    load_draft_weights(other, load_draft_state(path))
    return other.to(device).eval()
