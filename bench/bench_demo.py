"""Wall time of `longspec demo` (tiny preset, three chained stages) on this machine.

    .venv/bin/python bench/bench_demo.py [--dir DIR] [--gpus N] [--again]

Runs the demo into a fresh folder and prints the total wall, the part spent in each stage's
DeepSpeed process (run.json started_unix/ended_unix) and the rest (init, tiny assets, chaining
with its load check, validation). --again runs it a second time: every stage is skipped.
The first DeepSpeed run on a machine may also build DeepSpeed's ops; run once to warm up.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--again", action="store_true")
    a = ap.parse_args()
    d = a.dir or Path(tempfile.mkdtemp(prefix="ls-demo-")) / "demo"
    if d.exists():
        shutil.rmtree(d)
    cmd = [sys.executable, "-m", "longspec_cli", "demo", str(d), "--quiet"]
    if a.gpus:
        cmd += ["--gpus", str(a.gpus)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        sys.exit(f"demo failed with exit code {proc.returncode}")
    stage_s = {}
    for st in ("base", "long", "longcot"):
        info = json.loads((d / "runs" / st / "run.json").read_text())
        stage_s[st] = info["ended_unix"] - info["started_unix"]
    print(f"longspec demo wall: {wall:.1f} s ({wall / 60:.2f} min)")
    print("  DeepSpeed processes: " + ", ".join(f"{k} {v:.1f} s" for k, v in stage_s.items())
          + f" (sum {sum(stage_s.values()):.1f} s)")
    print(f"  everything else (init + tiny assets + chaining + checks): {wall - sum(stage_s.values()):.1f} s")
    if a.again:
        t0 = time.perf_counter()
        again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        print(f"second run (all stages skipped): {time.perf_counter() - t0:.1f} s, exit {again.returncode}")


if __name__ == "__main__":
    main()
