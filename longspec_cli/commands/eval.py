"""`longspec eval DIR [STAGE ...]`: tau, speed-up and losslessness of each finished stage's draft.

The measuring runs in `python -m longspec.evaluate` (this process never imports torch); each
stage's result lands in its run folder as eval.json and is printed here as one table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec eval demo

  longspec eval demo base --gamma 4 --max-new-tokens 128

  longspec eval demo long --prompts my_prompts.jsonl --json

  longspec eval demo long --lengths 1k,4k,16k,32k

  longspec eval demo long --bench longbench:~/data/LongBench/data.zip --num-prompts 20

  longspec eval demo longcot --bench aime:~/data/aimo-validation-aime/data/train-00000-of-00001.parquet

  longspec eval demo --method tree --tree-shape 4 16 16 16 16

  longspec eval demo base --method chain --temperature 0.7

Methods (both by default, on the same prompts; the first one given is eval.json's headline and
what the quality gate compares):
  chain  the draft proposes --gamma tokens in a row; the target checks them in one forward.
  tree   the draft grows a token tree, level by level; --tree-shape W1 W2 ... gives the number
         of nodes of each level IN TOTAL (not per parent), so the depth is the number of values
         and a round can accept at most that many draft tokens. Level 1 = the draft's top W1 next
         tokens; level d+1 = the best W(d+1) (parent, token) pairs over all of level d, scored by
         the summed draft log-probability of the path. The target verifies the whole tree in one
         forward (tree attention mask over its KV cache) and keeps the longest path it agrees with.
         Default 4 16 16 16 16 (depth 5, 68 draft tokens per target forward); 1 1 1 1 = the chain.
tau = tokens per target forward: accepted draft tokens + the target's own bonus token.

--temperature 0 (default): greedy; every method's output must equal plain greedy decoding token
for token (lossless). --temperature T > 0: speculative sampling (accept a draft token with
probability min(1, p/q), else resample from the residual; recursively over a node's children in
the tree), so the output follows the target's own sampling distribution; `lossless` is then n/a.

Prompts: the newest held-out records of each stage's train_file (records its run never drew).
A chat or chain-of-thought record gives its question: the conversation up to the last user turn
with the chat template's generation prompt (its answer is never in the prompt); a document gives
its first L tokens for each length L. Decoding stops at the end of turn / EOS or after
--max-new-tokens (default 1024 for documents and chats, 200 for chain-of-thought, as upstream's
LongBench and AIME scripts; at most an eighth of the stage's max_seq_length).

--lengths 1k,4k,16k,32k: the context-length buckets (default: powers of two from 1k up to the
stage's max_seq_length and that length, two at least); a prompt counts in the smallest length
that holds it. tau is reported per bucket, next to the input draft's (the draft_from stage's
final draft on the same prompts); the quality gate compares them at the longest bucket.

--bench longbench:FOLDER reads LongBench's gov_report, qmsum, multi_news, lcc and repobench-p
.jsonl files (any subset), from the folder or from LongBench's data.zip as downloaded
(huggingface.co/datasets/THUDM/LongBench), keeps prompts of --min-prompt-tokens (1200) to
--max-prompt-tokens (the target's limit - 2000) and reports per task; --bench aime:FILE reads
problems (`problem` or `question`) from JSONL or the set's parquet as downloaded
(AI-MO/aimo-validation-aime). Nothing is downloaded.

The default measurement is written to each stage's eval.json (what status and the gate read);
--prompts, --bench or other settings write eval-<what>.json next to it.

Exit codes: 0 ok, 1 not lossless or a stage without a finished draft, 2 usage, 3 unreadable input."""


def eval_cmd(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stages: Optional[List[str]] = typer.Argument(None, help="Stages to evaluate (default: every finished stage).",
                                                 show_default=False),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON/JSONL prompts: strings or {\"prompt\": ...}."),
    method: Optional[List[str]] = typer.Option(None, "--method", help="chain or tree; repeat for both "
                                               "(default: chain and tree).", show_default=False),
    gamma: int = typer.Option(4, "--gamma", min=1, max=32, help="Chain: draft tokens proposed per target forward."),
    tree_shape: Optional[str] = typer.Option(None, "--tree-shape", help="Tree: nodes per level in total, "
                                             "e.g. --tree-shape 4 16 16 16 16 (default) or 4,16,16.",
                                             show_default=False),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (lossless); > 0 = "
                                      "speculative sampling at this temperature."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="Tokens generated per prompt at most (default: 1024, 200 "
                                                      "for chain-of-thought; an eighth of max_seq_length at most).",
                                                 show_default=False),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1,
                                              help="Prompts per length bucket (default: 8 to 32, 4,096 prompt "
                                                   "tokens' worth); per task with --bench (default: all)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Context-length buckets, e.g. 1k,4k,16k,32k "
                                          "(default: powers of two from 1k up to max_seq_length).", show_default=False),
    bench: Optional[str] = typer.Option(None, "--bench", help="longbench:FOLDER|data.zip (LongBench .jsonl files) or "
                                        "aime:FILE (problems: JSONL or parquet): the paper's benchmarks from local files.",
                                        show_default=False),
    min_prompt_tokens: Optional[int] = typer.Option(None, "--min-prompt-tokens", min=0,
                                                    help="--bench longbench: shortest prompt kept (default 1200).",
                                                    show_default=False),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1,
                                                    help="--bench longbench: longest prompt kept (default: the "
                                                         "target's limit - 2000).", show_default=False),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                  help="Also decode each stage's prompts with its input draft (the draft_from "
                                       "stage's final draft)."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"results\": [...]} as JSON."),
) -> None:
    """Measure each stage's draft: tau (tokens per target forward), tokens/s, speed-up, lossless."""

    def body() -> None:
        from longspec_cli.launch import evalrun

        req = evalrun.EvalRequest(project_dir, tuple(stages or ()), prompts, tuple(dict.fromkeys(method or
                                  evalrun.METHODS)), gamma, tree_shape, temperature, max_new_tokens, num_prompts,
                                  lengths, bench, (min_prompt_tokens, max_prompt_tokens), device, baseline)
        say = None if as_json else (lambda name: typer.echo(f"evaluating {name} ...", err=True))
        outcome = evalrun.evaluate(req, say)
        if as_json:
            typer.echo(json.dumps({"project": str(outcome.project), "results": outcome.results,
                                   "skipped": outcome.skipped, "lossless": outcome.lossless}, indent=2))
        else:
            _render(outcome.results, outcome.skipped)
        evalrun.not_lossless(outcome)

    run_cli(body)


def _label(m: dict) -> str:
    if m.get("method") == "tree" and m.get("tree_shape"):
        return "tree " + "-".join(str(w) for w in m["tree_shape"])
    return f"chain {m.get('gamma', '')}".strip()


def _render(results: list[dict], skipped: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    first = results[0]
    temp = first.get("temperature") or 0
    kind = f"speculative sampling (temperature {temp:g})" if temp else "greedy speculative decoding"
    table = Table(title=f"{kind}: {first['prompts']} prompts x {first['max_new_tokens']} new tokens",
                  title_justify="left")
    for col in ("stage", "method", "tau", "input draft", "tok/s spec/plain", "speed-up", "context", "lossless"):
        table.add_column(col, justify="left" if col in ("stage", "method", "lossless") else "right")
    for r in results:
        base = r.get("baseline")
        methods = r.get("methods") or {"chain": {**r, "method": "chain"}}
        for i, m in enumerate(methods.values()):
            ok = m.get("lossless")
            flag = Text("n/a" if ok is None else "yes" if ok else "NO",
                        style="dim" if ok is None else "green" if ok else "bold red")
            table.add_row(Text(str(r["stage"]) if i == 0 else ""), _label(m), f"{m['tau']:.2f}",
                          f"{base['tau']:.2f}" if base and i == 0 else "-",
                          f"{m['spec_tokens_per_s']:.0f} / {m['target_tokens_per_s']:.0f}", f"x{m['speedup']:.2f}",
                          f"~{r['context_tokens']}", flag)
    console = Console(soft_wrap=True)
    console.print(table)
    lengths = length_table(results)
    if lengths is not None:
        console.print(lengths)
    for r in results:
        if r.get("state") == "stale":
            console.print(Text(f"  {r['stage']}: stale (its config or input draft changed since it was trained)",
                               style="yellow"))
        drawn = r.get("prompts_drawn_in_training")
        note = f"; {drawn} prompt(s) were drawn in training" if drawn else ""
        console.print(Text(f"  {r['stage']}: wrote {r.get('eval_json', 'eval.json')} "
                           f"({r['device']}, {r['dtype']}; tau = tokens per target forward{note})", style="dim"))
    if any(r.get("baseline") for r in results):
        console.print(Text("  input draft: tau of the draft_from stage's final draft on the same prompts (first method)",
                           style="dim"))
    for s in skipped:
        console.print(Text(f"  {s['stage']}: skipped, no finished draft ({s['state']})", style="dim"))


def length_table(results: list[dict]):
    """tau by context length per stage (eval.json by_length), next to the input draft's; None
    when no result has length buckets. Shared by `eval` and `run`'s summary."""
    from rich.table import Table

    from longspec.runs.quality import length_label

    if not any(r.get("by_length") for r in results):
        return None
    table = Table(title="tau by context length (prompt tokens)", title_justify="left")
    for col in ("stage", "length", "prompts", "chain tau", "tree tau", "input draft", "speed-up"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in results:
        for i, b in enumerate(r.get("by_length") or []):
            chain, tree, base = b.get("chain"), b.get("tree"), b.get("baseline")
            head = chain or tree or {}
            table.add_row(str(r["stage"]) if i == 0 else "", length_label(b["length"]), str(b["prompts"]),
                          f"{chain['tau']:.2f}" if chain else "-", f"{tree['tau']:.2f}" if tree else "-",
                          f"{base['tau']:.2f}" if base else "-",
                          f"x{head['speedup']:.2f}" if head.get("speedup") is not None else "-")
        for t in r.get("by_task") or []:
            chain, tree, base = t.get("chain"), t.get("tree"), t.get("baseline")
            table.add_row("", f"task {t['task']}", str(t["prompts"]), f"{chain['tau']:.2f}" if chain else "-",
                          f"{tree['tau']:.2f}" if tree else "-", f"{base['tau']:.2f}" if base else "-", "")
    return table


def register(app: typer.Typer) -> None:
    app.command("eval", help="Measure each finished stage's draft: tau, tokens/s, speed-up, lossless.",
                epilog=EPILOG)(eval_cmd)

