"""Measure a stage's draft: tau, speculative vs plain tokens/s, speed-up, and losslessness.

    python -m longspec.evaluate RUN_DIR [--method chain|tree ...] [--gamma 4] [--tree-shape 4 16 16 16 16]
                                [--temperature T] [--prompts FILE] [--max-new-tokens 64]
                                [--num-prompts N] [--context-tokens N] [--json] [--no-write]

RUN_DIR is a finished stage's output_dir. Its training_config.yaml (the resolved config the
trainer wrote) names the target, the training data, the draft's sliding window and the stage's
max_seq_length; stage_complete.json names the final weights. Every one of them can be given
as a flag instead (--target, --draft, --data, --sliding-window).

Prompts: --prompts FILE (JSON/JSONL: strings or {"prompt": ...} used whole; training records
are rendered and cut), else held-out records of the stage's train_file: the last --num-prompts
records the run never drew (the trainer's sampler is replayed from the config, seed and step
count; eval.json says how many prompts were drawn anyway when too few were left). A record is
tokenized as the trainer does (longspec.data.encode_record, the stage's collator) and cut to
min(len - 1, max_seq_length - max_new_tokens) tokens (or --context-tokens), so base prompts
are short and long/longcot prompts long, as the stage was trained.

For each prompt: plain decoding and speculative decoding with each --method (chain: gamma draft
tokens in a row, longspec.spec_decode; tree: a token tree of --tree-shape, longspec.tree_decode,
whose docstring gives the shape's meaning and the sampling rule). Greedy (--temperature 0): the
outputs must be equal token for token (`lossless`); sampling: `lossless` is null and the plain
baseline samples from the target. tau = tokens per target verify forward (accepted draft tokens
+ the bonus token). eval.json's headline fields (tau, speed-up, lossless) are the first method's;
`methods` holds every method's figures. --baseline-draft (the upstream stage's final
draft) is decoded on the same prompts too, so eval.json's `baseline.tau` compares the two drafts
on this stage's data (what the quality gate uses; tau on another stage's prompts is not comparable). Writes RUN_DIR/eval.json atomically and
prints the result (one JSON object with --json). Exit codes: 0 ok, 1 not lossless or no
finished draft, 2 usage, 3 unreadable input (draft, data, config).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping

EVAL_NAME = "eval.json"
DEFAULT_GAMMA = 4
DEFAULT_MAX_NEW = 64
# Prompts to decode when --num-prompts is not given: a budget of prompt tokens, so short-context
# stages get many prompts (tau varies a lot from prompt to prompt) and 32k stages stay affordable.
PROMPT_TOKEN_BUDGET = 4096
MIN_PROMPTS, MAX_PROMPTS = 8, 32


def stage_draft(run_dir: Path, conf: Mapping, complete: Mapping | None, args) -> tuple[str, Path, Path, int]:
    """(stage, draft weights, target, sliding window) of a run folder; --stage/--draft/--target/
    --sliding-window in ``args`` win over what the run recorded. Shared by eval and export."""
    from longspec_cli.core import runfolder

    stage = args.stage or _get(conf, "stage") or (complete or {}).get("stage") or run_dir.name
    draft = args.draft
    if draft is None:
        if complete is None:
            raise EvalError(f"stage {stage} has no finished draft ({run_dir} has no stage_complete.json)", 1,
                            hint="train the stage first, or pass --draft PATH")
        draft = runfolder.RunDir(run_dir).weights_for(complete)
    if not draft.exists():
        raise EvalError(f"draft weights not found: {draft}", 1 if args.draft is None else 2)
    target = args.target or _path(_get(conf, "model_name_or_path")) or _path((complete or {}).get("target"))
    if target is None:
        raise EvalError(f"{run_dir}: no target recorded (training_config.yaml missing)", 2, hint="pass --target PATH")
    window = args.sliding_window or int(_get(conf, "draft.sliding_window", 512))
    return str(stage), draft, target, window


def default_num_prompts(context_tokens: int) -> int:
    return max(MIN_PROMPTS, min(MAX_PROMPTS, PROMPT_TOKEN_BUDGET // max(1, context_tokens)))
MIN_CONTEXT = 8


class EvalError(Exception):
    """A user-facing failure with an exit code (1 refused, 2 usage, 3 unreadable input)."""

    def __init__(self, message: str, code: int = 2, hint: str | None = None):
        super().__init__(message)
        self.message, self.code, self.hint = message, code, hint


# ----------------------------------------------------------------------------- run folder

def read_run(run_dir: Path) -> tuple[dict, dict | None]:
    """(resolved training config or {}, stage_complete.json or None)."""
    from longspec_cli.core import runfolder, yamlio

    if not run_dir.is_dir():
        raise EvalError(f"{run_dir}: no such run folder", 2)
    conf: dict = {}
    cfg_path = run_dir / "training_config.yaml"
    if cfg_path.is_file():
        try:
            conf = yamlio.to_plain(yamlio.load_mapping(cfg_path).data)
        except yamlio.YamlError as e:
            raise EvalError(e.message, 3) from None
    complete, why = runfolder.read_json(run_dir / runfolder.STAGE_COMPLETE)
    if why:
        raise EvalError(why, 3)
    return conf, complete


def _get(conf: dict, dotted: str, default: Any = None) -> Any:
    node: Any = conf
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


# ----------------------------------------------------------------------------- prompts

def read_prompt_file(path: Path) -> list[Any]:
    """A --prompts file: a JSON list or JSONL of strings / objects (blank lines skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalError(f"{path}: no such file", 2) from None
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"{path}: cannot read ({e})", 3) from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise EvalError(f"{path}: not valid JSON ({e})", 3) from None
        return list(data)
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise EvalError(f"{path}:{i}: not valid JSON ({e})", 3) from None
    return out


def whole_prompt(rec: Any) -> str | None:
    """A --prompts entry used as is: a string, or {"prompt": ...} without a response."""
    if isinstance(rec, str):
        return rec
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and "response" not in rec:
        return rec["prompt"]
    return None


def record_ids(rec: dict, tokenizer, collator: str) -> list[int] | None:
    """The token ids the trainer makes of a record (longspec.data.encode_record, no length cap,
    the closing EOS dropped); None for a record the collator cannot use."""
    from longspec.data import RecordError, encode_record

    try:
        ids, _ = encode_record(rec, tokenizer, collator, 1 << 40)
    except RecordError:
        return None
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return ids


def trained_indices(n: int, conf: dict, steps: int | None) -> set[int] | None:
    """Record indices the stage's run drew, replaying the trainer's own sampler
    (longspec.data.ShardedBatchSampler: seeded shuffle per epoch, dealt over ranks); None when
    that cannot be known (records skipped as bad, unknown step count or batch layout)."""
    from longspec.data import ShardedBatchSampler
    from longspec_cli.core import runfolder

    batch, accum = _get(conf, "per_gpu_train_batch_size"), _get(conf, "gradient_accumulation_steps", 1)
    glob, seed = _get(conf, "global_batch_size"), _get(conf, "seed", 42)
    if _get(conf, "data.on_bad_record", "error") != "error" or not isinstance(steps, int) or steps < 0 \
            or not isinstance(batch, int) or not isinstance(accum, int) or batch < 1 or accum < 1:
        return None
    world = glob // (batch * accum) if isinstance(glob, int) and glob >= batch * accum else 1
    held = _path(_get(conf, "output_dir"))
    held, _ = runfolder.read_json(held / runfolder.HELDOUT) if held is not None else (None, None)
    if held is not None and isinstance(held.get("start"), int) and 0 < held["start"] <= n:
        n = held["start"]                     # the sampler deals only the records before the held-out ones
    seen: set[int] = set()
    for rank in range(world):
        sampler = ShardedBatchSampler(n, batch, seed, rank, world)
        left, epoch = steps * accum, 0                    # micro-batches this rank took
        while left > 0 and len(seen) < n:
            mine = sampler.epoch_indices(epoch)
            for start in range(0, len(mine), batch):
                if left == 0:
                    break
                seen.update(mine[start:start + batch])
                left -= 1
            epoch += 1
    return seen


def stage_prompts(path: Path, tokenizer, conf: dict, steps: int | None, *, n: int, cap: int) -> tuple[list, dict]:
    """The last `n` usable records of the stage's data that its run never drew, cut to `cap` tokens."""
    from collections import deque

    from longspec.data import DataError, read_records

    collator = _get(conf, "data.collator", "short_text")
    tail: deque = deque(maxlen=max(64, 16 * n))
    count = 0
    try:
        for _, rec in read_records(path, _get(conf, "data.on_bad_record", "error")):
            tail.append((count, rec))
            count += 1
    except (DataError, OSError) as e:
        raise EvalError(f"{path}: {e}", 3 if not isinstance(e, FileNotFoundError) else 2) from None
    seen = trained_indices(count, conf, steps)
    fresh, drawn = [], []
    for idx, rec in reversed(tail):
        ids = record_ids(rec, tokenizer, collator)
        if ids is None or len(ids) < MIN_CONTEXT + 1:
            continue
        (drawn if seen is not None and idx in seen else fresh).append(ids[: min(len(ids) - 1, cap)])
        if len(fresh) == n:
            break
    prompts = (fresh + drawn)[:n][::-1]
    if not prompts:
        raise EvalError(f"{path}: no record usable as a prompt (collator {collator})", 3)
    info = {"prompt_source": str(path), "records": count,
            "records_drawn_in_training": None if seen is None else len(seen),
            "prompts_drawn_in_training": None if seen is None else max(0, len(prompts) - len(fresh)),
            "heldout_check": "replayed the trainer's sampler" if seen is not None else "not possible (unverified)"}
    return prompts, info


def file_prompts(path: Path, tokenizer, conf: dict, *, n: int, cap: int) -> tuple[list, dict]:
    """--prompts: whole prompts as given; training-style records rendered like the trainer and cut."""
    collator = _get(conf, "data.collator", "short_text")
    prompts = []
    for i, rec in enumerate(read_prompt_file(path)[:n]):
        whole = whole_prompt(rec)
        if whole is not None:
            ids = tokenizer(whole)["input_ids"]           # the tokenizer's own specials, as for a document
        elif isinstance(rec, dict):
            ids = record_ids(rec, tokenizer, collator)
            if ids is None:
                raise EvalError(f"{path}: entry {i + 1} is not a prompt nor a {collator} record", 3)
            ids = ids[: min(len(ids) - 1, cap)]
        else:
            raise EvalError(f"{path}: entry {i + 1} must be a string or an object", 3)
        if ids:
            prompts.append(ids)
    if not prompts:
        raise EvalError(f"{path}: no prompts", 3)
    return prompts, {"prompt_source": str(path)}


# ----------------------------------------------------------------------------- models

def pick_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: no CUDA device here", 2)
    return torch.device(name)


def pick_dtype(name: str, device, precision: str | None):
    """auto: fp32 on CPU (exact comparison), the stage's precision on CUDA."""
    import torch

    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name == "auto":
        name = "fp32" if device.type == "cpu" else (precision if precision in table else "bf16")
    return table[name]


def load_models(target: Path, draft: Path, sliding_window: int, dtype, device):
    """(hf_model, TargetWrapper, GlideDraft, tokenizer); EvalError 3 for an unusable draft/target."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from longspec.checkpoint import DraftLoadError
    from longspec.model import build_glide

    if not (target / "config.json").is_file():
        raise EvalError(f"target model folder {target} has no config.json", 3,
                        hint="pass --target PATH, or fix model_name_or_path in the stage config")
    hf_logging.disable_progress_bar()
    try:
        glide = build_glide(target, sliding_window=sliding_window, draft_path=draft, dtype=dtype,
                            attn_implementation="sdpa")
    except DraftLoadError as e:
        raise EvalError(str(e), 3) from None
    except ValueError as e:            # unsupported family / a draft that does not match the target
        raise EvalError(str(e), 3) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(target))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a missing tokenizer
        raise EvalError(f"cannot load the target's tokenizer from {target} ({type(e).__name__}: {e})", 3) from None
    glide.to(device)
    glide.eval()
    return glide.target.model, glide.target, glide.draft, tok


# ----------------------------------------------------------------------------- measuring

METHODS = ("chain", "tree")


def decoder(model, target, *, method: str, gamma: int, tree_shape, temperature: float, max_new_tokens: int,
            eos_token_id: int | None):
    """f(draft, prompt (1, P), generator) -> DecodeResult for one method. The greedy chain keeps its
    own loop; a sampled chain is the tree code with one node per level (the same acceptance rule)."""
    from longspec.spec_decode import GlideProposer, speculative_decode
    from longspec.tree_decode import GlideTreeProposer, chain_shape, tree_decode

    if method == "chain" and temperature == 0:
        return lambda d, p, g: speculative_decode(model, GlideProposer(target, d), p, gamma, max_new_tokens,
                                                  eos_token_id)
    shape = chain_shape(gamma) if method == "chain" else tuple(tree_shape)
    return lambda d, p, g: tree_decode(model, GlideTreeProposer(target, d), p, shape, max_new_tokens, eos_token_id,
                                       temperature, g)


def plain_decoder(model, *, temperature: float, max_new_tokens: int, eos_token_id: int | None):
    from longspec.spec_decode import greedy_decode
    from longspec.tree_decode import sample_decode

    if temperature == 0:
        return lambda p, g: greedy_decode(model, p, max_new_tokens, eos_token_id)
    return lambda p, g: sample_decode(model, p, max_new_tokens, temperature, eos_token_id, g)


def measure(model, target, draft, prompts: list[list[int]], *, gamma: int, max_new_tokens: int,
            eos_token_id: int | None, device, log=None, baseline=None, methods=("chain",),
            tree_shape=(4, 16, 16, 16, 16), temperature: float = 0.0, seed: int = 0) -> dict:
    """Plain decoding and speculative decoding (each method) of every prompt; aggregate figures
    per method + per-prompt rows. Greedy (temperature 0): every method's output must equal plain
    greedy's (``lossless``); sampling: ``lossless`` is None (no token-for-token comparison exists;
    the test suite checks the distribution). ``baseline``: another draft (the upstream stage's)
    decoded with the first method on the same prompts, for its tau."""
    import torch

    opts = dict(gamma=gamma, tree_shape=tree_shape, temperature=temperature, max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id)
    specs = {m: decoder(model, target, method=m, **opts) for m in methods}
    plain = plain_decoder(model, temperature=temperature, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)

    def gen(i):
        return torch.Generator().manual_seed(seed * 100_003 + i)

    warm = torch.tensor([prompts[0][-16:]], device=device)     # first-call costs out of the timing
    plain(warm, gen(0))
    for f in specs.values():
        f(draft, warm, gen(0))
    rows = []
    tot = {m: {"acc": 0, "steps": 0, "tok": 0, "time": 0.0, "same": True} for m in methods}
    base = {"acc": 0, "steps": 0, "same": True}
    g_tok = g_time = 0.0
    for i, ids in enumerate(prompts):
        p = torch.tensor([ids], device=device)
        g = plain(p, gen(i))
        g_tok, g_time = g_tok + max(0, len(g.tokens) - 1), g_time + g.decode_s
        row: dict = {"prompt_tokens": len(ids)}
        for m, f in specs.items():
            s = f(draft, p, gen(i))
            same = None if temperature > 0 else g.tokens == s.tokens
            first_diff = None if same is not False else next(
                (j for j, (a, b) in enumerate(zip(g.tokens, s.tokens)) if a != b), min(len(g.tokens), len(s.tokens)))
            t = tot[m]
            t["acc"], t["steps"] = t["acc"] + sum(s.accepted), t["steps"] + len(s.accepted)
            t["tok"], t["time"] = t["tok"] + max(0, len(s.tokens) - 1), t["time"] + s.decode_s
            t["same"] = t["same"] and same is not False
            if m == methods[0]:
                row.update({"new_tokens": len(s.tokens), "tau": round(s.tau, 4), "target_forwards": s.target_forwards,
                            "lossless": same, "first_mismatch": first_diff})
            else:
                row.update({f"{m}_tau": round(s.tau, 4), f"{m}_lossless": same})
        if baseline is not None:
            b = specs[methods[0]](baseline, p, gen(i))
            base["acc"], base["steps"] = base["acc"] + sum(b.accepted), base["steps"] + len(b.accepted)
            base["same"] = base["same"] and (temperature > 0 or b.tokens == g.tokens)
            row["baseline_tau"] = round(b.tau, 4)
        rows.append(row)
        if log:
            log(f"prompt {i + 1}/{len(prompts)}: {len(ids)} tokens -> {row['new_tokens']} new, "
                + ", ".join(f"{m} tau {row['tau'] if m == methods[0] else row[m + '_tau']:.2f}" for m in methods)
                + (f" (upstream draft {row['baseline_tau']:.2f})" if baseline is not None else "")
                + ("" if row["lossless"] is not False else f", NOT LOSSLESS at token {row['first_mismatch']}"))
    target_tps = g_tok / g_time if g_time > 0 else 0.0
    per_method = {}
    for m in methods:
        t = tot[m]
        tps = t["tok"] / t["time"] if t["time"] > 0 else 0.0
        per_method[m] = {
            "method": m, "tau": round(t["acc"] / t["steps"], 4) if t["steps"] else 0.0,
            "spec_tokens_per_s": round(tps, 2), "target_tokens_per_s": round(target_tps, 2),
            "speedup": round(tps / target_tps, 4) if target_tps > 0 else 0.0,
            "lossless": None if temperature > 0 else t["same"], "target_forwards": int(t["steps"]),
            "temperature": temperature,
            "gamma": gamma if m == "chain" else len(tree_shape),
            "tree_shape": list(tree_shape) if m == "tree" else None,
            "max_tau": (gamma if m == "chain" else len(tree_shape)) + 1,
        }
    first = per_method[methods[0]]
    flags = [pm["lossless"] for pm in per_method.values()]
    out = {**{k: first[k] for k in ("tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup")},
           "lossless": None if temperature > 0 else all(flags),
           "generated_tokens": int(sum(r["new_tokens"] for r in rows)), "target_forwards": first["target_forwards"],
           "methods": per_method, "per_prompt": rows}
    if baseline is not None:
        out["baseline"] = {"tau": round(base["acc"] / base["steps"], 4) if base["steps"] else 0.0,
                           "lossless": None if temperature > 0 else base["same"], "method": methods[0]}
    return out


def load_baseline(path: Path, draft, dtype, device):
    """A second draft of the same shape (the upstream stage's), for a same-prompts comparison."""
    from longspec.checkpoint import DraftLoadError, load_draft_state, load_draft_weights
    from longspec.model import GlideDraft

    other = GlideDraft(draft.config).to(dtype)
    try:
        load_draft_weights(other, load_draft_state(path))
    except DraftLoadError as e:
        raise EvalError(f"baseline draft: {e}", 3) from None
    return other.to(device).eval()


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longspec.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the stage's output_dir")
    p.add_argument("--stage", help="stage name (default: from the run folder)")
    p.add_argument("--target", type=Path, help="target model folder (default: model_name_or_path)")
    p.add_argument("--draft", type=Path, help="draft weights (default: the stage's final weights)")
    p.add_argument("--data", type=Path, help="records to take prompts from (default: train_file)")
    p.add_argument("--baseline-draft", type=Path,
                   help="also decode the same prompts with this draft (the upstream stage's) and report its tau")
    p.add_argument("--baseline-stage", help="name of the stage --baseline-draft comes from (for eval.json)")
    p.add_argument("--prompts", type=Path, help="JSON/JSONL prompts file (overrides --data)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"default: {PROMPT_TOKEN_BUDGET} prompt tokens' worth, {MIN_PROMPTS} to {MAX_PROMPTS}")
    p.add_argument("--method", action="append", choices=METHODS,
                   help="chain (gamma draft tokens in a row) or tree (--tree-shape); repeat to measure both on the "
                        "same prompts; the first is eval.json's headline (default: chain)")
    p.add_argument("--gamma", type=int, default=DEFAULT_GAMMA, help="chain length (method chain)")
    p.add_argument("--tree-shape", type=int, nargs="+", default=None, metavar="N",
                   help="nodes per tree level, in total over the level (default 4 16 16 16 16: depth 5, "
                        "68 draft tokens per target forward); level 1 = the draft's top N tokens, level d+1 = "
                        "the best N (parent, token) pairs over the level by summed draft log-probability")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (lossless, checked token for token); > 0 = speculative sampling (the "
                        "output follows the target's sampling distribution)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW)
    p.add_argument("--context-tokens", type=int, help="cut rendered records to this many tokens")
    p.add_argument("--sliding-window", type=int, help="draft self-attention window (default: draft.sliding_window)")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-write", action="store_true", help="do not write eval.json")
    args = p.parse_args(argv)
    for name in ("num_prompts", "gamma", "max_new_tokens", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be >= 1", 2)
    if args.context_tokens is not None and args.context_tokens < 1:
        raise EvalError("--context-tokens must be >= 1", 2)
    if not (args.temperature >= 0 and args.temperature < float("inf")):
        raise EvalError(f"--temperature must be a number >= 0 (got {args.temperature})", 2)
    args.method = list(dict.fromkeys(args.method or ["chain"]))
    from longspec.tree_decode import DEFAULT_TREE_SHAPE, parse_tree_shape

    try:
        args.tree_shape = parse_tree_shape(args.tree_shape or DEFAULT_TREE_SHAPE)
    except ValueError as e:
        raise EvalError(f"--tree-shape: {e}", 2) from None
    return args


def evaluate(args: argparse.Namespace, log=None) -> dict:
    import torch

    from longspec_cli.core import runfolder
    from longspec_cli.core.atomic import sha256_file

    run_dir = args.run_dir
    conf, complete = read_run(run_dir)
    stage, draft, target, window = stage_draft(run_dir, conf, complete, args)
    max_seq = int(_get(conf, "data.max_seq_length", 1024))

    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = pick_dtype(args.dtype, device, _get(conf, "precision"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    model, tw, gdraft, tok = load_models(target, draft, window, dtype, device)

    cap = args.context_tokens or max(MIN_CONTEXT, max_seq - args.max_new_tokens)
    if args.num_prompts is None:
        args.num_prompts = default_num_prompts(cap)
    if args.prompts is not None:
        prompts, pinfo = file_prompts(args.prompts, tok, conf, n=args.num_prompts, cap=cap)
    else:
        data = args.data or _path(_get(conf, "train_file"))
        if data is None:
            raise EvalError(f"{run_dir}: no train_file recorded", 2, hint="pass --prompts FILE or --data FILE")
        trained_on = _path(_get(conf, "train_file"))
        same_data = trained_on is not None and Path(data).resolve() == trained_on.resolve()
        steps = (complete or {}).get("steps") if args.draft is None and same_data else None
        prompts, pinfo = stage_prompts(data, tok, conf, steps, n=args.num_prompts, cap=cap)
        if not same_data:
            pinfo["heldout_check"] = "another file than the stage's train_file"
    eos = None if args.no_eos else tok.eos_token_id
    if log:
        drawn = pinfo.get("prompts_drawn_in_training")
        log(f"[{stage}] {len(prompts)} prompts from {pinfo['prompt_source']}"
            + (f" ({drawn} of them drawn in training)" if drawn else "")
            + f", {' + '.join(args.method)} (gamma {args.gamma}, tree {list(args.tree_shape)}, "
            + f"temperature {args.temperature:g}), {args.max_new_tokens} new tokens, {device.type} {str(dtype).replace('torch.', '')}")
    baseline = None
    if args.baseline_draft is not None:
        if not args.baseline_draft.exists():
            raise EvalError(f"baseline draft not found: {args.baseline_draft}", 2)
        baseline = load_baseline(args.baseline_draft, gdraft, dtype, device)
    if device.type == "cuda" and "tree" in args.method:
        from longspec import tree_attn

        if tree_attn.fused_available(device):
            tree_attn.install(model)          # hybrid tree attention: flash-attn over the prefix
    figures = measure(model, tw, gdraft, prompts, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                      eos_token_id=eos, device=device, log=log, baseline=baseline, methods=tuple(args.method),
                      tree_shape=args.tree_shape, temperature=args.temperature, seed=args.seed)
    lens = [len(p) for p in prompts]
    result = {
        "stage": str(stage),
        "tau": figures["tau"],
        "spec_tokens_per_s": figures["spec_tokens_per_s"],
        "target_tokens_per_s": figures["target_tokens_per_s"],
        "speedup": figures["speedup"],
        "method": args.method[0],
        "gamma": args.gamma,
        "tree_shape": list(args.tree_shape) if args.method[0] == "tree" else None,
        "temperature": args.temperature,
        "methods": figures["methods"],
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "context_tokens": round(sum(lens) / len(lens)),
        "context_tokens_max": max(lens),
        "lossless": figures["lossless"],
        "draft_sha256": sha256_file(draft) if draft.is_file() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "draft": str(draft),
        "target": str(target),
        **pinfo,
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "sliding_window": window,
        "generated_tokens": figures["generated_tokens"],
        "target_forwards": figures["target_forwards"],
        "per_prompt": figures["per_prompt"],
    }
    if baseline is not None:
        bpath = args.baseline_draft
        result["baseline"] = {**figures["baseline"], "stage": args.baseline_stage, "draft": str(bpath),
                              "draft_sha256": sha256_file(bpath) if bpath.is_file() else None}
    if not args.no_write:
        from longspec_cli.core.atomic import atomic_write_json

        result["eval_json"] = str(run_dir / EVAL_NAME)
        atomic_write_json(run_dir / EVAL_NAME, result)
    return result


def _path(value: Any) -> Path | None:
    return Path(str(value)).expanduser() if value not in (None, "", "???") else None


def method_label(m: dict) -> str:
    """'chain 4' or 'tree 4-16-16-16-16' (eval.json `methods` entry)."""
    if m.get("method") == "tree" and m.get("tree_shape"):
        return "tree " + "-".join(str(w) for w in m["tree_shape"])
    return f"{m.get('method', 'chain')} {m.get('gamma', '')}".strip()


def _print_table(r: dict) -> None:
    lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}[r["lossless"]]
    temp = f", temperature {r['temperature']:g}" if r.get("temperature") else ""
    for m in r.get("methods", {}).values():
        print(f"stage {r['stage']}: {method_label(m)}{temp}: tau {m['tau']:.2f}, "
              f"speculative {m['spec_tokens_per_s']:.1f} tok/s vs target {m['target_tokens_per_s']:.1f} tok/s "
              f"= x{m['speedup']:.2f}")
    print(f"stage {r['stage']}: {r['prompts']} prompts of ~{r['context_tokens']} tokens; lossless: {lossless}"
          + (f"; upstream draft ({r['baseline'].get('stage') or 'baseline'}) on the same prompts: "
             f"tau {r['baseline']['tau']:.2f}" if "baseline" in r else ""))


def main(argv: list[str] | None = None) -> int:
    as_json = "--json" in (argv if argv is not None else sys.argv[1:])
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        args = parse_args(argv)
        result = evaluate(args, log=log)
    except EvalError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        if as_json:
            print(json.dumps({"error": e.message, "hint": e.hint, "exit_code": e.code}))
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    if result["lossless"] is False and result["dtype"] != "float32":
        print(f"note: in {result['dtype']}, a (gamma+1)-token forward and a 1-token forward can round differently "
              "and flip a near-tie; --dtype fp32 checks the decoding itself", file=sys.stderr)
    return 1 if result["lossless"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
