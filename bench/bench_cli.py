"""Start-up cost of the quick verbs, as ratios to the floor: median wall time of `longspec --help`,
`validate`, `config`, `status` and `next-stage --dry-run` on a three-stage project, each run as a
fresh subprocess, divided by the median of `python -c "import typer, ruamel.yaml"` (the floor: what
any Typer + ruamel CLI pays) measured in the same run, one floor sample beside each verb sample, so
a busy machine moves both alike.

    .venv/bin/python bench/bench_cli.py [--runs 10]

warm: the composition cache filled (an earlier command composed the stages); cold: an empty cache
folder (LONGSPEC_CACHE_DIR) for every run, so every stage is composed with Hydra.
A reference line times Hydra alone composing the three stages (nothing else), the least a
Hydra-exact cold `validate` can cost. Wall-time ratios are the goals; CPU-time ratios (user + sys of the child over the floor's) are
printed beside them, steadier when the machine is shared. Goals: `--help` <= 2x (and no Hydra imported); status, validate, config, next-stage --dry-run
<= 3x warm; validate <= 5x cold. The project is written by hand (docs/DESIGN.md layout) in a temp
folder with a finished `base` stage, so next-stage has a draft to verify and a line to change. With
torch installed the draft is a real torch.save file and next-stage's deep check (a weights_only
load in a subprocess) runs when nothing is cached; `--no-deep` leaves it out. The children may write
bytecode (PYTHONDONTWRITEBYTECODE is dropped), as an installed package has it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
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
sys.path.insert(0, str(ROOT))

from longspec.runs.runfolder import config_fingerprint  # noqa: E402  (pure, cheap)

STAGE = """\
# @package _global_
# python -m longspec.train --config-dir {root}/conf +exp={name}
defaults:
  - /deepspeed@ds_cfg: zero1_offload_cosine
  - _self_

stage: {name}
model_name_or_path: {root}/assets/target   # the frozen target
draft_model_name_or_path: null
train_file: {root}/data/{name}.jsonl
output_dir: {root}/runs/{name}
precision: bf16
data:
  collator: short_text
  max_seq_length: 1024
learning_rate: 5.0e-4
"""

MANIFEST = """\
name: bench
preset: null
variant: sinkpi-slicing
target: assets/target
launch: {gpus: 1, nodes: 1, hostfile: null}
stages:
  - {name: base,    config: conf/exp/base.yaml,    output_dir: runs/base,    draft_from: null}
  - {name: long,    config: conf/exp/long.yaml,    output_dir: runs/long,    draft_from: base}
  - {name: longcot, config: conf/exp/longcot.yaml, output_dir: runs/longcot, draft_from: long}
"""


def build_project(root: Path) -> None:
    (root / "conf" / "exp").mkdir(parents=True)
    (root / "conf" / "deepspeed").mkdir()
    (root / "conf" / "deepspeed" / "zero1_offload_cosine.yaml").write_text("zero_optimization:\n  stage: 1\n")
    (root / "assets" / "target").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "longspec.yaml").write_text(MANIFEST)
    for name in ("base", "long", "longcot"):
        (root / "conf" / "exp" / f"{name}.yaml").write_text(STAGE.format(root=root, name=name))
        (root / "data" / f"{name}.jsonl").write_text('{"text": "hello"}\n')
    out = root / "runs" / "base"
    out.mkdir(parents=True)
    weights = out / "draft_model_weights.pth"
    if importlib.util.find_spec("torch") is not None:
        subprocess.run([sys.executable, "-c", "import torch, sys; torch.save({'w': torch.zeros(4, 4)}, sys.argv[1])",
                        str(weights)], check=True)
    else:
        weights.write_bytes(b"fake draft")
    with open(out / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"event": "start", "step": 0, "time": 0, "total_steps": 2000}) + "\n")
        for s in range(1, 2001):  # a realistic log: one record per step
            f.write(json.dumps({"step": s, "total_steps": 2000, "loss": 3.0, "llm_loss": 2.0, "lr": 1e-4,
                                "tokens_per_s": 1e4, "elapsed_s": s, "time": s}) + "\n")
        f.write(json.dumps({"event": "end", "step": 2000, "time": 2000}) + "\n")
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    (out / "stage_complete.json").write_text(json.dumps({
        "stage": "base", "steps": 2000, "final_loss": 3.0, "sha256": sha, "target": str(root / "assets/target"),
        "config_sha256": config_fingerprint(root / "conf/exp/base.yaml", []), "draft_sha256": None,
        "finished_at": "2024-01-01T00:00:00Z", "weights": "draft_model_weights.pth"}))


def longspec_cmd() -> list[str]:
    script = Path(sys.executable).with_name("longspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "longspec_cli"]


def time_once(cmd: list[str], env: dict) -> tuple[float, int, float]:
    """(wall s, exit code, CPU s = user + sys of the child; CPU time barely moves when the machine is busy)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, proc.returncode, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


FLOOR = [sys.executable, "-c", "import typer, ruamel.yaml"]

# What any Hydra-exact check of the project pays: the floor, then the three stages composed by
# Hydra's own compose_config (longspec's one-call wrapper), one Hydra set-up, nothing else.
HYDRA_ALONE = """
import sys
import typer, ruamel.yaml
from pathlib import Path
from longspec.project.hydracompose import hydra_compose, trainer_conf_dir
for name in ("base", "long", "longcot"):
    hydra_compose(trainer_conf_dir(), "config", [Path(sys.argv[1]) / "conf"], [f"+exp={name}"])
"""


def measure(cmd: list[str], env: dict, runs: int, cache: Path | None, floors: list[tuple[float, float]]) -> dict:
    """Median wall/CPU of `cmd` over `runs`; `cache` set: an empty cache folder for every run (cold).
    One floor sample is taken beside each run and appended to `floors`."""
    times, cpus, codes = [], [], set()
    time_once(cmd, env)  # the OS file cache and bytecode, not longspec's cache (cold empties it below)
    for i in range(runs):
        run_env = env
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
            run_env = {**env, "LONGSPEC_CACHE_DIR": str(cache)}
        t, code, cpu = time_once(cmd, run_env)
        times.append(t)
        cpus.append(cpu)
        codes.add(code)
        wall, _, cpu = time_once(FLOOR, env)
        floors.append((wall, cpu))
    return {"median": statistics.median(times), "min": min(times), "cpu": statistics.median(cpus), "codes": codes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="longspec-bench-"))
    try:
        proj = tmp / "proj"
        build_project(proj)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["LONGSPEC_CACHE_DIR"] = str(tmp / "cache")
        base = longspec_cmd()
        #        label, argv, goal warm, goal cold (x floor; None: printed only)
        cases = [("--help", ["--help"], 2.0, 2.0),
                 ("validate DIR", ["validate", str(proj)], 3.0, 5.0),
                 ("config DIR long", ["config", str(proj), "long"], 3.0, None),
                 ("status DIR", ["status", str(proj)], 3.0, None),
                 ("next-stage DIR --dry-run", ["next-stage", str(proj), "--dry-run"], 3.0, None),
                 ("next-stage DIR --dry-run --no-deep", ["next-stage", str(proj), "--dry-run", "--no-deep"],
                  3.0, None)]
        probe = ("import sys, longspec_cli.app as a\ntry:\n    a.app(['--help'])\nexcept SystemExit:\n    pass\n"
                 "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'torch'}))")
        loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                                cwd=ROOT).stdout.strip().splitlines()[-1]
        print(f"modules of hydra/omegaconf/torch loaded by `longspec --help`: {loaded}")
        probe = ("import sys, longspec_cli.app as a\ntry:\n    a.app(['status', sys.argv[1]])\nexcept SystemExit:\n"
                 "    pass\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'torch'}))")
        subprocess.run(base + ["status", str(proj)], capture_output=True, env=env)  # fills the cache
        loaded = subprocess.run([sys.executable, "-c", probe, str(proj)], capture_output=True, text=True, env=env,
                                cwd=ROOT).stdout.strip().splitlines()[-1]
        print(f"modules of hydra/omegaconf/torch loaded by `longspec status` (cache warm): {loaded}")
        floors: list[tuple[float, float]] = []
        rows = []
        for label, argv, goal_warm, goal_cold in cases:
            warm = measure(base + argv, env, args.runs, None, floors)
            cold = measure(base + argv, env, args.runs, tmp / "cold-cache", floors)
            rows.append((label, warm, cold, goal_warm, goal_cold))
        hydra_alone = measure([sys.executable, "-c", HYDRA_ALONE, str(proj)], env, args.runs, None, floors)
        floor = statistics.median(w for w, _ in floors)
        floor_cpu = statistics.median(c for _, c in floors)
        print(f"floor `python -c \"import typer, ruamel.yaml\"`: median {floor:.3f} s wall, {floor_cpu:.3f} s cpu "
              f"over {len(floors)} runs (wall min {min(w for w, _ in floors):.3f}, max {max(w for w, _ in floors):.3f})")
        print(f"{'longspec ...':36s} {'warm s':>7s} {'x floor':>7s} {'goal':>6s}   {'cold s':>7s} {'x floor':>7s} "
              f"{'goal':>6s}   cpu x floor warm/cold  exit")
        over = 0
        for label, warm, cold, goal_warm, goal_cold in rows:
            rw, rc = warm["median"] / floor, cold["median"] / floor
            mark = lambda r, g: "" if g is None else (f"<={g:g}" + ("" if r <= g else "!"))  # noqa: E731
            over += (rw > goal_warm) + (goal_cold is not None and rc > goal_cold)
            print(f"{label:36s} {warm['median']:7.3f} {rw:7.2f} {mark(rw, goal_warm):>6s}   {cold['median']:7.3f} "
                  f"{rc:7.2f} {mark(rc, goal_cold):>6s}   {warm['cpu'] / floor_cpu:5.2f} / {cold['cpu'] / floor_cpu:5.2f}"
                  f"          {','.join(map(str, sorted(warm['codes'] | cold['codes'])))}")
        h = hydra_alone["median"]
        validate_cold = rows[1][2]["median"]
        print(f"(reference) Hydra alone, the three stages composed and nothing else: {h:.3f} s = {h / floor:.2f}x "
              f"floor; `validate DIR` cold is {validate_cold / h:.2f}x that")
        print(f"goals missed: {over} (`!` marks them); cpu count {os.cpu_count()}, "
              f"load average {os.getloadavg()[0]:.2f}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
