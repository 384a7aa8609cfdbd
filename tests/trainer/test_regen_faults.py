"""Regeneration against servers that misbehave (`python -m longspec.regenerate --server`), one
stand-in OpenAI server on 127.0.0.1 (tests/trainer/openai_standin.py) shared by the module: each
fault fails its own row with a short reason and no traceback, the key's text is in no output and
no file, a rerun gives the rows of a clean run; the served model is checked; every wait before
the first row is bounded; one run per stage folder; SIGTERM to `longspec regenerate` stops the
requests in flight and leaves no process behind. Real tokenizer, real processes, a real socket."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspec.data import regenstore as S
from longspec.runs import regenstate
from tests.trainer.openai_standin import StandIn, answer_of

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-standin-" + os.urandom(12).hex()
# record -> the fault its completion meets (7 and 11 are kept: a wait on Retry-After, a usage not believed)
PLAN = {0: "key400", 1: "redirect", 2: "empty", 3: "huge", 4: "long", 5: "surrogate", 6: "stall", 7: "ratelimit",
        8: "key500", 9: "badutf8", 10: "null", 11: "lie"}
REASONS = {0: "HTTP 400", 1: "redirects to", 2: "answer is empty", 3: "bytes, past the bound", 4: "tokens, more than",
           5: "not Unicode", 6: "no byte for 2 s", 8: "HTTP 500", 9: "HTTP 500", 10: "no answer text"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from longspec.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny) -> dict:
    """A long_cot stage over 12 tiny records whose questions are each in one prompt alone."""
    from longspec.data.collators import long_cot_messages

    root = tmp_path_factory.mktemp("faults")
    recs = [json.loads(line) for line in Path(tiny["data"]["longcot"]).read_text().splitlines()]
    asks = [long_cot_messages(r)[0]["content"] for r in recs]
    mine = [i for i in range(len(recs)) if sum(asks[i] in a for a in asks) == 1][:len(PLAN)]
    assert len(mine) == len(PLAN)
    (root / "cot.jsonl").write_text("".join(json.dumps(recs[i]) + "\n" for i in mine))
    (root / "conf" / "exp").mkdir(parents=True)
    (root / "conf" / "exp" / "cot.yaml").write_text(
        f"# @package _global_\nstage: cot\nmodel_name_or_path: {tiny['target']}\ntrain_file: {root / 'cot.jsonl'}\n"
        f"output_dir: {root / 'run'}\nprecision: fp32\ndata: {{collator: long_cot, max_seq_length: 512}}\n")
    return {"root": root, "asks": [asks[i] for i in mine]}


@pytest.fixture(scope="module")
def standin(tiny):
    srv, sink = StandIn(str(tiny["target"])), StandIn(str(tiny["target"]))
    srv.redirect_to = sink.url + "/v1/completions?where=elsewhere"
    yield srv, sink
    srv.close()
    sink.close()


@pytest.fixture
def server(standin):
    """The shared stand-in, behaving until a test says otherwise."""
    srv, sink = standin
    srv.fault, srv.models, srv.seen[:], sink.seen[:] = (lambda prompt: None), None, [], []
    srv.limited.clear()
    return srv, sink


def env(root: Path, **extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), LONGSPEC_CACHE_DIR=str(root / "cache"), TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", OPENAI_API_KEY=KEY, **extra)


def regenerate(root: Path, out: Path, *extra: str, code: int) -> tuple[dict | None, str]:
    argv = [sys.executable, "-m", "longspec.regenerate", "--config-dir", str(root / "conf"), "+exp=cot",
            "--out", str(out), "--json", *extra]
    proc = subprocess.run(argv, cwd=root, env=env(root), capture_output=True, text=True, timeout=300)
    SAID.append(proc.stdout + proc.stderr)
    assert proc.returncode == code, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "null"
    return json.loads(last), proc.stderr


SAID: list[str] = []          # every output of every run: the key must be in none


def rows_of(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for _, _, p in S.shards(out) for r in pq.read_table(str(p)).to_pylist()]


def failed_reasons(out: Path) -> dict[int, str]:
    return {f["index"]: f["reason"] for _, _, p in S.shards(out) for f in S.shard_meta(p)[1]}


def test_each_server_fault_fails_its_row_shortly_and_a_rerun_gives_the_rows_of_a_clean_run(server, work):
    srv, sink = server
    root, asks = work["root"], work["asks"]
    clean, faulty = root / "out-clean", root / "out-faulty"
    r, _ = regenerate(root, clean, "--server", srv.url, code=0)
    want = rows_of(clean)
    assert r["complete"] and r["kept"] == len(PLAN) == len(want)
    said = {i: answer_of(q["prompt"]) for q in srv.completions() for i, a in enumerate(asks) if a in q["prompt"]}
    assert [x["response"] for x in want] == [said[int(x["id"].split("#")[1])] for x in want]
    man = S.read_manifest(clean)
    assert man["engine"]["served"][srv.url] == {"id": srv.model_id, "max_model_len": None, "named": False}

    srv.fault = lambda prompt: next(PLAN[i] for i, a in enumerate(asks) if a in prompt)
    srv.seen[:] = []
    r, stderr = regenerate(root, faulty, "--server", srv.url, "--concurrency", "4", "--idle-timeout", "2",
                           "--retries", "1", code=7)
    assert "Traceback" not in stderr and len(stderr) < 20_000, stderr[-3000:]
    assert (r["failed"], r["kept"]) == (len(REASONS), len(PLAN) - len(REASONS))
    assert "in flight" in stderr                                       # the progress line counts requests
    reasons = failed_reasons(faulty)
    assert sorted(reasons) == sorted(REASONS)
    for i, words in REASONS.items():
        assert words in reasons[i] and "\n" not in reasons[i] and len(reasons[i]) < 400, (i, reasons[i])
    assert "*** ***" in reasons[0] and sink.url in reasons[1] and "where=elsewhere" not in reasons[1]
    assert not sink.seen                                               # the redirect was not followed
    limited = [q["at"] for q in srv.completions() if asks[7] in q["prompt"]]
    assert len(limited) == 2 and limited[1] - limited[0] >= 2.9        # Retry-After: 3 waited for, not 1 s backoff
    kept = {x["id"]: x for x in rows_of(faulty)}
    assert kept == {x["id"]: x for x in want if int(x["id"].split("#")[1]) in (7, 11)}   # usage 1,388,889 not believed
    assert regenstate.folder_state(faulty).failed == len(REASONS)      # what status shows

    srv.fault = lambda prompt: None
    r, _ = regenerate(root, faulty, "--server", srv.url, code=0)
    assert r["complete"] and rows_of(faulty) == want
    for text in SAID:
        assert KEY not in text
    written = [p for p in root.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not written, written


def test_the_served_model_is_checked_against_the_target(server, work):
    """Another model refused at the start (exit 1, naming both and the flag), taken with
    --served-model and recorded in the manifest; /v1/models that is not JSON, never answers or
    redirects is refused within --server-wait, no traceback."""
    from longspec.decode.engines import EngineError, ServerEngine

    srv, sink = server
    root = work["root"]
    out = root / "out-other"
    srv.models = "other"
    _, stderr = regenerate(root, out, "--server", srv.url, "--limit", "2", code=1)
    words = " ".join(stderr.split())
    assert f"serves 'some-other-model', not the stage's target {srv.model_id}" in words
    assert "--served-model 'some-other-model'" in words and "Traceback" not in stderr and not rows_of(out)
    r, _ = regenerate(root, out, "--server", srv.url, "--limit", "2", "--served-model", "some-other-model", code=0)
    assert r["complete"] and S.read_manifest(out)["engine"]["served"][srv.url] == {
        "id": "some-other-model", "max_model_len": None, "named": True}

    for how, words in (("not-json", "answered what is not JSON"), ("hang", "does not answer /v1/models within"),
                       ("redirect", f"redirects to {sink.url}/v1/completions: not followed"),
                       ("short", "max_model_len 64, below the stage's max_seq_length 512")):
        srv.models = how
        t0 = time.monotonic()
        with pytest.raises(EngineError) as e:
            ServerEngine([srv.url], wait=1, target=srv.model_id, max_seq_length=512)
        assert words in str(e.value) and len(str(e.value)) < 400 and time.monotonic() - t0 < 10, str(e.value)
    assert not sink.seen


def test_one_run_per_stage_and_sigterm_leaves_no_process_behind(server, work, tiny):
    """`longspec regenerate` on a server that never answers: a second run on the stage is refused,
    naming the first's process, --force or not; SIGTERM to the first stops its requests in flight
    (long before --idle-timeout) and leaves no process; the same command then finishes."""
    import psutil

    srv, _ = server
    root = work["root"]
    proj = root / "proj"
    init = subprocess.run([sys.executable, "-m", "longspec_cli", "init", str(proj), "--preset", "tiny", "--target",
                           str(tiny["target"]), "--no-input", *(a for s in ("base", "long", "longcot")
                                                                 for a in ("--data", f"{s}={root / 'cot.jsonl'}"))],
                          cwd=root, env=env(root), capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr
    argv = [sys.executable, "-m", "longspec_cli", "regenerate", str(proj), "longcot", "--server", srv.url,
            "--idle-timeout", "100", "--limit", "4"]
    srv.fault = lambda prompt: "hang"
    first = subprocess.Popen(argv, cwd=root, env=env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not srv.completions() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.poll() is None and srv.completions()
    child = psutil.Process(first.pid).children()[0]
    second = subprocess.run(argv + ["--force"], cwd=root, env=env(root), capture_output=True, text=True, timeout=300)
    words = " ".join(second.stderr.replace("│", " ").split())
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"another regeneration writes this folder: process {child.pid}" in words and "longspec.regenerate" in words

    t0 = time.monotonic()
    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=60)
    SAID.extend([stdout, stderr, second.stdout, second.stderr])
    assert first.returncode == 5 and time.monotonic() - t0 < 30, stderr[-3000:]
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE
    assert "Traceback" not in stderr

    srv.fault = lambda prompt: None
    again = subprocess.run(argv, cwd=root, env=env(root), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert regenstate.folder_state(proj / "data" / "regen" / "longcot").complete
    for text in SAID + [again.stdout + again.stderr]:
        assert KEY not in text


def test_what_a_server_writes_is_cut_short_masked_and_retry_after_read():
    from longspec.decode import openai_http as H

    body = f'{{"error": "no", "auth": "Authorization: Bearer {KEY}", "k": "{KEY}"}}\n' + "x" * 10_000
    said = H.excerpt(body.encode(), [KEY])
    assert KEY not in said and "\n" not in said and len(said) <= H.EXCERPT + 3
    assert "Bearer abc.def" not in H.excerpt("Bearer abc.def", []) and "api_key=***" in H.excerpt("api_key=zzz", [])
    assert H.retry_after("7", cap=120) == 7 and H.retry_after("9999", cap=120) == 120
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= H.retry_after(date, cap=120) <= 30 and H.retry_after("soon", cap=120) is None


def test_a_key_given_as_the_name_of_its_variable_is_not_printed_back(monkeypatch):
    from longspec.project import serverkeys

    secret = "sk_live_" + os.urandom(8).hex()
    monkeypatch.delenv(secret, raising=False)
    with pytest.raises(serverkeys.KeyProblem) as e:
        serverkeys.plan(["http://127.0.0.1:1"], [secret])
    assert secret not in str(e.value) and "reads like a key" in str(e.value)
    monkeypatch.delenv("VLLM_KEY_9", raising=False)
    with pytest.raises(serverkeys.KeyProblem, match="--api-key-env VLLM_KEY_9: the variable is not set"):
        serverkeys.plan(["http://127.0.0.1:1"], ["VLLM_KEY_9"])
