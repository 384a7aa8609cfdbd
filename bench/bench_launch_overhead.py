"""What `longspec run` costs on top of the bare DeepSpeed command of the same stage.

    .venv/bin/python bench/bench_launch_overhead.py [--project DIR] [--repeats N] [--stage base]

Builds a tiny-preset project (unless --project is given), then prints:
  1. wall of `longspec run DIR STAGE --dry-run` (CLI start, manifest, status, validation, memory
     estimate, argv) - median of N;
  2. the same stage run both ways, alternating, N times each, with max_steps=2:
     bare = the exact command `--dry-run` prints, run by the shell;
     longspec = `longspec run DIR STAGE --force`;
     overhead = longspec wall - (run.json ended_unix - started_unix), i.e. everything `longspec run`
     did before starting DeepSpeed and after it exited, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONGSPEC = [sys.executable, "-m", "longspec_cli"]


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)
    return time.perf_counter() - t0, proc


def cpu_of(cmd: list[str]) -> float:
    """user + sys seconds of a command (and anything it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, capture_output=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ensure_project(project: Path | None) -> Path:
    if project is not None:
        return project
    d = Path(tempfile.mkdtemp(prefix="ls-bench-")) / "proj"
    t, proc = timed([*LONGSPEC, "init", str(d), "--preset", "tiny", "--no-input"])
    if proc.returncode != 0:
        sys.exit(f"init failed:\n{proc.stdout}\n{proc.stderr}")
    print(f"project: {d} (init + tiny assets {t:.1f} s)")
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", type=Path)
    ap.add_argument("--stage", default="base")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-full", action="store_true", help="only the --dry-run timing")
    a = ap.parse_args()
    proj = ensure_project(a.project)
    overrides = ["max_steps=2", "save_steps=2"]

    t_help = statistics.median(timed([*LONGSPEC, "--help"])[0] for _ in range(a.repeats))
    dry = [timed([*LONGSPEC, "run", str(proj), a.stage, "--dry-run", *overrides]) for _ in range(max(a.repeats, 3))]
    if dry[0][1].returncode != 0:
        sys.exit(f"dry-run failed:\n{dry[0][1].stdout}\n{dry[0][1].stderr}")
    dry_cpu = statistics.median(cpu_of([*LONGSPEC, "run", str(proj), a.stage, "--dry-run", *overrides])
                                for _ in range(3))
    print(f"load average now: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPU(s)")
    print(f"longspec --help: {t_help:.2f} s (median of {a.repeats})")
    print(f"longspec run {a.stage} --dry-run: {statistics.median(t for t, _ in dry):.2f} s "
          f"(median of {len(dry)}; min {min(t for t, _ in dry):.2f} s); CPU user+sys {dry_cpu:.2f} s")
    if a.skip_full:
        return
    line = next(x for x in dry[0][1].stdout.splitlines() if "deepspeed" in x and not x.startswith("#"))
    out_dir = next(w.split("=", 1)[1] for w in line.split() if w.startswith("output_dir="))
    bare, wrapped, over = [], [], []
    for i in range(a.repeats):
        shutil.rmtree(out_dir, ignore_errors=True)
        t, proc = timed(["bash", "-c", line])
        if proc.returncode != 0:
            sys.exit(f"bare deepspeed failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        bare.append(t)
        shutil.rmtree(out_dir, ignore_errors=True)
        t, proc = timed([*LONGSPEC, "run", str(proj), a.stage, "--force", "--quiet", *overrides])
        if proc.returncode != 0:
            sys.exit(f"longspec run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        info = json.loads((Path(out_dir) / "run.json").read_text())
        wrapped.append(t)
        over.append(t - (info["ended_unix"] - info["started_unix"]))
        print(f"  run {i + 1}: bare deepspeed {bare[-1]:.1f} s, longspec run {t:.1f} s, "
              f"longspec's own part {over[-1]:.2f} s")
    print(f"stage {a.stage} with max_steps=2: bare deepspeed median {statistics.median(bare):.1f} s, "
          f"longspec run median {statistics.median(wrapped):.1f} s")
    print(f"launcher overhead (longspec run minus the DeepSpeed process it ran): median "
          f"{statistics.median(over):.2f} s, max {max(over):.2f} s")


if __name__ == "__main__":
    main()
