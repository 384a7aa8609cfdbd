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

    python -m longspec.evaluate --serve

measures one stage per request: each stdin line is a JSON list of the arguments above, each
answer one stdout line {"exit_code": N, "result": {...}} (or {"exit_code": N, "error", "hint"}),
progress on stderr; it ends at the end of stdin. The process starts and imports once, and keeps
the target and its tokenizer between requests when they run on the CPU (`longspec run` measures
its stages this way: they share one target). The body is longspec.measure.evalrun.
"""
from __future__ import annotations

import json
import sys

from longspec.files.tail import last_json
from longspec.machine import cudaarch
from longspec.measure.evalargs import parse_args
from longspec.measure.evalrun import Models, evaluate
from longspec.measure.runread import EvalError


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


def main(argv: list[str] | None = None, models: Models | None = None) -> int:
    cudaarch.fix_environ()                       # an arch list DeepSpeed can parse, if it builds an op
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    as_json = "--json" in argv
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        args = parse_args(argv)
        result = evaluate(args, log=log, models=models)
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



def serve() -> int:
    """One measurement per stdin line (a JSON list of arguments), one JSON answer line each."""
    import contextlib
    import io

    models = Models(keep=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            argv = json.loads(line)
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise ValueError("not a list of strings")
        except ValueError as e:
            print(json.dumps({"exit_code": 2, "error": f"a request must be a JSON list of arguments ({e})"}),
                  flush=True)
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                code = main([*argv, "--json"] if "--json" not in argv else argv, models=models)
            except SystemExit as e:                 # argparse's usage error (its message is on stderr)
                code = e.code if isinstance(e.code, int) else 2
                print(json.dumps({"error": "bad arguments (see the usage message above)", "exit_code": code}))
        answer = last_json(out.getvalue()) or {}
        print(json.dumps({"exit_code": code, **({"error": answer["error"], "hint": answer.get("hint")}
                                                  if "error" in answer else {"result": answer})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
