"""Regeneration's throughput on the tiny target: the embedded engine (batched greedy `generate`)
against a local `transformers serve` (one server, --concurrency requests at a time), on the same
records; the rows must be the same. First, in this process, the embedded engine against bare
transformers `generate` on the same requests in the same batches (what the engine adds: grouping,
padding, stop handling, decoding), the answers' new tokens equal.

    .venv/bin/python bench/bench_regen.py [--records 16] [--batch 8] [--concurrency 4] [--keep]

Builds the tiny preset's target (cached), takes the first N long_cot records, runs
`python -m longspec.regenerate` once per engine and prints one JSON line per engine (rows/s,
tokens/s, counts) and whether the rows are equal. The machine's load average is printed too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def regen(work: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "longspec.regenerate", "--config-dir", str(work / "conf"),
                           "+exp=cot", "--out", str(out), "--json", *extra], cwd=work, env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for p in sorted(out.glob("part-*.parquet")) for r in pq.read_table(str(p)).to_pylist()]


def serve(target: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    proc = subprocess.Popen([exe, "serve", str(target), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("transformers serve did not start")


def engine_vs_generate(target: str, train_file: Path, batch: int, repeats: int = 3) -> dict:
    """Tokens/s of EmbeddedEngine.answer and of bare `generate` on the same first-turn requests
    (medians of `repeats` alternated runs after a warm-up)."""
    import torch

    from longspec.data import regen as R
    from longspec.data.encoding import load_tokenizer
    from longspec.decode.engines import EmbeddedEngine

    tok = load_tokenizer(target)
    prompter = R.Prompter(tok, 512, 128, None)
    reqs = [q for q in (prompter.next_request(r) for r in R.source_rows(train_file, "long_cot")) if q]
    engine = EmbeddedEngine(target, tok, batch=batch, device="cpu")
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i].ids))      # the engine's batches

    def bare() -> dict[int, int]:
        new_tokens = {}
        for s in range(0, len(order), batch):
            chunk = [reqs[i] for i in order[s:s + batch]]
            T = max(len(r.ids) for r in chunk)
            ids = torch.tensor([[engine.pad] * (T - len(r.ids)) + r.ids for r in chunk])
            mask = (torch.arange(T)[None] >= torch.tensor([T - len(r.ids) for r in chunk])[:, None]).long()
            with torch.no_grad():
                gen = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                            pad_token_id=engine.pad, eos_token_id=list(chunk[0].stop_ids),
                                            max_new_tokens=max(r.max_new for r in chunk))
            for i, row in zip(order[s:s + batch], gen[:, T:].tolist()):
                stop = next((k for k, t in enumerate(row) if t in reqs[i].stop_ids), None)
                new_tokens[i] = len(row[:reqs[i].max_new]) if stop is None else stop + 1
        return new_tokens

    engine.answer(reqs[:batch])                              # warm-up: the first forwards allocate
    t_engine, t_bare = [], []
    for _ in range(repeats):                                 # alternated, so load drifts hit both
        t0 = time.perf_counter()
        answers = engine.answer(reqs)
        t_engine.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        new_tokens = bare()
        t_bare.append(time.perf_counter() - t0)
    t_engine, t_bare = statistics.median(t_engine), statistics.median(t_bare)
    tokens = sum(a.tokens for a in answers)
    return {"requests": len(reqs), "batch": batch, "new_tokens": tokens,
            "same_new_tokens": [a.tokens for a in answers] == [new_tokens[i] for i in range(len(reqs))],
            "engine_tokens_per_s": round(tokens / t_engine, 1), "generate_tokens_per_s": round(tokens / t_bare, 1),
            "engine_over_generate": round(t_engine / t_bare, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    from longspec.tiny import build_tiny

    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    try:
        tiny = build_tiny(work / "tiny", family="qwen2")
        lines = Path(tiny["data"]["longcot"]).read_text().splitlines()[:args.records]
        (work / "cot.jsonl").write_text("\n".join(lines) + "\n")
        (work / "conf" / "exp").mkdir(parents=True)
        (work / "conf" / "exp" / "cot.yaml").write_text(
            f"# @package _global_\nstage: longcot\nmodel_name_or_path: {tiny['target']}\n"
            f"train_file: {work / 'cot.jsonl'}\noutput_dir: {work / 'run'}\nprecision: fp32\n"
            "data: {collator: long_cot, max_seq_length: 512}\n")
        print(json.dumps({"embedded engine vs bare generate": engine_vs_generate(
            tiny["target"], work / "cot.jsonl", args.batch)}), flush=True)
        keys = ("kept", "truncated", "failed", "skipped", "completion_tokens", "seconds", "rows_per_s", "tokens_per_s")
        emb = regen(work, work / "emb", "--batch", str(args.batch))
        print(json.dumps({"engine": "embedded", "batch": args.batch, **{k: emb[k] for k in keys}}), flush=True)
        proc, url = serve(Path(tiny["target"]))
        try:
            srv = regen(work, work / "srv", "--server", url, "--concurrency", str(args.concurrency))
        finally:
            proc.terminate()
            proc.wait(10)
        print(json.dumps({"engine": "transformers serve", "concurrency": args.concurrency,
                          **{k: srv[k] for k in keys}}), flush=True)
        print(json.dumps({"same_rows": rows(work / "emb") == rows(work / "srv"), "records": args.records,
                          "load_average": os.getloadavg()}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
