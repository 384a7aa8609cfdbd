"""`longspec regenerate DIR [STAGE ...]`: each stage's answers written again by its own target.

The work runs in `python -m longspec.regenerate` (this process never imports torch); `--use`
points the stage's train_file at the result with a one-line round-trip edit (longspec/files/yamledit.py);
both through launch/regen.py, which `longspec demo --regenerate` uses too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec regenerate demo longcot                 greedy answers from the local target

  longspec regenerate demo longcot --use           ... then train on them (train_file edited)

  longspec regenerate demo longcot --server http://node1:8000 --server http://node2:8000

  VLLM_KEY=... longspec regenerate demo longcot --server https://vllm.example:8000 --api-key-env VLLM_KEY

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
--concurrency requests at a time on each; 408, 429 and 5xx are retried with backoff. A server that
gives no answer (refused, reset, timed out) leaves the rotation until it answers again; when none
has answered for --server-wait seconds the run stops (exit 6), keeping the rows done. A row that
fails for itself (a 4xx, an answer that cannot be read) is recorded with its reason; the run then
exits 7, and the same command again asks exactly those rows again (no --force needed).
--api completions (default) sends the prompt as rendered here, less the BOS the server's tokenizer
adds back (the trainer's tokens); --api chat sends the turns with chat_template_kwargs.

A server that wants a key (vLLM --api-key, hosted endpoints) gets `Authorization: Bearer KEY`,
the key read from OPENAI_API_KEY or the variable --api-key-env names (once for all servers, or once
per --server in order); never from the command line, and shown in no output, log or manifest. A
URL with credentials in it is refused. A 401 or 403 stops the run at once (exit 1). The key goes to
its server alone: a redirect is not followed (refused, naming where it points), and what a server
writes back is shown only as a short excerpt, one line, with the key masked.

Servers that misbehave: a server serving another model than the stage's target is refused (exit 1;
--served-model NAME takes it on purpose, and the manifest records what served the rows); the first
/v1/models waits at most --server-wait; answers stream, and a request with no byte for
--idle-timeout seconds is abandoned and tried again; Retry-After is honoured up to 120 s; an answer
that is empty, longer than its token limit, over its byte bound or not text the tokenizer takes
fails its row (exit 7, asked again by a rerun). One run per stage: a second is refused (exit 1),
naming the process that writes the folder, --force or not.

--use refuses a folder with failed or missing rows unless --force. --force starts a folder made
otherwise (another source, target or setting) over; a folder made the same way is continued.

Exit codes: 0 ok, 1 refused (a folder made otherwise, a server that does not answer at the start,
a key a server refused, config errors), 2 usage (a URL with credentials, a key variable unset),
3 unreadable input, 5 stopped by SIGTERM, 6 stopped: no server answered for --server-wait
seconds, 7 rows failed, 130 Ctrl-C (5, 6, 7 and 130 keep the rows done; the same command again
goes on)."""


def regenerate_cmd(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    stages: Optional[List[str]] = typer.Argument(None, help="Stages to regenerate (default: all).", show_default=False),
    server: Optional[List[str]] = typer.Option(None, "--server", help="An OpenAI-compatible server's URL (repeat for several)."),
    api_key_env: Optional[List[str]] = typer.Option(
        None, "--api-key-env", help="The environment variable holding the servers' key (default OPENAI_API_KEY; "
        "once for all, or once per --server). Never the key itself."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Requests at a time per server."),
    server_wait: int = typer.Option(60, "--server-wait", min=1,
                                    help="Seconds without any server answering before the run stops (exit 6); "
                                    "also the bound on the first /v1/models."),
    idle_timeout: int = typer.Option(120, "--idle-timeout", min=1,
                                     help="Seconds with no byte from a server before a request is abandoned and tried "
                                     "again (after --retries, the row fails)."),
    retries: int = typer.Option(5, "--retries", min=0, help="Tries after the first for a request that failed for a "
                                "while (408, 429, 5xx, no byte for --idle-timeout, an answer cut off)."),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="The model the servers serve, when it is "
                                               "not named as the stage's target (the manifest records it)."),
    api: str = typer.Option("completions", "--api",
                            help="completions (the prompt as rendered here) or chat (the turns; the server renders)."),
    batch: int = typer.Option(8, "--batch", min=1, help="Prompts per batch on the local target."),
    prefix_tokens: int = typer.Option(128, "--prefix-tokens", min=1, help="A document's tokens kept as context."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="New tokens per answer (default: up to max_seq_length)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N records."),
    use: bool = typer.Option(False, "--use", help="Point the stage's train_file at the result."),
    force: bool = typer.Option(False, "--force", help="Start over when the folder was made otherwise; "
                               "with --use, use a folder with failed or missing rows."),
    keep_truncated: bool = typer.Option(False, "--keep-truncated", help="Keep answers cut at the token limit."),
    as_json: bool = typer.Option(False, "--json", help='Print {"stages": [...]} as JSON on stdout.'),
) -> None:
    """Regenerate each stage's answers with its own target (greedy), resumable, in source order."""

    def body() -> None:
        from longspec_cli.launch import regen

        req = regen.RegenRequest(project_dir, tuple(stages or ()), tuple(server or ()), tuple(api_key_env or ()),
                                 concurrency, server_wait, api, batch, prefix_tokens, max_new_tokens, limit, use, force,
                                 keep_truncated, idle_timeout, retries, served_model)
        root, results, errors = regen.regenerate(req, None if as_json else
                                                 (lambda name: typer.echo(f"== {name}", err=True)))
        if as_json:
            typer.echo(json.dumps({"project": str(root), "stages": results}, indent=2))
        else:
            for r in results:
                typer.echo(f"{r['stage']}: {r['kept']} rows kept, {r['truncated']} truncated, {r['failed']} failed, "
                           f"{r['skipped']} skipped, {r.get('untrainable', 0)} untrainable -> {r['out']}")
                if r.get("used"):
                    typer.echo(f"  {r['used']}")
        code = regen.stopped_code(results)
        if code is not None:
            raise typer.Exit(code)
        if errors:
            raise errors[0]

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("regenerate", help="Regenerate each stage's answers with its own target (resumable).",
                epilog=EPILOG)(regenerate_cmd)
