"""What `longspec prepare` costs at scale, against the tokenizer itself, and what it saves a launch.

    .venv/bin/python bench/bench_prepare.py [--sizes 100,300] [--formats jsonl,parquet] [--no-launch] [--keep]

On generated JSONL of the tiny preset's kind of text (written under a temp folder), and the same
records as the hub serves parquet (data/train-0000i-of-0000n.parquet shards of about 100 MiB of
text, row groups of 1,000 rows, read through a glob), prints:
  1. throughput: prepare's tokens/s (`python -m longspec.prepare`, cold cache) against the same
     tokenizer's encode_batch on the same texts in this run (goal >= 0.7x), and parquet's tokens/s
     against JSONL's on the same records (goal >= 1.0x);
  2. peak RSS of prepare's whole process tree per size and format (goal <= 800 MiB, flat across sizes);
  3. a cache hit: `longspec prepare DIR base` once the cache exists (goal <= 3 s);
  4. launch to first step of `longspec run DIR base max_steps=2` with 100 MB against 1 MB of data,
     cache prepared (goal <= 1.5x), and cold (tokenizing included) for reference.
The machine's load average is printed with the figures: compare ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LONGSPEC = [PY, "-m", "longspec_cli"]
MIB = 1 << 20


def env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "LONGSPEC_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ""}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def generate(path: Path, mb: int, seed: int = 0) -> Path:
    """JSONL of tiny-preset-like paragraphs (records of ~1-3 KB) up to `mb` MiB."""
    from longspec.data.synthetic import Lang

    rng = random.Random(seed)
    gen = Lang(rng)
    pool = [json.dumps({"text": gen.paragraph(rng.randint(6, 30))}) + "\n" for _ in range(4000)]
    target, written = mb * MIB, 0
    with path.open("w") as f:
        while written < target:
            line = pool[rng.randrange(len(pool))]
            f.write(line)
            written += len(line)
    return path


def to_parquet(data: Path, folder: Path, shard_mb: int = 100, row_group: int = 1000) -> str:
    """The JSONL's records as hub parquet shards (snappy, `row_group` rows per group); their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    shards = max(1, round(data.stat().st_size / (shard_mb * MIB)))
    per = -(-sum(1 for _ in data.open()) // shards)
    with data.open() as f:
        for i in range(shards):
            with pq.ParquetWriter(folder / f"train-{i:05d}-of-{shards:05d}.parquet",
                                  pa.schema([("text", pa.string())])) as w:
                left = per
                while left > 0:
                    rows = [json.loads(line) for _, line in zip(range(min(row_group, left)), f)]
                    if not rows:
                        break
                    w.write_table(pa.Table.from_pylist(rows), row_group_size=row_group)
                    left -= len(rows)
    return str(folder / "train-*.parquet")


def project(base: Path, name: str, data: Path) -> Path:
    proj = base / name
    res = subprocess.run([*LONGSPEC, "init", str(proj), "--preset", "tiny", "--no-input"], capture_output=True,
                         text=True, cwd=ROOT, env=env(base / "cache"))
    if res.returncode != 0:
        sys.exit(f"init failed:\n{res.stdout}\n{res.stderr}")
    stage = proj / "conf" / "exp" / "base.yaml"       # long enough that records are rarely cut:
    stage.write_text(stage.read_text().replace("max_seq_length: 128", "max_seq_length: 1024"))  # same texts
    dest = proj / "assets" / "data" / "base.jsonl"
    dest.unlink()
    os.link(data, dest) if data.stat().st_dev == dest.parent.stat().st_dev else shutil.copy(data, dest)
    return proj


def tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_tree(cmd: list[str], cache: Path, **kw) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds and peak RSS of the whole process tree (sampled every 50 ms)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env(cache), **kw)
    peak = [0]
    out: dict = {}

    def drain():
        out["stdout"], out["stderr"] = proc.communicate()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    while proc.poll() is None:
        peak[0] = max(peak[0], tree_rss(proc.pid))
        time.sleep(0.05)
    t.join()
    wall = time.perf_counter() - t0
    return wall, peak[0], subprocess.CompletedProcess(cmd, proc.returncode, out.get("stdout", ""),
                                                      out.get("stderr", ""))


def encode_batch_rate(target: Path, data: Path, chunk: int = 512) -> tuple[float, int]:
    """tokens/s of the fast tokenizer's own encode_batch on the file's texts (encode time only)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    fast = tok.backend_tokenizer
    tokens, spent = 0, 0.0
    with data.open() as f:
        texts: list[str] = []
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == chunk:
                t0 = time.perf_counter()
                tokens += sum(len(e.ids) for e in fast.encode_batch(texts))
                spent += time.perf_counter() - t0
                texts = []
        if texts:
            t0 = time.perf_counter()
            tokens += sum(len(e.ids) for e in fast.encode_batch(texts))
            spent += time.perf_counter() - t0
    return tokens / spent, tokens


def first_step_wall(proj: Path, cache: Path, timeout: float = 1800) -> float:
    """Seconds from `longspec run DIR base max_steps=2` to its first step record in metrics.jsonl."""
    metrics = proj / "runs" / "base" / "metrics.jsonl"
    if (proj / "runs" / "base").exists():
        shutil.rmtree(proj / "runs" / "base")
    t0 = time.perf_counter()
    proc = subprocess.Popen([*LONGSPEC, "run", str(proj), "base", "max_steps=2", "save_steps=2", "--quiet"],
                            cwd=ROOT, env=env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        if first is None and metrics.is_file() and '"loss"' in metrics.read_text():
            first = time.perf_counter() - t0
        time.sleep(0.1)
    err = proc.communicate()[1]
    if proc.returncode != 0 or first is None:
        sys.exit(f"run failed ({proc.returncode}):\n{err[-3000:]}")
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,300", help="MiB of JSONL to prepare, comma-separated")
    ap.add_argument("--formats", default="jsonl,parquet", help="jsonl and/or parquet (the same records)")
    ap.add_argument("--no-launch", action="store_true", help="skip the launch-to-first-step part")
    ap.add_argument("--launch-sizes", default="1,100", help="small,big MiB for launch to first step")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="ls-bench-prepare-"))
    print(f"load average at start: {load()}; temp folder {base}")
    try:
        rows, formats = [], args.formats.split(",")
        for mb in sizes:
            data = generate(base / f"data-{mb}.jsonl", mb)
            proj = project(base, f"p{mb}", data)
            stage = proj / "conf" / "exp" / "base.yaml"
            jsonl_text = stage.read_text()
            for fmt in formats:
                cache = base / f"cache-{mb}-{fmt}"
                if fmt == "parquet":
                    glob = to_parquet(data, base / f"parquet-{mb}" / "data")
                    stage.write_text(jsonl_text.replace(str(proj / "assets" / "data" / "base.jsonl"), glob))
                else:
                    stage.write_text(jsonl_text)
                wall, peak, res = run_tree([*LONGSPEC, "prepare", str(proj), "base", "--json"], cache)
                if res.returncode != 0:
                    sys.exit(f"prepare failed:\n{res.stderr[-3000:]}")
                r = json.loads(res.stdout)["stages"][0]
                rate = r["tokens"] / r["build_seconds"]
                if not rows:                      # the reference on the first size's texts (same kind of text after)
                    ref, ref_tokens = encode_batch_rate(proj / "assets" / "target", data)
                hit, _, hres = run_tree([*LONGSPEC, "prepare", str(proj), "base", "--json"], cache)
                hit_r = json.loads(hres.stdout)["stages"][0]
                rows.append((mb, fmt, r, wall, peak, rate, hit, hit_r))
                print(f"{mb:>5} MiB {fmt:<7}: {r['records']:,} records, {r['tokens']:,} tokens (encode_batch, {sizes[0]} MiB: "
                      f"{ref_tokens:,}); prepare {r['build_seconds']:.1f} s tokenizing ({wall:.1f} s wall) = "
                      f"{rate / 1e6:.2f} M tok/s, encode_batch {ref / 1e6:.2f} M tok/s -> {rate / ref:.2f}x (goal >= 0.7x); "
                      f"peak RSS of the tree {peak / MIB:.0f} MiB (goal <= 800); cache hit {hit:.2f} s "
                      f"(built={hit_r['built']}; goal <= 3 s); load {load()}", flush=True)
            stage.write_text(jsonl_text)
        by = {(mb, fmt): (rate, peak) for mb, fmt, _, _, peak, rate, _, _ in rows}
        for mb in sizes:
            if (mb, "jsonl") in by and (mb, "parquet") in by:
                print(f"{mb:>5} MiB: parquet tokens/s / JSONL tokens/s = {by[mb, 'parquet'][0] / by[mb, 'jsonl'][0]:.2f}x "
                      "(goal >= 1.0x)")
        for fmt in formats:
            if len(sizes) > 1:
                lo, hi = by[sizes[0], fmt][1], by[sizes[-1], fmt][1]
                print(f"{fmt}: peak RSS {sizes[-1]} MiB / {sizes[0]} MiB of data: {hi / MIB:.0f} / {lo / MIB:.0f} MiB = "
                      f"{hi / lo:.2f}x (flat = 1.0x)")
        if args.no_launch:
            return
        lo, hi = (int(x) for x in args.launch_sizes.split(","))
        projs = {}
        for mb in (lo, hi):
            projs[mb] = base / f"p{mb}" if (base / f"p{mb}").exists() else project(
                base, f"p{mb}", generate(base / f"data-{mb}.jsonl", mb))
        walls = {}
        for mb in (lo, hi):
            cache = base / f"cache-{mb}"
            built_before = (cache / "prepared").exists()
            if mb == lo:                                      # cold: `run` prepares first
                shutil.rmtree(cache / "prepared", ignore_errors=True)
                walls[mb, "cold"] = first_step_wall(projs[mb], cache)
            elif not built_before:
                walls[mb, "cold"] = first_step_wall(projs[mb], cache)
            walls[mb, "warm"] = min(first_step_wall(projs[mb], cache) for _ in range(2))
        print(f"launch to first step, 2-step run, cache prepared (best of 2): {lo} MiB {walls[lo, 'warm']:.1f} s, "
              f"{hi} MiB {walls[hi, 'warm']:.1f} s -> {walls[hi, 'warm'] / walls[lo, 'warm']:.2f}x "
              f"(goal <= 1.5x); load {load()}")
        print(f"launch to first step, cold (run prepares first): {lo} MiB {walls[lo, 'cold']:.1f} s"
              + (f", {hi} MiB {walls[hi, 'cold']:.1f} s" if (hi, "cold") in walls else
                 f" ({hi} MiB: its prepare wall above + the warm launch)"))
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
