"""`longspec next-stage DIR`: verify a finished stage's draft and point the next stage's config at it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import UsageError

EPILOG = """Examples:

  longspec next-stage demo --dry-run

  longspec next-stage demo --to longcot

  longspec next-stage demo --to long --best

  longspec next-stage --config conf/exp/long.yaml --draft runs/base/draft_model_weights.pth --json

  longspec next-stage demo --to long --in demo/conf/common/draft.yaml

Only the `draft_model_name_or_path:` line of the stage YAML changes (added after model_name_or_path when absent); comments, quoting and line endings stay as they are. A symlinked config is edited through the link. After the edit the stage is composed with Hydra, as the trainer composes it: when another file of its defaults list still decides the draft, the edit is rolled back (exit 1) and the message names that file and line (edit it with --in FILE). A `${...}` value is replaced only with --force. --best chains the upstream stage's best draft (best/: the highest simulated tau of its run) instead of its final one, and records the choice in longspec.yaml (`draft_pick: best` in the stage's entry; `status` and `run` follow it); without --best the final draft is chained and the entry says so again.

Exit codes: 0 done (or nothing to do), 1 refused (stage not complete, draft does not verify), 2 usage, 3 unreadable YAML or checkpoint."""


def next_stage(
    project_dir: Optional[Path] = typer.Argument(None, help="Project folder (or its longspec.yaml).",
                                                 show_default=False),
    to: Optional[str] = typer.Option(None, "--to", help="Stage to point at its upstream's draft "
                                     "(default: the first stage whose finished upstream is not chained yet)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Without a project: the stage YAML to edit."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Without a project: the draft (.pth, "
                                         ".safetensors or folder) to point it at."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the diff; change nothing."),
    deep: Optional[bool] = typer.Option(None, "--deep/--no-deep", help="Load the draft (weights_only=True) in "
                                        "a subprocess and check keys/shapes against the target "
                                        "(default: on when torch is installed).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print {config, key, old, new, changed, draft_sha256}."),
    edit_in: Optional[Path] = typer.Option(None, "--in", help="Edit this file of the stage's defaults list "
                                           "instead of the stage file (the one that decides the draft key)."),
    force: bool = typer.Option(False, "--force", help="Replace a `${...}` value of the draft key too."),
    best: bool = typer.Option(False, "--best", help="Chain the upstream stage's best draft (best/: highest "
                              "simulated tau) instead of its final one; recorded in longspec.yaml."),
) -> None:
    """Verify the previous stage's final draft and write its absolute path into the next stage's config."""

    def body() -> None:
        from longspec_cli.launch import chain

        if config is not None or draft is not None:
            if project_dir is not None or to is not None:
                raise UsageError("give either a project (DIR [--to STAGE]) or --config FILE --draft PATH, not both")
            if best:
                raise UsageError("--best picks a stage's best draft in a project; with --draft, name the file itself",
                                 hint="longspec next-stage --config FILE --draft RUN/best/draft_model_weights.pth")
            if config is None or draft is None:
                raise UsageError("explicit mode needs both --config FILE and --draft PATH")
            result = chain.chain_explicit(config, draft, dry_run=dry_run, deep=deep, edit_in=edit_in, force=force)
        else:
            if project_dir is None:
                raise UsageError("missing project folder",
                                 hint="longspec next-stage DIR, or longspec next-stage --config FILE --draft PATH")
            from longspec.project.manifest import load_manifest

            result = chain.chain_project(load_manifest(project_dir), to, dry_run=dry_run, deep=deep,
                                         edit_in=edit_in, force=force, pick="best" if best else "final")
        _report(result, dry_run=dry_run, as_json=as_json)

    run_cli(body)


def _report(result, *, dry_run: bool, as_json: bool) -> None:
    import json

    if result is None:
        if as_json:
            typer.echo(json.dumps({"changed": False, "written": False, "dry_run": dry_run,
                                   "message": "every finished stage is already chained"}))
        else:
            typer.echo("nothing to do: every stage with a finished upstream already points at its draft")
        return
    if as_json:
        typer.echo(json.dumps({**result.to_json(), "dry_run": dry_run}, indent=2, ensure_ascii=False))
        return
    which = " (best draft)" if result.draft_pick == "best" else ""
    label = f"{result.stage} <- {result.from_stage}{which}: " if result.stage else ""
    if result.note:
        typer.echo(f"note: {result.note}")
    sha = f" (sha256 {result.draft_sha256[:12]}...)" if result.draft_sha256 else ""
    deep = result.deep_check
    checked = ""
    if deep:
        checked = (f"; loads with weights_only=True ({deep.get('tensors')} tensors"
                   + (", keys/shapes fit the target" if deep.get("target_checked") else "") + ")")
    if not result.changed:
        typer.echo(f"{label}{result.key} already is {result.new}{sha}; nothing changed")
        return
    if dry_run:
        typer.echo(result.diff)
        typer.echo(f"dry run: {result.config} not changed{checked}")
        return
    typer.echo(f"{label}{result.config}: {result.key} = {result.new}{sha}{checked}")
    if result.manifest_changed:
        typer.echo(f"longspec.yaml: {result.stage} draft_pick = {result.draft_pick}")


def register(app: typer.Typer) -> None:
    app.command("next-stage", help="Verify a finished stage's draft and point the next stage's config at it.",
                epilog=EPILOG)(next_stage)
