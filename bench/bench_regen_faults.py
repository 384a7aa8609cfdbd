"""What `python -m longspec.regenerate --server` does against a server that misbehaves, one fault
at a time: exit code, seconds, whether the key's text reached the terminal, a file or another
host, whether a traceback showed, stderr's size, the peak memory, and the rows kept / failed.

    .venv/bin/python bench/bench_regen_faults.py [--tree DIR] [--records 6] [--timeout 90]
        [--faults key400,redirect,...]

--tree: the longspec source tree to run (default: this one), e.g. an older version unpacked with
`git archive REV | tar -x -C DIR`, to compare. The stand-in server is tests/trainer/openai_standin.py
on 127.0.0.1; the fault hits the first record's completion (the others answer well), or
/v1/models for the models-* faults; `lock` starts two runs on one folder; `ratelimit45`
answers 429 for 45 s. A run still going after --timeout seconds is killed ("no end").
Prints one JSON line per fault and a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAULTS = ("key400", "key500", "redirect", "empty", "null", "huge", "long", "surrogate", "badutf8", "stall", "hang",
          "ratelimit45", "models-other", "models-not-json", "models-hang", "lock")
KEY = "sk-bench-" + os.urandom(12).hex()


def flags(tree: Path) -> list[str]:
    """Bounds the tree knows (an older one has no --idle-timeout)."""
    new = "idle-timeout" in (tree / "longspec" / "regenerate.py").read_text()
    return ["--server-wait", "20"] + (["--idle-timeout", "10", "--retries", "2"] if new else [])


def start(tree: Path, work: Path, out: Path, url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               OPENAI_API_KEY=KEY, LONGSPEC_CACHE_DIR=str(work / "cache"))
    argv = [sys.executable, "-m", "longspec.regenerate", "--config-dir", str(work / "conf"), "+exp=cot",
            "--out", str(out), "--json", "--server", url, *flags(tree)]
    return subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, t0: float, timeout: float) -> dict:
    import threading

    import psutil

    peak, box = [0], {}
    reader = threading.Thread(target=lambda: box.update(zip(("out", "err"), proc.communicate())), daemon=True)
    reader.start()
    while reader.is_alive() and time.monotonic() - t0 < timeout:
        try:
            peak[0] = max(peak[0], psutil.Process(proc.pid).memory_info().rss)
        except psutil.Error:
            pass
        reader.join(0.1)
    ended = not reader.is_alive()
    if not ended:
        proc.kill()
        reader.join()
    return {"code": proc.returncode if ended else "no end", "seconds": round(time.monotonic() - t0, 1),
            "stdout": box.get("out", b"").decode("utf-8", "replace"),
            "stderr": box.get("err", b"").decode("utf-8", "replace"), "peak_mb": round(peak[0] / 2**20)}


def one(fault: str, tree: Path, work: Path, srv, sink, asks: list[str], timeout: float) -> dict:
    out = work / f"out-{fault}"
    srv.seen[:], sink.seen[:], srv.limited = [], [], {}
    srv.models = fault.removeprefix("models-") if fault.startswith("models-") else None
    srv.limit_seconds = 45.0
    kind = "ratelimit" if fault == "ratelimit45" else ("hang" if fault == "lock" else fault)
    srv.fault = lambda prompt: kind if asks[0] in prompt else None
    t0 = time.monotonic()
    first = start(tree, work, out, srv.url)
    second = None
    if fault == "lock":                      # a second run on the folder while the first waits on record 0
        while not srv.completions() and first.poll() is None and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
        t1, proc = time.monotonic(), start(tree, work, out, srv.url)
        while proc.poll() is None and time.monotonic() - t1 < timeout and \
                sum(asks[0] in q["prompt"] for q in srv.completions()) < 2:
            time.sleep(0.1)                  # refused, or asking record 0 too (accepted)
        srv.fault = lambda prompt: None
        srv.release.set()
        second = finish(proc, t1, timeout)
    r = finish(first, t0, timeout)
    srv.release.clear()
    said = r["stdout"] + r["stderr"] + (second["stdout"] + second["stderr"] if second else "")
    try:
        res = json.loads(r["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        res = {}
    files = [p for p in out.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()] if out.is_dir() else []
    row = {"fault": fault, "code": r["code"], "seconds": r["seconds"], "kept": res.get("kept"), "failed": res.get("failed"),
           "key_shown": KEY in said, "key_in_files": len(files), "key_elsewhere": any(q["auth"] for q in sink.seen),
           "traceback": "Traceback" in said, "stderr_kb": round(len(r["stderr"].encode()) / 1024, 1),
           "peak_mb": r["peak_mb"]}
    if second:
        row["second_code"] = second["code"]
        row["second_said"] = " ".join(second["stderr"].split())[-300:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--records", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--faults", default=",".join(FAULTS))
    a = ap.parse_args()
    from longspec.data.collators import long_cot_messages
    from longspec.tiny import build_tiny
    from tests.trainer.openai_standin import StandIn

    work = Path(tempfile.mkdtemp(prefix="regen-faults-"))
    tiny = build_tiny(work / "tiny", family="qwen2")
    recs = [json.loads(line) for line in Path(tiny["data"]["longcot"]).read_text().splitlines()]
    asks = [long_cot_messages(r)[0]["content"] for r in recs]
    mine = [i for i in range(len(recs)) if sum(asks[i] in q for q in asks) == 1][:a.records]
    (work / "cot.jsonl").write_text("".join(json.dumps(recs[i]) + "\n" for i in mine))
    (work / "conf" / "exp").mkdir(parents=True)
    (work / "conf" / "exp" / "cot.yaml").write_text(
        f"# @package _global_\nstage: cot\nmodel_name_or_path: {tiny['target']}\ntrain_file: {work / 'cot.jsonl'}\n"
        f"output_dir: {work / 'run'}\nprecision: fp32\ndata: {{collator: long_cot, max_seq_length: 512}}\n")
    srv, sink = StandIn(str(tiny["target"])), StandIn(str(tiny["target"]))
    srv.redirect_to = sink.url + "/v1/completions"
    print(json.dumps({"tree": str(a.tree), "load": os.getloadavg()[0]}), flush=True)
    rows = []
    try:
        for fault in a.faults.split(","):
            rows.append(one(fault, a.tree, work, srv, sink, [asks[i] for i in mine], a.timeout))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        srv.close()
        sink.close()
    cols = ("fault", "code", "seconds", "kept", "failed", "key_shown", "key_in_files", "key_elsewhere", "traceback",
            "stderr_kb", "peak_mb")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
