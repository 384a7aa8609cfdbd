"""`python -m longspec.evaluate`'s command line: the flags, their checks (EvalError 2 for a bad
value) and what of a measurement is not the stage's default one (named in its result file)."""
from __future__ import annotations

import argparse
from pathlib import Path

from longspec.measure.perprompt import METHODS
from longspec.measure.prompts import MAX_PROMPTS, MIN_PROMPTS, PROMPT_TOKEN_BUDGET
from longspec.measure.runread import EvalError

DEFAULT_GAMMA = 4
DESCRIPTION = ("Measure a stage's draft: tau by context length, speculative vs plain tokens/s, speed-up, "
               "losslessness.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longspec.evaluate", description=DESCRIPTION)
    p.add_argument("run_dir", type=Path, help="the stage's output_dir")
    p.add_argument("--stage", help="stage name (default: from the run folder)")
    p.add_argument("--target", type=Path, help="target model folder (default: model_name_or_path)")
    p.add_argument("--draft", type=Path, help="draft weights (default: the stage's final weights)")
    p.add_argument("--data", type=Path, help="records to take prompts from (default: train_file)")
    p.add_argument("--baseline-draft", type=Path,
                   help="the input draft (the draft_from stage's): also decoded on the same prompts, its tau reported")
    p.add_argument("--baseline-stage", help="name of the stage --baseline-draft comes from (for eval.json)")
    p.add_argument("--prompts", type=Path, help="JSON/JSONL prompts file (overrides --data)")
    p.add_argument("--bench", help="longbench:FOLDER (LongBench's <task>.jsonl files) or aime:FILE (problems)")
    p.add_argument("--min-prompt-tokens", type=int, default=None,
                   help="--bench longbench: shortest prompt kept (default 1200, as upstream)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="--bench longbench: longest prompt kept (default: the target's position limit - 2000)")
    p.add_argument("--lengths", help="context-length buckets, e.g. 1k,4k,16k,32k (default: powers of two "
                                     "from 1k up to max_seq_length, and max_seq_length)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts per length bucket (default: {PROMPT_TOKEN_BUDGET} prompt tokens' worth shared "
                        f"by the buckets, {MIN_PROMPTS} to {MAX_PROMPTS} each); per task with --bench (default: all)")
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
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt (default: 1024 for documents, chats and LongBench, 200 for "
                        "chain-of-thought and AIME, at most an eighth of max_seq_length)")
    p.add_argument("--sliding-window", type=int, help="draft self-attention window (default: draft.sliding_window)")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the end of turn / EOS")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-write", action="store_true", help="do not write a result file")
    args = p.parse_args(argv)
    for name in ("num_prompts", "gamma", "max_new_tokens", "threads", "max_prompt_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be >= 1", 2)
    if args.min_prompt_tokens is not None and args.min_prompt_tokens < 0:
        raise EvalError("--min-prompt-tokens must be >= 0", 2)
    if not (args.temperature >= 0 and args.temperature < float("inf")):
        raise EvalError(f"--temperature must be a number >= 0 (got {args.temperature})", 2)
    if args.prompts is not None and args.bench is not None:
        raise EvalError("--prompts and --bench: give one of them", 2)
    from longspec.measure.report import parse_lengths

    if args.lengths is not None:
        try:
            args.lengths = parse_lengths(args.lengths)
        except ValueError as e:
            raise EvalError(f"--lengths: {e}", 2) from None
    args.method = list(dict.fromkeys(args.method or ["chain"]))
    from longspec.decode.tree import DEFAULT_TREE_SHAPE, parse_tree_shape

    args.default_tree = args.tree_shape is None
    try:
        args.tree_shape = parse_tree_shape(args.tree_shape or DEFAULT_TREE_SHAPE)
    except ValueError as e:
        raise EvalError(f"--tree-shape: {e}", 2) from None
    return args


def nondefault_settings(args) -> list[str]:
    """What of this measurement is not the stage's default one (named in its result file)."""
    out = []
    if args.data is not None:
        out.append("data-" + args.data.stem)
    if args.draft is not None:
        out.append("draft-" + args.draft.stem)
    if args.gamma != DEFAULT_GAMMA:
        out.append(f"gamma{args.gamma}")
    if not args.default_tree:
        out.append("tree" + "-".join(map(str, args.tree_shape)))
    if args.temperature:
        out.append(f"t{args.temperature:g}")
    for flag in ("lengths", "max_new_tokens", "num_prompts"):
        value = getattr(args, flag)
        if value is not None:
            out.append(flag.split("_")[0] + ("-".join(map(str, value)) if isinstance(value, list) else str(value)))
    return out
