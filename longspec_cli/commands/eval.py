"""`longspec eval DIR [STAGE ...]`: tau, speed-up and losslessness of each finished stage's draft.

The measuring runs in `python -m longspec.evaluate` (this process never imports torch); each
stage's result lands in its run folder as eval.json and is printed here as one table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.errors import RefusedError, UsageError, run_cli
from longspec_cli.launch.jsonproc import run_trainer_json

EPILOG = """Examples:

  longspec eval demo

  longspec eval demo base --gamma 4 --max-new-tokens 128

  longspec eval demo long --prompts my_prompts.jsonl --json

Default prompts: the last --num-prompts records of each stage's train_file, cut to the stage's
context length (short for base, long for long/longcot). Each prompt is decoded twice, plainly
and speculatively; the outputs must be identical (lossless).

Exit codes: 0 ok, 1 not lossless or a stage without a finished draft, 2 usage, 3 unreadable input."""

FINISHED = ("done", "stale")


def eval_cmd(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stages: Optional[List[str]] = typer.Argument(None, help="Stages to evaluate (default: every finished stage).",
                                                 show_default=False),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON/JSONL prompts: strings or {\"prompt\": ...}."),
    gamma: int = typer.Option(4, "--gamma", min=1, max=32, help="Draft tokens proposed per target forward."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Tokens generated per prompt."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1,
                                              help="Held-out records to use as prompts (default: 8 to 32, "
                                                   "4,096 prompt tokens' worth)."),
    context_tokens: Optional[int] = typer.Option(None, "--context-tokens", min=1,
                                                 help="Prompt length (default: the stage's max_seq_length - max_new_tokens)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                  help="Also decode each stage's prompts with its draft_from stage's draft."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"results\": [...]} as JSON."),
) -> None:
    """Measure each stage's draft: tau (tokens per target forward), tokens/s, speed-up, lossless."""

    def body() -> None:
        from longspec_cli.core.manifest import load_manifest
        from longspec_cli.core.quality import eval_command
        from longspec_cli.core.status import project_status

        if prompts is not None and not prompts.is_file():
            raise UsageError(f"--prompts {prompts}: no such file")
        if device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
        manifest = load_manifest(project_dir)
        chosen = [manifest.stage(s).name for s in stages] if stages else manifest.stage_names
        states = {st.name: st for st in project_status(manifest)}
        todo, skipped = [], []
        for name in chosen:
            st = states[name]
            if st.state in FINISHED:
                todo.append(st)
            elif stages:
                raise RefusedError(f"stage {name} has no finished draft (state: {st.state})",
                                   hint=f"train it first: longspec run {project_dir} {name}")
            else:
                skipped.append({"stage": name, "state": st.state})
        if not todo:
            raise RefusedError("no stage has a finished draft yet",
                               hint=f"train one first: longspec run {project_dir} --all")
        results = []
        for st in todo:
            if not as_json:
                typer.echo(f"evaluating {st.name} ...", err=True)
            up = states.get(st.draft_from) if st.draft_from else None
            up_ok = up is not None and up.state in FINISHED and up.draft_weights is not None and baseline
            argv = eval_command(st.output_dir, st.name, gamma=gamma, max_new_tokens=max_new_tokens,
                                num_prompts=num_prompts, prompts=prompts.resolve() if prompts else None, device=device,
                                baseline_draft=up.draft_weights if up_ok else None,
                                baseline_stage=up.name if up_ok else None)
            if context_tokens is not None:
                argv += ["--context-tokens", str(context_tokens)]
            res = run_trainer_json(argv, show_progress=not as_json, allow_codes=(1,))
            res["state"] = st.state
            results.append(res)
        lossless = all(r.get("lossless") is True for r in results)
        if as_json:
            typer.echo(json.dumps({"project": str(manifest.root), "results": results, "skipped": skipped,
                                   "lossless": lossless}, indent=2))
        else:
            _render(results, skipped)
        if not lossless:
            bad = ", ".join(r["stage"] for r in results if r.get("lossless") is not True)
            raise RefusedError(f"speculative output differs from plain greedy output for: {bad}",
                               hint="see first_mismatch per prompt in the stage's eval.json")

    run_cli(body)


def _render(results: list[dict], skipped: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    first = results[0]
    table = Table(title=f"greedy speculative decoding: gamma {first['gamma']}, {first['prompts']} prompts x "
                        f"{first['max_new_tokens']} new tokens", title_justify="left")
    for col in ("stage", "tau", "upstream", "tok/s spec/plain", "speed-up", "context", "lossless"):
        table.add_column(col, justify="left" if col in ("stage", "lossless") else "right")
    for r in results:
        ok = r.get("lossless") is True
        base = r.get("baseline")
        table.add_row(Text(str(r["stage"])), f"{r['tau']:.2f}", f"{base['tau']:.2f}" if base else "-",
                      f"{r['spec_tokens_per_s']:.0f} / {r['target_tokens_per_s']:.0f}", f"x{r['speedup']:.2f}",
                      f"~{r['context_tokens']}", Text("yes" if ok else "NO", style="green" if ok else "bold red"))
    console = Console(soft_wrap=True)
    console.print(table)
    for r in results:
        if r.get("state") == "stale":
            console.print(Text(f"  {r['stage']}: stale (its config or input draft changed since it was trained)",
                               style="yellow"))
        drawn = r.get("prompts_drawn_in_training")
        note = f"; {drawn} prompt(s) were drawn in training" if drawn else ""
        console.print(Text(f"  {r['stage']}: wrote {r.get('eval_json', 'eval.json')} "
                           f"({r['device']}, {r['dtype']}; tau = tokens per target forward{note})", style="dim"))
    if any(r.get("baseline") for r in results):
        console.print(Text("  upstream: tau of the draft_from stage's draft on the same prompts", style="dim"))
    for s in skipped:
        console.print(Text(f"  {s['stage']}: skipped, no finished draft ({s['state']})", style="dim"))


def register(app: typer.Typer) -> None:
    app.command("eval", help="Measure each finished stage's draft: tau, tokens/s, speed-up, lossless.",
                epilog=EPILOG)(eval_cmd)

