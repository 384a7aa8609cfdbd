"""Tau while training's share of a stage with a larger target than the demo's, on this machine.

    .venv/bin/python bench/bench_simtau_share.py [--dir DIR] [--stage base] [KEY=VALUE ...]

Builds a 135M-parameter Llama-shaped target (SmolLM2-135M's shape: 30 layers, hidden 576, 9 query /
3 KV heads, tied embeddings, a 49,152-row vocabulary; random weights, the tiny preset's tokenizer:
the cost of a step and of an evaluation depends on the shape, not on what the weights know), the
tiny preset's stage data, scaffolds a project with `longspec init --target` (sized to this machine,
as a user gets it), runs one stage with `longspec run` (KEY=VALUE overrides pass through, e.g.
max_steps=40) and prints what tau while training cost: the evaluations' and the continuations'
seconds (metrics.jsonl) over the stage's wall time and the trainer's loop, and where the
continuations came from (made, read back from the run folder, read from the host's cache). A second
run of the same stage (--again) shows them reused.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


def cli(*args: str, quiet: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "longspec_cli", *args], cwd=ROOT, env=env,
                          capture_output=quiet, text=True)
    if proc.returncode != 0:
        sys.exit(f"longspec {' '.join(args)} failed ({proc.returncode})"
                 + (f":\n{(proc.stdout + proc.stderr)[-3000:]}" if quiet else ""))
    return proc


def build(d: Path) -> tuple[Path, Path]:
    """(the target folder, the tiny data folder)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = d / "tiny"
    if not (tiny / "data").is_dir():
        subprocess.run([sys.executable, "-m", "longspec.tiny", "build", str(tiny), "--family", "llama", "--quiet"],
                       cwd=ROOT, check=True)
    target = d / "target-135m"
    if not (target / "config.json").is_file():
        tmp = d / "target-135m.part"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(tiny / "target", tmp, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        cfg = AutoConfig.from_pretrained(tiny / "target")
        for k, v in SHAPE.items():
            setattr(cfg, k, v)
        cfg.head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(tmp)
        tmp.rename(target)
        print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters in {target}")
    return target, tiny / "data"


def cost(run: Path) -> dict:
    from bench_simtau import stage_cost

    c = stage_cost(run)
    first = next((r for r in c.pop("log").simtau if "continuations_s" in r), {})
    return {**{k: round(v, 4 if k.startswith("share") else 1) if isinstance(v, float) else v for k, v in c.items()},
            "continuations": {k: first.get(f"continuations_{k}") for k in ("made", "reused", "cached")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/longspec-bench-135m"))
    ap.add_argument("--stage", default="base")
    ap.add_argument("--again", action="store_true", help="run the stage a second time (continuations reused)")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for `longspec run`")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    target, data = build(a.dir)
    proj = a.dir / "proj"
    if not (proj / "longspec.yaml").is_file():
        out = cli("init", str(proj), "--target", str(target), "--no-input", "--json",
                  *(x for s in ("base", "long", "longcot") for x in ("--data", f"{s}={data / (s + '.jsonl')}")),
                  quiet=True)
        print("\n".join(json.loads(out.stdout)["notes"]))
    for attempt in range(2 if a.again else 1):
        t0 = time.time()
        cli("run", str(proj), a.stage, "-q", *a.overrides, *(["--force"] if attempt else []))
        print(json.dumps({"stage": a.stage, "run": attempt + 1, "seconds": round(time.time() - t0, 1),
                          **cost(proj / "runs" / a.stage)}))


if __name__ == "__main__":
    main()
