"""`longspec monitor [DIR]`: a live full-screen view of a project, or `--once` a one-shot summary.

textual is imported only inside the command, and only for the live view: `--once` (CI logs,
no TTY) reads the same run-folder tails through the pure follower.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import typer

from longspec_cli.boundary import run_cli
from longspec.errors import UsageError

EPILOG = """Examples:

  longspec monitor my-proj

  longspec monitor my-proj --once --json

Keys: q quit, n next-stage (after a confirm showing the diff), r run the next stage, s stop,
left/right view other stages, ? help. --once exits 1 when a stage failed or an error alert is up."""


def monitor(
    project_dir: Path = typer.Argument(Path("."), help="Project folder (holds longspec.yaml)."),
    once: bool = typer.Option(False, "--once", help="Print a summary and exit (no terminal needed)."),
    as_json: bool = typer.Option(False, "--json", help="With --once: print the summary as JSON."),
    poll: float = typer.Option(0.5, "--poll", min=0.1, max=60.0, help="Seconds between polls of the run folders."),
) -> None:
    """Follow training live: stages, progress, loss/lr charts, train.log, GPUs, alerts."""

    def body() -> None:
        if as_json and not once:
            raise UsageError("--json goes with --once", hint="longspec monitor DIR --once --json")
        if once:
            _once(project_dir, as_json)
            return
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise UsageError("the live monitor needs a terminal",
                             hint=f"for logs and CI use: longspec monitor {project_dir} --once [--json]")
        from longspec_cli.tui.monitor_app import MonitorApp

        MonitorApp(project_dir, poll_s=poll).run()

    run_cli(body)


def summary(project_dir: Path) -> dict:
    """The --once summary as plain data (stages, alerts, what `run` would do next)."""
    from longspec.runs.status import run_plan
    from longspec_cli.tui.follow import ProjectFollower

    f = ProjectFollower(project_dir).open()
    key, statuses = f.refresh_status()
    f.set_status(key, statuses)
    view = f.view()
    prepared = _prepared(f, project_dir)
    return {
        "project": view.name,
        "root": view.root,
        "current": view.stages[view.current].name,
        "stages": [
            {
                "name": s.name, "state": s.state, "step": s.step, "total_steps": s.total_steps,
                "loss": s.loss, "llm_loss": s.llm_loss, "lr": s.lr, "tokens_per_s": s.tokens_per_s,
                "elapsed_s": s.elapsed_s, "eta_s": s.eta_s, "sha256": s.sha256, "draft_from": s.draft_from,
                "output_dir": s.output_dir, "next_action": s.next_action, "reasons": list(s.reasons),
                "skipped_lines": s.skipped_lines, "notices": list(s.notices), "tau": s.tau, "tree_tau": s.tree_tau,
                "simulated_tau": s.simtau[-1].tau if s.simtau else None,
                "simulated_tau_step": s.simtau[-1].step if s.simtau else None,
                "prepared": prepared.get(s.name),
            }
            for s in view.stages
        ],
        "alerts": [{"level": a.level, "kind": a.kind, "stage": a.stage, "message": a.message} for a in view.alerts],
        "notice": view.notice,
        "next": run_plan(statuses),
    }


def _prepared(follower, project_dir: Path) -> dict:
    """Each stage's prepared data as JSON ({} when the project cannot be read)."""
    from longspec.project.manifest import load_manifest
    from longspec.formats.prepared import project_prepared
    from longspec.errors import LongspecError

    try:
        return {k: v.to_json() for k, v in project_prepared(load_manifest(project_dir)).items()}
    except LongspecError:
        return {}


def _once(project_dir: Path, as_json: bool) -> None:
    data = summary(project_dir)
    if as_json:
        typer.echo(json.dumps(_nulls(data), indent=2))
    else:
        typer.echo(_text(data))
    if any(a["level"] == "error" for a in data["alerts"]) or any(s["state"] == "failed" for s in data["stages"]):
        raise typer.Exit(1)


def _text(d: dict) -> str:
    from longspec_cli.tui.views import fmt_duration

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    rows = [("stage", "state", "step", "loss", "llm_loss", "lr", "tok/s", "elapsed", "ETA", "tau", "tree tau", "draft")]
    for s in d["stages"]:
        step = "-" if s["step"] is None else f"{s['step']}/{s['total_steps'] or '?'}"
        rows.append((s["name"], s["state"], step, num(s["loss"], ".4f"), num(s["llm_loss"], ".4f"),
                     num(s["lr"], ".2e"), num(s["tokens_per_s"], ",.0f"), fmt_duration(s["elapsed_s"]),
                     fmt_duration(s["eta_s"]) if s["state"] == "running" else "-", num(s.get("tau"), ".2f"),
                     num(s.get("tree_tau"), ".2f"), (s["sha256"] or "-")[:12]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"project {d['project']} ({d['root']})"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in d["stages"]:
        for why in s["reasons"]:
            lines.append(f"  {s['name']}: {why}")
        if s["skipped_lines"]:
            lines.append(f"  {s['name']}: {s['skipped_lines']} malformed metrics line(s) skipped")
    if d["notice"]:
        lines.append(d["notice"])
    for a in d["alerts"]:
        lines.append(f"{a['level'].upper()}: {a['message']}")
    lines.append(f"next: {d['next']}")
    return "\n".join(lines)


def _nulls(obj):
    """NaN/inf -> null, so the output stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nulls(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nulls(v) for v in obj]
    return obj


def register(app: typer.Typer) -> None:
    app.command("monitor", epilog=EPILOG)(monitor)
