"""What building a stage's tau prompts costs as its data grows: the last records only, against
reading the whole train_file (what every rank did at every start and resume before).

    .venv/bin/python bench/bench_prompts.py [--sizes 50,200,800] [--keep]

On generated JSONL of the tiny preset's kind of text (bench_prepare.generate) and the same records
as parquet shards, with the tiny target's tokenizer and a base stage's config, prints per size the
seconds of longspec.measure.prompts.default_prompts: (a) with the run's heldout.json (the record count the
prepared data gives: the JSONL read backwards from its end, its earlier lines only counted for
their line numbers; parquet through its footers and last row groups), (b) without it (JSONL read
and parsed whole), and the prompts must be the same in both. Goal: (a) flat across sizes, its
ratio to (b) falling with the size. The machine's load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_prepare import MIB, generate, load, to_parquet  # noqa: E402


def conf_for(out: Path, data: str, records: int | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.json").unlink(missing_ok=True)
    if records is not None:        # what simtau.commit writes: the last records of the prepared data
        (out / "heldout.json").write_text(json.dumps({"start": records - 4, "records": 4}))
    return {"train_file": data, "output_dir": str(out), "data": {"collator": "short_text", "max_seq_length": 1024},
            "per_gpu_train_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch_size": 4, "seed": 42}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,200,800", help="MiB of JSONL")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    from longspec.measure import prompts as P
    from longspec.data.encoding import load_tokenizer
    from longspec.tiny import cached_target

    target, _ = cached_target("qwen2")
    tok = load_tokenizer(target)
    tmp = Path(tempfile.mkdtemp(prefix="ls-prompts-"))
    print(f"load {load()}")
    print(f"{'MiB':>5} {'records':>9} {'jsonl tail s':>12} {'jsonl whole s':>13} {'ratio':>6} {'parquet tail s':>14}")
    try:
        for mb in (int(s) for s in a.sizes.split(",")):
            data = generate(tmp / f"d{mb}.jsonl", mb)
            n = sum(1 for line in data.open() if line.strip())
            shards = to_parquet(data, tmp / f"pq{mb}")
            run = tmp / f"run{mb}"

            def build(path, records):
                return P.default_prompts(Path(path), tok, conf_for(run, str(path), records), 100)

            tail_s, (tail_p, tail_info, _) = timed(lambda: build(data, n))
            whole_s, (whole_p, whole_info, _) = timed(lambda: build(data, None))
            pq_s, (pq_p, _, _) = timed(lambda: build(shards, n))
            same = [(p.ids, p.record) for p in tail_p] == [(p.ids, p.record) for p in whole_p]
            assert same and tail_info["records"] == whole_info["records"] == n, "the tail read gave other prompts"
            assert [p.ids for p in pq_p] == [p.ids for p in tail_p], "parquet gave other prompts"
            print(f"{mb:5d} {n:9,d} {tail_s:12.3f} {whole_s:13.3f} {tail_s / whole_s:6.3f} {pq_s:14.3f}", flush=True)
            data.unlink()
            shutil.rmtree(tmp / f"pq{mb}")
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
