"""`longspec status DIR`: one row per stage (state, progress, loss, chaining) and what `run` would do next."""

from __future__ import annotations

from pathlib import Path

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec status demo

  longspec status demo/longspec.yaml --json

States: pending, running, queued or requeued (a SLURM job holds the stage: its job id is shown),
done, stale (config or input draft changed since the run), preempted, failed.
Each stage's data: ready (tokens, epochs the planned steps cover, untrainable records skipped),
missing, stale (train_file changed since `longspec prepare`), corrupt, or refused (more records
train nothing within max_seq_length than data.max_untrainable_share allows); `run` prepares what
is not ready.
A stage whose data `longspec regenerate` is writing shows `regenerating N/M rows` (interrupted once
its process is gone: rerun it to resume); one that ended shows its rows kept, truncated, failed,
skipped and untrainable (not written: nothing to train within max_seq_length; the first ids named).
A stage trained on another target's regenerated answers is stale.

Exit codes: 0 ok, 2 no such project, 3 unreadable longspec.yaml."""

STATE_STYLE = {"done": "green", "running": "cyan", "queued": "cyan", "requeued": "yellow", "pending": "white", "stale": "yellow", "failed": "red", "preempted": "yellow"}


def status(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help='Print {"stages": [...]} as JSON.'),
) -> None:
    """Show where each stage of a project stands and what `longspec run` would do next."""

    def body() -> None:
        from longspec.project.manifest import load_manifest
        from longspec.runs.status import project_status, run_plan

        from longspec.formats.prepared import project_prepared

        manifest = load_manifest(project_dir)
        stages = project_status(manifest)
        prepared = project_prepared(manifest)
        if as_json:
            import json

            typer.echo(json.dumps({"project": str(manifest.root),
                                   "stages": [{**s.to_json(), "prepared": prepared[s.name].to_json()}
                                              for s in stages],
                                   "next": run_plan(stages)}, indent=2))
            return
        _render(manifest, stages, run_plan(stages))
        _render_prepared(prepared)

    run_cli(body)


def _render(manifest, stages, plan: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"{manifest.name}  ({manifest.root})"), title_justify="left")
    for col in ("stage", "state", "step", "last loss", "tau", "tree tau", "draft from", "next action"):
        table.add_column(col, justify="right" if col in ("step", "last loss", "tau", "tree tau") else "left")
    for st in stages:
        step = "-" if st.steps is None else f"{st.steps}/{st.total_steps if st.total_steps is not None else '?'}"
        loss = "-" if st.last_loss is None else f"{st.last_loss:.4f}"
        tau = "-" if st.tau is None else f"{st.tau:.2f}" + (f" (x{st.speedup:.2f})" if st.speedup else "")
        tree = "-" if st.tree_tau is None else f"{st.tree_tau:.2f}" + (
            f" (x{st.tree_speedup:.2f})" if st.tree_speedup else "")
        table.add_row(Text(st.name), Text(st.state, style=f"bold {STATE_STYLE.get(st.state, '')}"), step, loss, tau, tree,
                      Text(st.draft_from or "(fresh)"), Text(st.next_action))
    console = Console(soft_wrap=True)
    console.print(table)
    for st in stages:
        if st.tau_by_length:
            console.print(Text(f"  {st.name}: tau by prompt length "
                               + ", ".join(f"{r['label']} {r['tau']:.2f}" + (f" (input draft {r['baseline_tau']:.2f})"
                                                                             if r.get("baseline_tau") is not None else "")
                                           for r in st.tau_by_length)))
        if st.sim_tau is not None:
            best = (f"; best/ {st.best_tau:.2f} at step {st.best_step}" if st.best_tau is not None else "")
            console.print(Text(f"  {st.name}: simulated tau {st.sim_tau:.2f} at step {st.sim_tau_step} (per position "
                               + " ".join(f"{a:.2f}" for a in st.sim_alpha or []) + f"){best}"))
        if st.draft_pick == "best":
            console.print(Text(f"  {st.name}: starts from {st.draft_from}'s best draft (draft_pick: best)", style="dim"))
        for reason in st.reasons:
            console.print(Text(f"  {st.name}: {reason}", style="dim"))
    console.print(Text("next: ", style="bold") + Text(plan))


def _render_prepared(prepared: dict) -> None:
    """One line per stage: its prepared data (tokens, epochs the planned steps cover) or why not."""
    for name, st in prepared.items():
        style = "dim" if st.state == "ready" else ("yellow" if st.state in ("stale", "corrupt", "missing", "refused") else "dim")
        typer.secho(f"  {name}: data {st.line()}", dim=style == "dim", fg="yellow" if style == "yellow" else None)


def register(app: typer.Typer) -> None:
    app.command("status", help="Show each stage's state (pending/running/queued/requeued/done/stale/preempted/failed) and the next step.",
                epilog=EPILOG)(status)
