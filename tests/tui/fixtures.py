"""Contract-true projects and run folders for the TUI tests and bench/bench_monitor.py.

A project is scaffolded by the real `init` code (launch.scaffold); a finished stage gets what the
trainer writes (docs/DESIGN.md, run-folder contract): metrics.jsonl (start, steps, checkpoint and
end events), train.log, run.json naming a process that is gone, draft_model_weights.pth and
stage_complete.json whose sha256 / config_sha256 / draft_sha256 match, so runs.status reads it
as done. Chaining goes through launch.chain like `longspec next-stage` does. Everything is
deterministic: fixed times, fixed numbers, fixed names.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

from longspec.machine import liveness
from longspec.runs import runfolder
from longspec.files.atomic import atomic_write_json, sha256_file
from longspec.project.manifest import load_manifest
from longspec_cli.launch.scaffold import InitAnswers, plan_project, write_project

T0 = 1_760_000_000.0  # fixed wall clock of the first record
STEP_S = 1.5  # seconds per step in the fixture runs
DEAD_PID = 4_194_399  # above Linux's largest pid_max: never a live process
DEAD_START = 123_456


def make_project(root: Path, name: str = "demo", stages=("base", "long", "longcot")) -> Path:
    answers = InitAnswers(project_dir=root, preset="qwq-32b-preview", name=name, stages=tuple(stages),
                          data={s: f"/data/{s}.jsonl" for s in stages})
    write_project(plan_project(answers))
    return root


def step_record(step: int, total: int, stage_index: int = 0) -> dict:
    base = 2.0 + 0.4 * stage_index
    loss = base + 6.0 * math.exp(-step / max(total / 4, 1)) + 0.05 * math.sin(step * 0.7)
    warm = max(1, total // 20)
    peak = 5e-4 / (10 ** stage_index)
    lr = peak * step / warm if step < warm else peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total - warm, 1)))
    return {"step": step, "total_steps": total, "loss": round(loss, 6), "llm_loss": round(loss * 0.93, 6),
            "lr": float(f"{lr:.6e}"), "tokens_per_s": round(21000 + 300 * math.sin(step / 13), 1),
            "elapsed_s": round(step * STEP_S, 3), "time": round(T0 + stage_index * 1e5 + step * STEP_S, 3)}


def metrics_lines(steps: int, total: int, stage_index: int = 0, *, save_every: int = 0,
                  end: bool = True) -> list[str]:
    t = T0 + stage_index * 1e5
    lines = [json.dumps({"event": "start", "step": 0, "time": t, "total_steps": total})]
    for s in range(1, steps + 1):
        lines.append(json.dumps(step_record(s, total, stage_index)))
        if save_every and s % save_every == 0:
            lines.append(json.dumps({"event": "checkpoint", "step": s, "time": t + s * STEP_S,
                                     "path": f"checkpoint-{s}"}))
    if end:
        lines.append(json.dumps({"event": "end", "step": steps, "time": t + steps * STEP_S}))
    return lines


def log_lines(stage: str, steps: int, total: int, stage_index: int = 0, every: int = 10) -> list[str]:
    out = [f"[launcher] longspec run: stage {stage}, 8 ranks", f"[rank0] {stage}: {total} optimizer steps"]
    for s in range(every, steps + 1, every):
        r = step_record(s, total, stage_index)
        out.append(f"[rank0] step {s}/{total} loss {r['loss']:.4f} lr {r['lr']:.3e}")
    return out


def write_run(root: Path, stage: str, *, steps: int, total: int, done: bool, alive_pid: bool = False) -> Path:
    """Write stage `stage`'s run folder: finished (done=True) or interrupted at `steps`."""
    m = load_manifest(root)
    spec = m.stage(stage)
    index = m.index(stage)
    out = spec.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / runfolder.METRICS).write_text("\n".join(metrics_lines(steps, total, index, save_every=100, end=done)) + "\n")
    (out / "train.log").write_text("\n".join(log_lines(stage, steps, total, index)) + "\n")
    if alive_pid:
        pid = os.getpid()
        info = {"pid": pid, "pgid": os.getpgid(pid), "host": socket.gethostname(), "proc_start": liveness.proc_start_time(pid)}
    else:
        info = {"pid": DEAD_PID, "pgid": DEAD_PID, "host": socket.gethostname(), "proc_start": DEAD_START}
    info.update(argv=["deepspeed", "--module", "longspec.train", f"+exp={stage}"], started_at="2025-10-09T08:53:20Z",
                overrides=[])
    atomic_write_json(out / runfolder.RUN_INFO, info)
    if done:
        weights = out / runfolder.WEIGHTS
        weights.write_bytes((f"fixture draft weights of stage {stage}\n" * 64).encode())
        upstream = m.previous(stage)
        draft_sha = None
        if upstream is not None:
            draft_sha = json.loads((upstream.output_dir / runfolder.STAGE_COMPLETE).read_text())["sha256"]
        atomic_write_json(out / runfolder.STAGE_COMPLETE, {
            "stage": stage, "steps": steps, "final_loss": step_record(steps, total, index)["loss"],
            "sha256": sha256_file(weights), "target": str(m.target), "config_sha256": runfolder.config_fingerprint(spec.config, []),
            "draft_sha256": draft_sha, "finished_at": "2025-10-09T10:00:00Z", "weights": runfolder.WEIGHTS,
        })
    return out


def chain(root: Path, stage: str) -> None:
    """Point `stage` at its upstream's final draft, as `longspec next-stage` does."""
    from longspec_cli.launch.chain import chain_project

    chain_project(load_manifest(root), stage, dry_run=False, deep=False)


def pipeline(root: Path, *, done=("base",), running: str | None = None, running_steps: int = 120,
             total: int = 400, name: str = "demo") -> Path:
    """A project whose stages in `done` finished (chained in order) and `running` is mid-run."""
    make_project(root, name=name)
    for stage in done:
        m = load_manifest(root)
        if m.previous(stage) is not None:
            chain(root, stage)
        write_run(root, stage, steps=total, total=total, done=True)
    if running:
        if load_manifest(root).previous(running) is not None:
            chain(root, running)
        write_run(root, running, steps=running_steps, total=total, done=False, alive_pid=True)
    return root


def big_metrics(path: Path, records: int, total: int | None = None) -> None:
    """`records` step records in one write (the benchmark's 200,000-record run)."""
    total = total or records
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"event": "start", "step": 0, "time": T0, "total_steps": total}) + "\n")
        for s in range(1, records + 1):
            f.write(json.dumps(step_record(s, total)) + "\n")
