"""Measure a stage's draft: tau by context length, speculative vs plain tokens/s, speed-up, losslessness.

    python -m longspec.evaluate RUN_DIR [--method chain|tree ...] [--gamma 4] [--tree-shape 4 16 16 16 16]
                                [--lengths 1k,4k,16k,32k] [--prompts FILE | --bench longbench:DIR | aime:FILE]
                                [--max-new-tokens N] [--num-prompts N] [--temperature T] [--json] [--no-write]

RUN_DIR is a finished stage's output_dir. Its training_config.yaml (the resolved config the
trainer wrote) names the target, the training data, the draft's sliding window and the stage's
max_seq_length; stage_complete.json names the final weights. Every one of them can be given
as a flag instead (--target, --draft, --data, --sliding-window).

Prompts (longspec.measure.prompts, longspec.measure.benchfiles): held-out records of the stage's train_file (the
newest the run never drew; the trainer's sampler is replayed), a chat or chain-of-thought record
cut at its question (the conversation up to the last user turn with the template's generation
prompt; its answer is never in the prompt), a document cut at each context length; or --prompts
FILE; or --bench longbench:FOLDER / aime:FILE. Decoding stops at the end of turn / EOS or at the
new-token limit (1,024 for documents, chats and LongBench, 200 for chain-of-thought and AIME, at
most an eighth of max_seq_length; --max-new-tokens sets one for all).

Length buckets (longspec.measure.report): --lengths, default powers of two from 1k up to the stage's
max_seq_length and that length (two at least); a prompt falls in the smallest length >= its
tokens. Per bucket (eval.json `by_length`) and per benchmark task (`by_task`): prompts, chain and
tree tau and speed-up, and the input draft's tau on the same prompts (--baseline-draft: the
draft_from stage's final draft, decoded with the first method). Greedy (--temperature 0): the
outputs must be equal token for token (`lossless`); sampling: `lossless` is null. tau = tokens
per target verify forward. The headline fields (tau, speed-up, lossless) are the first method's
over all prompts. The stage's default measurement writes RUN_DIR/eval.json (what `status` and the
quality gate read); --prompts, --bench or other settings write RUN_DIR/eval-<what>.json instead.
Exit codes: 0 ok, 1 not lossless or no finished draft, 2 usage, 3 unreadable input.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from longspec.machine import cudaarch
from longspec.measure.perprompt import METHODS
from longspec.measure.report import EVAL_NAME
from longspec.measure.runread import EvalError, as_path, read_run, stage_draft
from longspec.measure.prompts import (MAX_PROMPTS, MIN_PROMPTS, PROMPT_TOKEN_BUDGET, PromptError,  # noqa: F401 (eval's defaults)
                              conf_get as _get, default_num_prompts)

DEFAULT_GAMMA = 4


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

    from longspec.model.weights import DraftLoadError
    from longspec.model.glide import build_glide

    if not (target / "config.json").is_file():
        raise EvalError(f"target model folder {target} has no config.json", 3,
                        hint="pass --target PATH, or fix model_name_or_path in the stage config")
    hf_logging.disable_progress_bar()
    try:
        glide = build_glide(target, sliding_window=sliding_window, draft_path=draft, dtype=dtype)
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


# ----------------------------------------------------------------------------- main

def check_memory(args, target: Path, max_seq: int, dtype, device) -> None:
    """EvalError 3 before any weight loads when the longest length bucket known now (--lengths, or
    the default buckets of max_seq; --bench's come from its prompts) cannot fit on ``device``
    (longspec.machine.evalmemory: weights + KV cache + prefill; free GPU memory or MemAvailable)."""
    import torch

    from longspec.machine import evalmemory as EM
    from longspec.machine.memory import ModelSize

    lengths = args.lengths or (None if args.bench else EM.default_lengths(max_seq))
    try:
        size = ModelSize.from_config_json(target / "config.json")
    except (OSError, ValueError, TypeError):
        return                                   # load_models says what is wrong with the target
    if not lengths:
        return
    cuda = device.type == "cuda"
    available = torch.cuda.mem_get_info(device)[0] if cuda else EM.cpu_available()
    if available is None:
        return
    refused = EM.refusal(size, lengths, EM.default_max_new(max_seq, args.max_new_tokens), dtype.itemsize, available,
                         "this GPU (free memory)" if cuda else "this machine's CPU memory (MemAvailable)", cuda)
    if refused:
        raise EvalError(refused[0], 1, hint=refused[1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longspec.evaluate", description=__doc__.split("\n\n")[0])
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


def pick_prompts(args, conf: dict, complete: dict | None, tok, max_seq: int, limit: int):
    """(prompts, info, lengths) of this measurement (longspec.measure.prompts / longspec.measure.benchfiles), each
    prompt with its new-token limit and length bucket; info["prompts_over_longest"] counts those left out."""
    from longspec.measure import benchfiles, prompts as P
    from longspec.measure.report import default_lengths

    if args.bench is not None:
        kind, where = benchfiles.parse_bench(args.bench)
        if kind == "longbench":
            hi = args.max_prompt_tokens or max(1, limit - benchfiles.LIMIT_MARGIN)
            lo = benchfiles.MIN_PROMPT_TOKENS if args.min_prompt_tokens is None else args.min_prompt_tokens
            prompts, info = benchfiles.longbench_prompts(where, tok, min_tokens=lo, max_tokens=hi, n=args.num_prompts)
        else:
            prompts, info = benchfiles.aime_prompts(where, tok, n=args.num_prompts)
        lengths = args.lengths or default_lengths(max(max_seq, max(len(p.ids) for p in prompts)))
        prompts, info["prompts_over_longest"] = P.measured_prompts(prompts, lengths, args.max_new_tokens, max_seq)
        return prompts, info, lengths
    if args.prompts is not None:
        lengths = args.lengths or default_lengths(max_seq)
        prompts, info = P.file_prompts(args.prompts, tok, lengths=lengths, n=args.num_prompts)
        prompts, info["prompts_over_longest"] = P.measured_prompts(prompts, lengths, args.max_new_tokens, max_seq)
        return prompts, info, lengths
    data = args.data or as_path(_get(conf, "train_file"))
    if data is None:
        raise EvalError(f"{args.run_dir}: no train_file recorded", 2, hint="pass --prompts FILE or --data FILE")
    trained_on = as_path(_get(conf, "train_file"))
    same_data = trained_on is not None and Path(data).resolve() == trained_on.resolve()
    # a draft of this run (its final one, a checkpoint, best/) was trained on the records the run drew
    ours = args.draft is None or Path(args.run_dir).resolve() in Path(args.draft).resolve().parents
    steps = (complete or {}).get("steps") if ours and same_data else None
    prompts, info, lengths = P.default_prompts(Path(data), tok, conf, steps, lengths=args.lengths,
                                               num_prompts=args.num_prompts, max_new=args.max_new_tokens)
    if not same_data:
        info["heldout_check"] = "another file than the stage's train_file"
    return prompts, info, lengths


def evaluate(args: argparse.Namespace, log=None) -> dict:
    import torch

    from longspec.measure import perprompt, report, prompts as P
    from longspec.model.weights import DraftLoadError
    from longspec.files.atomic import sha256_file
    from longspec.project.stageview import StageView

    run_dir = args.run_dir
    conf, complete = read_run(run_dir)
    stage, draft, target, window = stage_draft(run_dir, conf, complete, args)
    max_seq = StageView.of(conf).max_seq_length

    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = pick_dtype(args.dtype, device, _get(conf, "precision"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    check_memory(args, target, max_seq, dtype, device)
    model, tw, gdraft, tok = load_models(target, draft, window, dtype, device)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    try:
        prompts, pinfo, lengths = pick_prompts(args, conf, complete, tok, max_seq, limit)
    except PromptError as e:
        raise EvalError(e.message, e.code, e.hint) from None
    over = pinfo.pop("prompts_over_longest")
    if log and pinfo.get("short_documents"):
        log(f"[{stage}] note: {pinfo['short_documents']} (--lengths sets the lengths)")
    if not prompts:
        raise EvalError(f"every prompt is longer than the longest length ({lengths[-1]} tokens)", 3,
                        hint="--lengths sets the buckets")
    if log:
        drawn = pinfo.get("prompts_drawn_in_training")
        counts = {n: sum(1 for p in prompts if p.bucket == n) for n in lengths}
        log(f"[{stage}] {len(prompts)} prompts from {pinfo['prompt_source']}"
            + (f" ({drawn} of them drawn in training)" if drawn else "")
            + (f", {over} longer than {lengths[-1]} tokens left out" if over else "")
            + ", by length " + ", ".join(f"{report.label(n)}: {c}" for n, c in counts.items())
            + f"; {' + '.join(args.method)} (gamma {args.gamma}, tree {list(args.tree_shape)}, "
            + f"temperature {args.temperature:g}), {device.type} {str(dtype).replace('torch.', '')}")
    baseline = None
    if args.baseline_draft is not None:
        if not args.baseline_draft.exists():
            raise EvalError(f"input draft not found: {args.baseline_draft}", 2)
        try:
            baseline = perprompt.load_baseline(args.baseline_draft, gdraft, dtype, device)
        except DraftLoadError as e:
            raise EvalError(f"input draft: {e}", 3) from None
    from longspec.model import kernels   # what each attention runs on, for eval.json's `backend`
    from longspec.decode import tree_attn
    backend = {"draft_attention": kernels.backend(device, dtype)["attention"],
               "tree_verify": tree_attn.setup_verify(model, device, dtype) if "tree" in args.method else None}
    methods = tuple(args.method)
    rows = perprompt.measure(model, tw, gdraft, prompts, gamma=args.gamma, device=device, log=log,
                               baseline=baseline, methods=methods, tree_shape=args.tree_shape,
                               temperature=args.temperature, seed=args.seed, no_stop=args.no_eos)
    figs = report.figures(rows, methods)
    per_method = {}
    for m in methods:
        same = [r["lossless" if m == methods[0] else f"{m}_lossless"] for r in rows]
        per_method[m] = {"method": m, **figs[m], "lossless": None if args.temperature > 0 else all(same),
                         "temperature": args.temperature, "gamma": args.gamma if m == "chain" else len(args.tree_shape),
                         "tree_shape": list(args.tree_shape) if m == "tree" else None,
                         "max_tau": (args.gamma if m == "chain" else len(args.tree_shape)) + 1}
    first = per_method[methods[0]]
    lens = [len(p.ids) for p in prompts]
    result = {
        "stage": str(stage),
        **{k: first[k] for k in ("tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup")},
        "method": methods[0], "gamma": args.gamma,
        "tree_shape": list(args.tree_shape) if methods[0] == "tree" else None,
        "temperature": args.temperature,
        "methods": per_method,
        "prompts": len(prompts),
        "lengths": lengths,
        "prompts_over_longest": over,
        "max_new_tokens": max(p.max_new for p in prompts),
        "context_tokens": round(sum(lens) / len(lens)),
        "context_tokens_max": max(lens),
        "lossless": None if args.temperature > 0 else all(pm["lossless"] for pm in per_method.values()),
        "draft_sha256": sha256_file(draft) if draft.is_file() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "draft": str(draft), "target": str(target),
        **pinfo,
        "device": device.type, "dtype": str(dtype).replace("torch.", ""), "sliding_window": window,
        "backend": backend,
        "generated_tokens": int(sum(r["new_tokens"] for r in rows)),
        "target_forwards": first["target_forwards"],
        "by_length": report.by_length(rows, lengths, methods),
    }
    if args.bench is None and args.prompts is None and args.data is None:      # the stage's own prompts
        from longspec.measure.chainwalk import same_as_training

        result["continuations"] = same_as_training(run_dir, target, prompts, rows)
    if args.bench is not None:
        result["by_task"] = report.by_task(rows, lengths, methods)
    if baseline is not None:
        bpath = args.baseline_draft
        result["baseline"] = {**figs["baseline"], "method": methods[0],
                              "lossless": None if args.temperature > 0 else all(r["baseline_lossless"] for r in rows),
                              "stage": args.baseline_stage, "draft": str(bpath),
                              "draft_sha256": sha256_file(bpath) if bpath.is_file() else None}
    result["per_prompt"] = [{k: v for k, v in r.items() if k != "_raw"} for r in rows]
    if not args.no_write:
        from longspec.files.atomic import atomic_write_json

        name = report.result_name(prompts=str(args.prompts) if args.prompts else None, bench=args.bench,
                                      nondefault=nondefault_settings(args))
        result["eval_json"] = str(run_dir / name)
        atomic_write_json(run_dir / name, result)
    return result


def method_label(m: dict) -> str:
    """'chain 4' or 'tree 4-16-16-16-16' (eval.json `methods` entry)."""
    if m.get("method") == "tree" and m.get("tree_shape"):
        return "tree " + "-".join(str(w) for w in m["tree_shape"])
    return f"{m.get('method', 'chain')} {m.get('gamma', '')}".strip()


def _print_table(r: dict) -> None:
    from longspec.measure.report import label

    lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}[r["lossless"]]
    temp = f", temperature {r['temperature']:g}" if r.get("temperature") else ""
    for m in r.get("methods", {}).values():
        print(f"stage {r['stage']}: {method_label(m)}{temp}: tau {m['tau']:.2f}, "
              f"speculative {m['spec_tokens_per_s']:.1f} tok/s vs target {m['target_tokens_per_s']:.1f} tok/s "
              f"= x{m['speedup']:.2f}")
    for b in r.get("by_length", []):
        print(f"  {label(b['length']):>6} tokens: {b['prompts']} prompts, "
              + ", ".join(f"{m} tau {b[m]['tau']:.2f}" for m in r.get("methods", {}) if m in b)
              + (f", input draft tau {b['baseline']['tau']:.2f}" if "baseline" in b else ""))
    print(f"stage {r['stage']}: {r['prompts']} prompts of ~{r['context_tokens']} tokens; lossless: {lossless}"
          + (f"; input draft ({r['baseline'].get('stage') or 'baseline'}) on the same prompts: "
             f"tau {r['baseline']['tau']:.2f}" if "baseline" in r else "")
          + (f"; wrote {r['eval_json']}" if r.get("eval_json") else ""))


def main(argv: list[str] | None = None) -> int:
    cudaarch.fix_environ()                       # an arch list DeepSpeed can parse, if it builds an op
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
