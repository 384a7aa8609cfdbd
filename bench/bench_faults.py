"""Preemption on the tiny stage: time from SIGTERM to exit, and checkpoint size vs the disk preflight.

    python bench/bench_faults.py [--precision fp32 bf16] [--at-step 3]

Per precision: scaffolds the tiny preset in a temporary folder, starts `longspec run DIR base`
(CPU, one rank, no periodic save), and at step N sends SIGTERM to every process of the run, as a
scheduler does. Prints
    SIGTERM -> preempted event   the step in progress finished + the checkpoint saved (s)
    SIGTERM -> every process gone (s), and `run`'s exit code (5 = preempted)
    checkpoint bytes on disk vs longspec_cli.launch.disk.checkpoint_bytes (ratio; goal 0.8..1.2)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longspec.runs import runfolder  # noqa: E402
from longspec.project.manifest import load_manifest  # noqa: E402
from longspec_cli.launch import argv as A  # noqa: E402
from longspec_cli.launch import disk as D  # noqa: E402
from longspec_cli.launch import preflight  # noqa: E402
from longspec.machine.liveness import group_members  # noqa: E402

CLI = [sys.executable, "-m", "longspec_cli"]


def wait_for(pred, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise TimeoutError


def one(precision: str, at_step: int, tmp: Path) -> dict:
    proj = tmp / f"tiny-{precision}"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    subprocess.run([*CLI, "init", str(proj), "--preset", "tiny", "--no-input"], env=env, check=True,
                   capture_output=True)
    overrides = ["max_steps=200", "save_steps=1000", f"precision={precision}"]
    out = proj / "runs" / "base"
    run = subprocess.Popen([*CLI, "run", str(proj), "base", *overrides, "--quiet"], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rd = runfolder.RunDir(out)
    wait_for(lambda: (rd.last_step_record() or {}).get("step", 0) >= at_step, 900)
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    t0 = time.monotonic()
    os.killpg(pgid, signal.SIGTERM)
    wait_for(lambda: any(e["event"] == "preempted" for e in rd.events()), 300)
    t_event = time.monotonic() - t0
    wait_for(lambda: not group_members(pgid), 300)
    t_gone = time.monotonic() - t0
    code = run.wait(timeout=120)
    ckpt = rd.checkpoints()[-1]
    on_disk = sum(p.stat().st_size for p in ckpt.path.rglob("*") if p.is_file())
    manifest = load_manifest(proj)
    res = A.Resources(cpu=True, ranks_per_node=1, nodes=1)
    shape = preflight.stage_shape(manifest, manifest.stage("base"), overrides, res)
    estimate = D.checkpoint_bytes(shape)
    return {"precision": precision, "step": ckpt.step, "sigterm_to_event_s": round(t_event, 2),
            "sigterm_to_exit_s": round(t_gone, 2), "exit_code": code, "checkpoint_bytes": on_disk,
            "estimate_bytes": estimate, "ratio": round(on_disk / estimate, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--at-step", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for p in args.precision:
            r = one(p, args.at_step, Path(d))
            print(f"{r['precision']}: SIGTERM at step >= {args.at_step} -> checkpoint-{r['step']}; "
                  f"preempted event after {r['sigterm_to_event_s']} s, every process gone after "
                  f"{r['sigterm_to_exit_s']} s, `run` exit {r['exit_code']}; checkpoint {r['checkpoint_bytes']:,} "
                  f"bytes vs estimate {r['estimate_bytes']:,} (ratio {r['ratio']})", flush=True)


if __name__ == "__main__":
    main()
