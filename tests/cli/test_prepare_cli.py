"""`longspec prepare` on a real tiny project, then what status and validate say about the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGSPEC = [sys.executable, "-m", "longspec_cli"]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*LONGSPEC, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def prepared(proj: Path, stage: str) -> dict:
    res = cli("status", str(proj), "--json")
    assert res.returncode == 0, res.stderr
    return next(s["prepared"] for s in json.loads(res.stdout)["stages"] if s["name"] == stage)


def test_prepare_then_status_validate_and_a_changed_or_bad_train_file(tmp_path):
    proj = tmp_path / "proj"
    res = cli("init", str(proj), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert prepared(proj, "base")["state"] == "missing"

    res = cli("prepare", str(proj), "base", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)["stages"][0]
    assert r["built"] and r["records"] == 2500 and r["tokens"] >= r["trained_tokens"] > 0
    assert "records 2,500" in res.stderr and "█" in res.stderr and "one epoch =" in res.stderr  # summary, histogram
    st = prepared(proj, "base")
    assert st["state"] == "ready" and st["tokens"] == r["tokens"]
    assert st["epochs"] == r["epochs"] and st["steps_per_epoch"] == r["steps_per_epoch"]
    assert "train_file prepared: 2,500 records" in cli("validate", str(proj)).stdout
    once = cli("monitor", str(proj), "--once", "--json")
    assert json.loads(once.stdout)["stages"][0]["prepared"]["tokens"] == r["tokens"]
    assert "base: data ready" in cli("monitor", str(proj), "--once").stdout

    data = proj / "assets" / "data" / "base.jsonl"
    with data.open("a") as f:
        f.write('{"text": "a record added after preparing"}\n')
    st = prepared(proj, "base")
    assert st["state"] == "stale" and "base.jsonl changed" in st["reason"]
    assert "data stale: base.jsonl changed" in cli("status", str(proj)).stdout

    with data.open("a") as f:                          # nothing to train: skipped and counted, not malformed
        f.write('{"text": ""}\n')
    res = cli("prepare", str(proj), "base", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads(res.stdout)["stages"][0]
    assert (one["records"], one["untrainable"], one["skipped"]) == (2501, 1, 0)
    assert one["untrainable_problems"] == [f"{data}:2502: no trained tokens within max_seq_length=128 (collator short_text)"]
    assert f"untrainable, skipped: {data}:2502" in res.stderr
    assert prepared(proj, "base")["untrainable"] == 1
    assert "base: data ready" in (out := cli("status", str(proj)).stdout) and "1 untrainable records skipped" in out
    stage_file = proj / "conf" / "exp" / "base.yaml"
    text = stage_file.read_text()
    stage_file.write_text(text.replace("max_untrainable_share: 0.05", "max_untrainable_share: 0"))
    st = prepared(proj, "base")                        # the same cache, refused under the lower limit
    assert st["state"] == "refused" and "1 of 2,502 records (0.04%) train no token" in st["reason"]
    said = json.loads(cli("validate", str(proj), "--json").stdout)["problems"]
    assert any(p["severity"] == "warning" and p["message"].startswith("train_file not prepared: refused: 1 of 2,502")
               for p in said), said
    res = cli("prepare", str(proj), "base")
    assert res.returncode == 1 and "more than data.max_untrainable_share=0 (0.00%) allows; first: " \
        f"{data}:2502" in " ".join(res.stderr.split()), res.stderr[-3000:]
    stage_file.write_text(text)

    with data.open("a") as f:
        f.write('{"txet": "misspelt"}\n')
    res = cli("prepare", str(proj), "base")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "base.jsonl:2503: missing field 'text'" in " ".join(res.stderr.split())
    assert prepared(proj, "base")["state"] == "stale"                  # the old cache is not replaced

    # the same records as the hub serves a parquet dataset: shards behind a glob, used as they are
    from tests.hubfiles import write_parquet_shards

    recs = [json.loads(line) for line in data.read_text().splitlines()[:2500]]
    shards = write_parquet_shards([dict(r, meta={"redpajama_set_name": "RedPajamaC4"}) for r in recs],
                                  tmp_path / "SlimPajama" / "data", shards=2)
    stage_file = proj / "conf" / "exp" / "base.yaml"
    text = stage_file.read_text()
    glob = tmp_path / "SlimPajama" / "data" / "train-*.parquet"
    stage_file.write_text(text.replace(str(data), str(glob)))
    res = cli("validate", str(proj))
    assert res.returncode == 0 and " 0 errors" in res.stdout, res.stdout + res.stderr
    res = cli("prepare", str(proj), "base", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    pq = json.loads(res.stdout)["stages"][0]
    assert pq["built"] and pq["records"] == 2500 and pq["tokens"] == r["tokens"]     # the JSONL file's tokens
    assert prepared(proj, "base")["state"] == "ready"
    write_parquet_shards(recs[:4], tmp_path / "more", shards=1)[0].rename(shards[0].parent / "train-00002-of-00002.parquet")
    st = prepared(proj, "base")
    assert st["state"] == "stale" and "added train-00002-of-00002.parquet" in st["reason"]

    # columns no collator of the stage reads, a binary file: validate says so, before any tokenizer
    cot = write_parquet_shards([{"problem": "add 1 and 2 .", "qwq": "3 ."}], tmp_path / "qwq", shards=1)[0]
    blob = tmp_path / "slim.jsonl"
    blob.write_bytes(b"\x00\x01" * 100)
    stage_file.write_text(text.replace(str(data), str(cot)))
    long_file = proj / "conf" / "exp" / "long.yaml"
    long_file.write_text(long_file.read_text().replace(str(data.parent / "long.jsonl"), str(blob)))
    res = cli("validate", str(proj), "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    said = [p["message"] for p in json.loads(res.stdout)["problems"] if p["severity"] == "error"]
    assert said == [f"train_file {cot}: its columns (problem, qwq) fit no short_text record, which needs text | target",
                    f"train_file {blob}: a binary file, not JSON/JSONL text nor a parquet or arrow file"], said
