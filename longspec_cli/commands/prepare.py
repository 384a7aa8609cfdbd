"""`longspec prepare DIR [STAGE ...]`: tokenize each stage's train_file once into its cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec prepare demo                  every stage's data

  longspec prepare demo base --workers 4

  longspec prepare demo --json           one JSON object with a result per stage

  longspec prepare demo longcot --show 3 the first 3 records, trained tokens marked

`--show K` prints the first K records of each stage as the trainer encodes them, without
tokenizing the whole file: the trained tokens in colour on a terminal and in [brackets] without
one, and per record the counts of prompt, trained and cut tokens. A chat record trains each
assistant answer and its end-of-turn token(s), never system, user or header text. With --json:
{"stage", "collator", "records": [{"index", "line", "tokens": [[id, text, trained], ...],
"prompt", "trained", "cut", ...}]} for one stage, {"stages": [...]} for several.

The cache (flat token ids, trained-label mask, offsets, manifest) lives under
$LONGSPEC_CACHE_DIR/prepared (default: $XDG_CACHE_HOME/longspec/prepared, else
~/.cache/longspec/prepared). It is keyed by the train file's path,
the tokenizer files and the data options, and rebuilt when the file's content changes or the
cache is damaged. `longspec run` prepares a missing cache itself before DeepSpeed starts; the
trainer memory-maps it, so restarts and resumes never tokenize again.

The summary: records, tokens, trained tokens, skipped bad records, untrainable records (nothing to
train within max_seq_length: skipped, the first few named FILE:row N), the truncated fraction, a
length histogram and the steps one epoch gives at the stage's global batch (launch.gpus x
launch.nodes ranks). Progress (records, tokens/s, ETA) goes to stderr.

Exit codes: 0 ok, 1 refused (config errors; more untrainable records than
data.max_untrainable_share allows, with the figures), 2 usage, 3 unreadable input (a malformed
record: file:line; set data.on_bad_record: skip to leave such records out)."""


def prepare(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stages: Optional[List[str]] = typer.Argument(None, help="Stages to prepare (default: all).", show_default=False),
    workers: Optional[int] = typer.Option(None, "--workers", min=1,
                                          help="Tokenizer processes (default: 1 for plain text, one per core "
                                               "up to 8 for chat-template collators)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"stages": [...]} as JSON on stdout.'),
    show: Optional[int] = typer.Option(None, "--show", min=1, metavar="K",
                                       help="Print the first K records with their trained tokens marked "
                                            "(no cache is built)."),
) -> None:
    """Tokenize each stage's train_file once into a memory-mapped cache (progress, summary, histogram)."""

    def body() -> None:
        if show is not None:
            _show(project_dir, stages, show, as_json)
            return
        from longspec.project.manifest import load_manifest
        from longspec.formats.prepared import result_text as prepared_text
        from longspec_cli.launch import prepare as LP

        manifest = load_manifest(project_dir)
        chosen = [manifest.stage(s) for s in stages] if stages else list(manifest.stages)
        world = LP.world_of(manifest)
        results = []
        for spec in chosen:
            if not as_json:
                typer.echo(f"== {spec.name}", err=True)
            hit = LP.ready_result(manifest, spec, [], world)
            if hit is not None and not as_json:
                typer.echo("\n".join(prepared_text(hit)), err=True)
            results.append(hit or LP.run_prepare(spec, [], world, workers, show_progress=True))
        if as_json:
            typer.echo(json.dumps({"project": str(manifest.root), "stages": results}, indent=2))

    run_cli(body)


def _show(project_dir: Path, stages: Optional[List[str]], count: int, as_json: bool) -> None:
    import sys

    from longspec.formats import trainedview as V
    from longspec.project.manifest import load_manifest
    from longspec_cli.launch import prepare as LP

    manifest = load_manifest(project_dir)
    chosen = [manifest.stage(s) for s in stages] if stages else list(manifest.stages)
    results = [LP.run_show(spec, [], count) for spec in chosen]
    if as_json:
        typer.echo(json.dumps(results[0] if len(results) == 1 else {"stages": results}))
        return
    console = None
    if sys.stdout.isatty():
        from rich.console import Console
        console = Console(highlight=False)
    typer.echo(V.legend())
    for spec, r in zip(chosen, results):
        typer.echo(f"\n== {spec.name} ({r['collator']}, max_seq_length {r['max_seq_length']:,})")
        for rec in r["records"]:
            typer.echo(f"-- {V.header(rec)}")
            if console is not None:
                console.print(V.rich_text(rec), soft_wrap=True)
            else:
                typer.echo(V.plain(rec))


def register(app: typer.Typer) -> None:
    app.command("prepare", help="Tokenize each stage's train_file once into a memory-mapped cache.",
                epilog=EPILOG)(prepare)
