"""`longspec regenerate DIR [STAGE ...]`: each stage's answers written again by its own target.

The work runs in `python -m longspec.regenerate` (this process never imports torch); `--use`
points the stage's train_file at the result with a one-line round-trip edit (core/yamledit.py);
both through launch/regen.py, which `longspec demo --regenerate` uses too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli
from longspec_cli.errors import INTERRUPTED, PREEMPTED, RefusedError, UsageError

EPILOG = """Examples:

  longspec regenerate demo longcot                 greedy answers from the local target

  longspec regenerate demo longcot --use           ... then train on them (train_file edited)

  longspec regenerate demo longcot --server http://node1:8000 --server http://node2:8000

Chat and chain-of-thought records keep their system and user turns; the target answers each
assistant turn on its own regenerated history, rendered by its chat template as the stage's
collator renders it. Documents keep their first --prefix-tokens tokens as untrained context and
train on the target's continuation (kept however it ends). Greedy (temperature 0).

Writes DIR/data/regen/STAGE/: parquet shards in source order (each row: id, the trained fields,
finish_reason, token counts) and manifest.json (target and tokenizer digests, the source's
fingerprint, prompt rule, settings, engine, counts). A rerun resumes after the last complete
shard; a changed source, target or setting is refused unless --force. Chat answers cut at the
token limit (max_seq_length minus the prompt) are dropped unless --keep-truncated; a row with no
token to train within max_seq_length (the target ended a document at once, an answer after a prompt
that fills the length) is never written: it is counted as untrainable, with the first few ids.

--server: OpenAI-compatible servers (`vllm serve TARGET` per node, or `transformers serve`),
--concurrency requests at a time on each; timeouts, 408, 429 and 5xx are retried with backoff.
--api completions (default) sends the prompt as rendered here, less the BOS the server's tokenizer
adds back (the trainer's tokens); --api chat sends the turns with chat_template_kwargs.

Exit codes: 0 ok, 1 refused (a folder made otherwise, a server that does not answer, config
errors), 2 usage, 3 unreadable input, 5 stopped by SIGTERM, 130 Ctrl-C (both keep the rows done;
a rerun goes on)."""


def regenerate_cmd(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stages: Optional[List[str]] = typer.Argument(None, help="Stages to regenerate (default: all).", show_default=False),
    server: Optional[List[str]] = typer.Option(None, "--server", help="An OpenAI-compatible server's URL (repeat for several)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Requests at a time per server."),
    api: str = typer.Option("completions", "--api",
                            help="completions (the prompt as rendered here) or chat (the turns; the server renders)."),
    batch: int = typer.Option(8, "--batch", min=1, help="Prompts per batch on the local target."),
    prefix_tokens: int = typer.Option(128, "--prefix-tokens", min=1, help="A document's tokens kept as context."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="New tokens per answer (default: up to max_seq_length)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N records."),
    use: bool = typer.Option(False, "--use", help="Point the stage's train_file at the result."),
    force: bool = typer.Option(False, "--force", help="Start over when the folder was made otherwise."),
    keep_truncated: bool = typer.Option(False, "--keep-truncated", help="Keep answers cut at the token limit."),
    as_json: bool = typer.Option(False, "--json", help='Print {"stages": [...]} as JSON on stdout.'),
) -> None:
    """Regenerate each stage's answers with its own target (greedy), resumable, in source order."""

    def body() -> None:
        from longspec_cli.core.manifest import load_manifest
        from longspec_cli.core.regenstate import stage_folder
        from longspec_cli.launch.regen import run_stage, use_folder

        if api not in ("completions", "chat"):
            raise UsageError(f"--api {api!r}: choose completions or chat")
        manifest = load_manifest(project_dir)
        chosen = [manifest.stage(s) for s in stages] if stages else list(manifest.stages)
        flags = [*(a for u in server or () for a in ("--server", u)), "--concurrency", str(concurrency), "--api", api,
                 "--batch", str(batch), "--prefix-tokens", str(prefix_tokens)]
        flags += ["--max-new-tokens", str(max_new_tokens)] if max_new_tokens else []
        flags += ["--limit", str(limit)] if limit else []
        flags += ["--force"] if force else []
        flags += ["--keep-truncated"] if keep_truncated else []
        results = []
        for spec in chosen:
            out = stage_folder(manifest.root, spec.name)
            if not as_json:
                typer.echo(f"== {spec.name}", err=True)
            r = run_stage(spec, out, flags, show_progress=not as_json)
            if use and r.get("complete") and r.get("kept", 0) + (r.get("truncated", 0) if keep_truncated else 0):
                r["used"] = use_folder(spec.config, out)
            results.append(r)
            if r.get("stopped_by"):
                break
            if use and not r.get("used"):
                why = "is not complete" if not r.get("complete") else "kept no row"
                raise RefusedError(f"{spec.name}: the regeneration {why}; train_file left as it is ({out})",
                                   hint="see the counts above; --keep-truncated keeps answers cut at the limit")
        if as_json:
            typer.echo(json.dumps({"project": str(manifest.root), "stages": results}, indent=2))
        else:
            for r in results:
                typer.echo(f"{r['stage']}: {r['kept']} rows kept, {r['truncated']} truncated, {r['failed']} failed, "
                           f"{r['skipped']} skipped, {r.get('untrainable', 0)} untrainable -> {r['out']}")
                if r.get("used"):
                    typer.echo(f"  {r['used']}")
        stopped = next((r["stopped_by"] for r in results if r.get("stopped_by")), None)
        if stopped:
            raise typer.Exit(INTERRUPTED if stopped == "SIGINT" else PREEMPTED)

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("regenerate", help="Regenerate each stage's answers with its own target (resumable).",
                epilog=EPILOG)(regenerate_cmd)
