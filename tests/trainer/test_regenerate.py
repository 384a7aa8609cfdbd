"""Regeneration (`python -m longspec.regenerate`) on the tiny target: the embedded engine is greedy
`generate`; a real `transformers serve` gives the same rows; kill -9 then a rerun gives the rows of
an uninterrupted run; cut answers are dropped and counted; a changed setting is refused; a
document's prefix is untrained context; a document the target ends at once is kept, its end
trained, across a resume. Real tokenizer, real model, real processes, real server."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from longspec.data import encoding
from longspec.data import regen as R
from longspec.data import regenstore as S
from longspec.runs import regenstate

REPO = Path(__file__).resolve().parents[2]
COT_RECORDS = 8
# Base records in the other answer style (longspec.data.synthetic.restyle): the tiny target ends
# 237 and 472 at once after their first 32 tokens (an empty continuation), 236 and 238 it continues.
ENDS = (236, 237, 238, 472)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from longspec.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


@pytest.fixture(scope="module")
def tok(tiny):
    return encoding.load_tokenizer(str(tiny["target"]))


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny) -> Path:
    """A stage per collator over a few of the tiny records (conf/exp/{cot,doc}.yaml)."""
    root = tmp_path_factory.mktemp("regen")
    lines = Path(tiny["data"]["longcot"]).read_text().splitlines()
    (root / "cot.jsonl").write_text("\n".join(lines[:COT_RECORDS]) + "\n")
    docs = Path(tiny["data"]["base"]).read_text().splitlines()
    (root / "doc.jsonl").write_text("\n".join(docs[:4]) + "\n")
    from longspec.data.synthetic import restyle

    (root / "ends.jsonl").write_text("".join(json.dumps(restyle(json.loads(docs[i]), "other")) + "\n" for i in ENDS))
    (root / "conf" / "exp").mkdir(parents=True)
    for name, collator, seq in (("cot", "long_cot", 512), ("doc", "short_text", 96), ("ends", "short_text", 128)):
        (root / "conf" / "exp" / f"{name}.yaml").write_text(
            f"# @package _global_\nstage: {name}\nmodel_name_or_path: {tiny['target']}\n"
            f"train_file: {root / (name + '.jsonl')}\noutput_dir: {root / 'run'}\nprecision: fp32\n"
            f"data: {{collator: {collator}, max_seq_length: {seq}}}\n")
    return root


def cmd(work: Path, stage: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "longspec.regenerate", "--config-dir", str(work / "conf"), f"+exp={stage}",
            "--out", str(out), "--json", *extra]


def env(work: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), LONGSPEC_CACHE_DIR=str(work / "cache"),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def regenerate(work: Path, stage: str, out: Path, *extra: str, code: int = 0) -> dict:
    proc = subprocess.run(cmd(work, stage, out, *extra), cwd=work, env=env(work), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == code, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def rows_of(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for _, _, p in S.shards(out) for r in pq.read_table(str(p)).to_pylist()]


@pytest.fixture(scope="module")
def embedded(work) -> dict:
    """One uninterrupted embedded run of the chat stage: the reference the other tests compare with."""
    out = work / "out-embedded"
    r = regenerate(work, "cot", out, "--shard-rows", "3", "--batch", "4")
    return {"result": r, "rows": rows_of(out), "out": out}


def _requests(tok, work: Path, limit: int = 4) -> list:
    """Chat turns and document prefixes together (their stop tokens differ: a batch must not mix them)."""
    p = R.Prompter(tok, 512, 16, 64)
    rows = list(R.source_rows(work / "cot.jsonl", "long_cot"))[:limit]
    docs = list(R.source_rows(work / "doc.jsonl", "short_text"))[:2]
    return [p.next_request(r) for r in rows[:2] + docs + rows[2:]]


def test_embedded_engine_is_greedy_generate(tiny, tok, work):
    """Left-padded batches give each prompt's own greedy `generate` text, stop and token count,
    documents (stop: EOS) and chat turns (stop: end of turn too) asked together."""
    import torch
    from transformers import AutoModelForCausalLM

    from longspec.decode.engines import EmbeddedEngine

    reqs = _requests(tok, work)
    eng = EmbeddedEngine(tiny["target"], tok, batch=4, device="cpu")
    assert {q.stop_ids for q in reqs} == {(0,), (0, 2)}
    got = eng.answer(reqs)
    model = AutoModelForCausalLM.from_pretrained(str(tiny["target"])).eval()
    for q, a in zip(reqs, got):
        with torch.no_grad():
            gen = model.generate(torch.tensor([q.ids]), do_sample=False, max_new_tokens=q.max_new,
                                 eos_token_id=list(q.stop_ids), pad_token_id=tok.pad_token_id)[0, len(q.ids):].tolist()
        stopped = gen[-1] in q.stop_ids
        want = tok.decode(gen[:-1] if stopped else gen, skip_special_tokens=True)
        assert (a.text, a.tokens, a.finish) == (want, len(gen), "stop" if stopped else "length")
    assert any(a.finish == "stop" for a in got)


def test_embedded_run_writes_trainable_ordered_rows(embedded, work, tok):
    r, rows = embedded["result"], embedded["rows"]
    assert r["complete"] and r["done"] == r["records"] == COT_RECORDS
    assert r["kept"] + r["truncated"] + r["failed"] + r["skipped"] == COT_RECORDS and r["kept"] > 0
    assert len(rows) == r["kept"] and all(x["finish_reason"] == "stop" for x in rows)
    idx = [int(x["id"].split("#")[1]) for x in rows]
    assert idx == sorted(set(idx))                                     # source order, no duplicate
    assert [(s, e) for s, e, _ in S.shards(embedded["out"])] == [(0, 3), (3, 6), (6, 8)]
    man = S.read_manifest(embedded["out"])
    assert man["complete"] and man["counts"]["kept"] == r["kept"] and man["settings"]["max_seq_length"] == 512
    assert man["source"]["files"][0]["sha256"] and man["target"]["digest"] and man["tokenizer"]
    ds = encoding.build_dataset(embedded["out"], tok, "long_cot", 512)   # the folder is a train_file
    assert len(ds) == len(rows)
    src = {f"cot.jsonl#{i}": json.loads(line) for i, line in enumerate((work / "cot.jsonl").read_text().splitlines())}
    from longspec.data.collators import long_cot_messages

    for x in rows:                                  # the question kept, the answer the target's
        asked = long_cot_messages(src[x["id"]])[0]["content"]
        assert x["prompt"] == asked
    assert "rows/s" in r["stderr"] and "tokens/s" in r["stderr"]


def test_kill_9_then_rerun_gives_the_uninterrupted_rows(embedded, work):
    out = work / "out-killed"
    kills, cut = 0, []
    for _ in range(2):        # killed at a random moment, then killed again in the run that resumes
        before = len(S.shards(out))
        proc = subprocess.Popen(cmd(work, "cot", out, "--shard-rows", "3", "--batch", "4"), cwd=work,
                                env=env(work), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while len(S.shards(out)) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.5))
        if proc.poll() is not None:
            break             # the resumed run finished first: the final rerun below checks it all
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        cut.append(S.shards(out)[-1][1])
    assert kills >= 1 and cut[0] < COT_RECORDS, (kills, cut)           # the first kill came halfway
    r = regenerate(work, "cot", out, "--shard-rows", "3", "--batch", "4")
    assert r["complete"] and not list(out.glob(".part-*"))
    assert rows_of(out) == embedded["rows"]
    assert {k: r[k] for k in S.COUNTS} == {k: embedded["result"][k] for k in S.COUNTS}


def test_cut_answers_dropped_and_counted_and_a_changed_setting_refused(work):
    out = work / "out-cut"
    r = regenerate(work, "cot", out, "--max-new-tokens", "4", "--limit", "3")
    assert (r["kept"], r["truncated"], r["done"]) == (0, 3, 3) and rows_of(out) == []
    r = regenerate(work, "cot", out, "--max-new-tokens", "4", "--limit", "3", "--keep-truncated", code=1)
    assert "a setting changed (keep_truncated False -> True)" in r["stderr"] and "--force" in r["stderr"]
    assert r["exit_code"] == 1
    r = regenerate(work, "cot", out, "--max-new-tokens", "4", "--limit", "3", "--keep-truncated", "--force")
    rows = rows_of(out)
    assert r["truncated"] == 3 and len(rows) == 3
    assert all(x["finish_reason"] == "length" and x["completion_tokens"] == 4 for x in rows)


def test_document_prefix_is_untrained_context(work, tok):
    out = work / "out-doc"
    r = regenerate(work, "doc", out, "--prefix-tokens", "16", "--max-new-tokens", "24")
    rows = rows_of(out)
    assert r["complete"] and len(rows) == r["kept"] + r["truncated"] * 0 and r["done"] == 4
    src = [json.loads(line)["text"] for line in (work / "doc.jsonl").read_text().splitlines()]
    assert r["kept"] + r["truncated"] == 4
    for x in rows:
        assert src[int(x["id"].split("#")[1])].startswith(x["context"])
        kinds: list[str] = []
        ids, trained = encoding.encode_record(x, tok, "short_text", 96, kinds)
        n_ctx = len(tok(x["context"])["input_ids"])
        assert not any(trained[:n_ctx]) and all(trained[n_ctx:-1]) and kinds[0] == "prompt"


def test_documents_the_target_ends_at_once_are_kept_training_the_end_across_a_resume(work, tok):
    """An empty continuation trains the document's end where the target put it (labels go by
    position: the tiny EOS is also its pad, and trained all the same), so it is written like any row."""
    out = work / "out-ends"
    first = regenerate(work, "ends", out, "--prefix-tokens", "32", "--shard-rows", "2", "--limit", "2")
    assert (first["kept"], first["untrainable"], first["done"]) == (2, 0, 2)
    r = regenerate(work, "ends", out, "--prefix-tokens", "32", "--shard-rows", "2")      # resumes at record 2
    assert r["resumed_at"] == 2 and r["complete"] and (r["kept"], r["untrainable"], r["done"]) == (4, 0, 4)
    assert r["skipped"] == r["failed"] == r["truncated"] == 0
    rows = rows_of(out)
    assert [x["id"] for x in rows] == [f"ends.jsonl#{i}" for i in range(4)]
    empty = [x for x in rows if not x["text"]]
    assert [x["id"] for x in empty] == ["ends.jsonl#1", "ends.jsonl#3"]        # the target ended these at once
    for x in empty:
        ids, trained = encoding.encode_record(x, tok, "short_text", 128)
        assert [i for i, t in zip(ids, trained) if t] == [tok.eos_token_id] == [tok.pad_token_id]
    assert encoding.untrainable({"context": rows[0]["context"], "text": ""}, tok, "short_text", 128) is None


def test_sigterm_writes_the_rows_done_and_exits_5(embedded, work):
    out = work / "out-term"
    proc = subprocess.Popen(cmd(work, "cot", out, "--shard-rows", "2", "--batch", "2", "--limit", "6"), cwd=work,
                            env=env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not S.shards(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    live = regenstate.regen_state(out)          # what `longspec status` reads while it runs
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip("the run ended before the signal")
    assert live is not None and live.state == "running" and live.pid == proc.pid and live.total == 6
    assert proc.returncode == 5, stderr[-2000:]
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["stopped_by"] == "SIGTERM" and not r["complete"] and r["done"] >= 2
    gone = regenstate.regen_state(out)          # the record stays: the run is resumable
    assert gone is not None and gone.state == "interrupted" and gone.done == r["done"]
    assert rows_of(out) == [x for x in embedded["rows"] if int(x["id"].split("#")[1]) < r["done"]]
    assert regenerate(work, "cot", out, "--shard-rows", "2", "--batch", "2", "--limit", "6")["complete"]
    assert rows_of(out) == [x for x in embedded["rows"] if int(x["id"].split("#")[1]) < 6]
    assert regenstate.regen_state(out) is None  # a run that ends by itself leaves no record


# ----------------------------------------------------------------------------- a real server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`transformers serve` pinned to a target on 127.0.0.1:port, started and killed by the tests."""

    def __init__(self, target: Path, port: int | None = None):
        self.target, self.port, self.proc = target, port or _free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "Serve":
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
        self.proc = subprocess.Popen([exe, "serve", str(self.target), "--host", "127.0.0.1", "--port", str(self.port),
                                      "--device", "cpu"], env=dict(os.environ, HF_HUB_OFFLINE="1"),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, "transformers serve exited while starting"
            assert time.monotonic() < deadline, "transformers serve did not answer /health in 120 s"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The signal to the server's whole process group (its own session), then reaped."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def _needs_serving() -> None:
    if not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "openai")):
        pytest.skip("transformers[serving] is not installed")


@pytest.fixture(scope="module")
def serve(tiny):
    """A starter of `transformers serve` on the tiny target (the `serving` extra: fastapi,
    uvicorn); every server it started is killed at the end of the module."""
    _needs_serving()
    started: list[Serve] = []

    def start(port: int | None = None) -> Serve:
        started.append(Serve(tiny["target"], port).start())
        return started[-1]

    yield start
    for s in started:
        s.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def server(serve) -> str:
    """The module's shared `transformers serve`."""
    return serve().url


def test_server_engine_gives_the_embedded_rows(server, embedded, work):
    out = work / "out-server"
    r = regenerate(work, "cot", out, "--shard-rows", "3", "--server", server, "--concurrency", "2")
    assert r["engine"]["kind"] == "server" and r["complete"]
    assert rows_of(out) == embedded["rows"]
    assert {k: r[k] for k in S.COUNTS} == {k: embedded["result"][k] for k in S.COUNTS}
    # --api chat: the server renders the turns itself (chat_template_kwargs sent): the same rows
    out = work / "out-server-chat"
    r = regenerate(work, "cot", out, "--limit", "4", "--server", server, "--api", "chat")
    assert r["engine"]["api"] == "chat" and r["complete"]
    assert rows_of(out) == [x for x in embedded["rows"] if int(x["id"].split("#")[1]) < 4]


def test_a_server_that_does_not_answer_is_refused(work):
    r = regenerate(work, "cot", work / "out-nosrv", "--server", f"http://127.0.0.1:{_free_port()}", "--server-wait", "2",
                   code=1)
    words = " ".join(r["stderr"].split())
    assert "does not answer /v1/models within 2 s (--server-wait)" in words and "Traceback" not in words


def test_a_server_reads_the_prompt_ids_the_trainer_reads_when_the_tokenizer_adds_a_bos(tiny):
    """A server tokenizes the prompt text with the tokenizer's own special tokens (Llama 3: a BOS);
    the rendered chat holds the BOS already, so the text sent leaves it out: the same ids."""
    from tokenizers import processors

    tok = encoding.load_tokenizer(str(tiny["target"]))
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    bos = tok.convert_tokens_to_ids("<|bos|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    p = R.Prompter(tok, 512, 16, None)
    row = R.Row(0, "x#0", "chat", {}, messages=[{"role": "user", "content": "add 1 and 2 ."},
                                               {"role": "assistant", "content": "3 ."}], todo=[1])
    q = p.next_request(row)
    assert q.ids[0] == bos and q.ids.count(bos) == 1 and not q.text.startswith("<|bos|>")
    assert tok(q.text)["input_ids"] == q.ids


def test_server_engine_retries_timeouts_429_and_5xx_and_fails_a_400(tok, work):
    """A stand-in OpenAI server (stdlib, 127.0.0.1) answers 503, then 429, then 200: one answer
    after backoff; a 400 fails the request at once with the server's words."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from longspec.decode.engines import EngineError, ServerEngine

    replies = [(503, b"Internal Server Error"), (429, b'{"detail": "slow down"}')]
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            if body["prompt"] == "bad":
                return self._send(400, b'{"detail": "prompt too long"}')
            if replies:
                return self._send(*replies.pop(0))
            self._send(200, json.dumps({"choices": [{"text": "3 .", "finish_reason": "stop"}],
                                        "usage": {"completion_tokens": 3}}).encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        eng = ServerEngine([f"http://127.0.0.1:{httpd.server_address[1]}/v1"], concurrency=1, backoff=0.01)
        q = R.Request([1, 2], "add 1 and 2 .", 7, (2,), ("<|im_end|>",))
        a = eng.ask(q)
        assert (a.text, a.tokens, a.finish) == ("3 .", 3, "stop") and len(bodies) == 3
        assert bodies[-1] == {"model": "tiny", "prompt": "add 1 and 2 .", "max_tokens": 7, "temperature": 0,
                              "stop": ["<|im_end|>"], "stream": True, "stream_options": {"include_usage": True}}
        with pytest.raises(EngineError, match="HTTP 400.*prompt too long"):
            eng.ask(R.Request([1], "bad", 7, (2,), ()))
        assert len(bodies) == 4                                          # not retried
        eng.close()
    finally:
        httpd.shutdown()


def test_rows_finishing_out_of_order_come_out_in_source_order_within_the_window():
    """The server path's reorder buffer: rows finish in any order, are yielded in source order, and
    no more than `window` are in flight; after stop(), only rows already finished in order come out."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from longspec.decode.engines import ordered

    eng = SimpleNamespace(pool=ThreadPoolExecutor(4))
    busy, peak, lock = [0], [0], threading.Lock()
    rng = random.Random(3)
    delays = [rng.uniform(0, 0.03) for _ in range(40)]

    def step(row):
        with lock:
            busy[0] += 1
            peak[0] = max(peak[0], busy[0])
        time.sleep(delays[row.index])
        row.status = "kept"
        with lock:
            busy[0] -= 1

    def rows(n):
        return (R.Row(i, f"f#{i}", "chat", {}) for i in range(n))

    got = [r.index for r in ordered(eng, rows(40), step, window=6, stop=lambda: False)]
    assert got == list(range(40)) and peak[0] <= 4
    stop = [False]
    out = []
    for r in ordered(eng, rows(40), step, window=6, stop=lambda: stop[0]):
        out.append(r.index)
        stop[0] = stop[0] or len(out) >= 5
    assert out == list(range(len(out))) and 5 <= len(out) <= 5 + 6          # the window at most
    eng.pool.shutdown()


# ----------------------------------------------------------------------------- servers that go away

def _wait_for_shard(out: Path, proc: subprocess.Popen, budget: float = 300) -> None:
    deadline = time.monotonic() + budget
    while not S.shards(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and S.shards(out), "the run ended (or wrote nothing) before the kill"


def test_a_killed_server_stops_the_run_within_the_bound_and_a_rerun_finishes_it(serve, embedded, work):
    """`transformers serve` SIGKILLed mid-run: the run stops --server-wait seconds later (exit 6,
    the rows done kept in order, the message and the rerun command); the same server started again
    on its port, the same command gives the rows of an uninterrupted run."""
    srv = serve()
    out = work / "out-outage"
    argv = cmd(work, "cot", out, "--shard-rows", "2", "--server", srv.url, "--concurrency", "2", "--server-wait", "5")
    proc = subprocess.Popen(argv, cwd=work, env=env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_shard(out, proc)
    killed = time.monotonic()             # before the signal: the run's clock starts at its first failed request
    srv.kill()
    stdout, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - killed
    print(f"\nkill -> stop: {took:.1f} s (--server-wait 5)")
    assert proc.returncode == 6, stderr[-3000:]
    assert 5 <= took < 5 + 20, took
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["stopped_by"] == "servers" and not r["complete"] and r["failed"] == 0 and 2 <= r["done"] < COT_RECORDS
    words = " ".join(stderr.split())
    assert f"server {srv.url} stopped answering" in words and words.count("stopped answering") == 1
    assert f"no server answered for 5 s ({srv.url})" in words and "--server-wait 5" in words     # the rerun command
    assert "Traceback" not in stderr
    assert rows_of(out) == [x for x in embedded["rows"] if int(x["id"].split("#")[1]) < r["done"]]
    state = regenstate.folder_state(out)
    assert state.unfinished and (state.done, state.records, state.failed) == (r["done"], COT_RECORDS, 0)

    srv.start()                                                    # back on the same port
    r = regenerate(work, "cot", out, "--shard-rows", "2", "--server", srv.url, "--concurrency", "2")
    print(f"rerun: {len(rows_of(out))} rows, the same as the embedded engine's: {rows_of(out) == embedded['rows']}")
    assert r["complete"] and rows_of(out) == embedded["rows"]
    assert {k: r[k] for k in S.COUNTS} == {k: embedded["result"][k] for k in S.COUNTS}
    assert not regenstate.folder_state(out).unfinished


def test_two_servers_one_killed_the_run_finishes_on_the_other(serve, server, embedded, work):
    spare = serve()
    out = work / "out-two"
    argv = cmd(work, "cot", out, "--shard-rows", "2", "--server", server, "--server", spare.url,
               "--concurrency", "1", "--server-wait", "5")
    proc = subprocess.Popen(argv, cwd=work, env=env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_shard(out, proc)
    spare.kill()
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    r = json.loads(stdout.strip().splitlines()[-1])
    words = " ".join(stderr.split())
    assert words.count(f"server {spare.url} stopped answering") == 1 and "its requests go to the 1 other server" in words
    assert r["complete"] and r["failed"] == 0 and rows_of(out) == embedded["rows"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny, work) -> Path:
    """A tiny-preset project on the module's target whose longcot stage reads cot.jsonl (the
    embedded reference's records and settings: long_cot, max_seq_length 512, fp32)."""
    proj = tmp_path_factory.mktemp("proj") / "p"
    res = longspec("init", str(proj), "--preset", "tiny", "--target", str(tiny["target"]), "--no-input",
                   "--data", f"longcot={work / 'cot.jsonl'}", "--data", f"base={work / 'doc.jsonl'}",
                   "--data", f"long={work / 'cot.jsonl'}", work=work)
    assert res.returncode == 0, res.stderr
    return proj


def longspec(*args: str, work: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longspec_cli", *args], capture_output=True, text=True,
                          cwd=work, env=env(work), timeout=timeout)


def test_failed_rows_exit_7_are_not_used_and_the_same_command_asks_exactly_them_again(project, server, embedded, work):
    """A front refuses two rows' requests with a 400: the run records them by id, exits 7 with the
    count and the command; --use leaves train_file; status and monitor say so. The same command
    again asks exactly those two and the folder holds the uninterrupted run's rows, then is used."""
    from longspec.data.collators import long_cot_messages
    from tests.trainer.openai_front import Front

    recs = [json.loads(line) for line in (work / "cot.jsonl").read_text().splitlines()]
    asks = [long_cot_messages(r)[0]["content"] for r in recs]
    bad = [i for i in range(COT_RECORDS) if sum(asks[i] in a for a in asks) == 1][1:3]
    assert len(bad) == 2
    front = Front(server, refuse=lambda body: any(asks[i] in json.loads(body).get("prompt", "") for i in bad))
    stage_file, folder = project / "conf" / "exp" / "longcot.yaml", project / "data" / "regen" / "longcot"
    before = stage_file.read_text()
    args = ("regenerate", str(project), "longcot", "--server", front.url, "--concurrency", "2", "--use")
    try:
        res = longspec(*args, work=work)
        words = " ".join(res.stderr.replace("│", " ").split())        # the panel's box left out
        assert res.returncode == 7, res.stderr[-3000:]
        assert "regenerated 6/8, 2 failed" in words and "train_file left as it is" in words and "Traceback" not in words
        rerun = f"longspec regenerate {project} longcot --server {front.url} --concurrency 2 --use"
        assert rerun in words and f"cot.jsonl#{bad[0]}: failed:" in words and "HTTP 400" in words
        assert stage_file.read_text() == before and front.refused == 2
        ids = [x["id"] for x in rows_of(folder)]
        assert ids == [x["id"] for x in embedded["rows"] if int(x["id"].split("#")[1]) not in bad]

        status = longspec("status", str(project), "--json", work=work)
        longcot = next(s for s in json.loads(status.stdout)["stages"] if s["name"] == "longcot")
        assert f"regenerated 6/8, 2 failed: rerun {rerun}" in longcot["reasons"]
        assert longcot["regeneration"]["state"] == "unfinished" and longcot["regeneration"]["failed"] == 2
        monitor = longspec("monitor", str(project), "--once", work=work)
        assert f"longcot: regenerated 6/8, 2 failed: rerun {rerun}" in monitor.stdout

        front.refuse, seen = None, len(front.seen)
        res = longspec(*args, work=work)
        assert res.returncode == 0, res.stderr[-3000:]
        assert rows_of(folder) == embedded["rows"] and front.refused == 2
        assert [q["path"] for q in front.seen[seen:]] == ["/v1/models", "/v1/completions", "/v1/completions"]
        assert f"train_file: {folder}" in stage_file.read_text()
        status = longspec("status", str(project), "--json", work=work)
        longcot = next(s for s in json.loads(status.stdout)["stages"] if s["name"] == "longcot")
        assert not any("failed: rerun" in r for r in longcot["reasons"])   # whole: its counts alone
        assert longcot["regeneration"]["state"] == "complete" and longcot["regeneration"]["counts"]["failed"] == 0
    finally:
        front.close()


# ----------------------------------------------------------------------------- servers that want a key

def _self_signed(folder: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (openssl), for the front's https."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_a_server_that_wants_a_key_gets_it_from_the_environment_and_it_shows_nowhere(server, embedded, work, project):
    """A key-checking https front before the real server: with the right key (from the variable
    --api-key-env names) the rows are the embedded engine's; with none or a wrong one the run stops
    at its first request that is refused, exit 1, saying which server and variable (the front
    first leaves /v1/models open, so the refusal comes mid-run, not at the start); a URL with credentials and an
    unset variable are refused before any request (exit 2). No file the runs wrote, no output and
    no manifest holds the key's text."""
    from tests.trainer.openai_front import Front

    key, wrong, password = "sk-right-" + os.urandom(12).hex(), "sk-wrong-" + os.urandom(12).hex(), os.urandom(8).hex()
    cert, tls_key = _self_signed(work)
    front = Front(server, key=key, tls=(cert, tls_key))
    out, said = work / "out-key", []

    def run(*extra: str, code: int, **variables: str) -> str:
        e = {k: v for k, v in env(work).items() if k != "OPENAI_API_KEY"}
        proc = subprocess.run(cmd(work, "cot", out, "--limit", "4", "--server", front.url, *extra), cwd=work,
                              env={**e, "SSL_CERT_FILE": cert, **variables}, capture_output=True, text=True, timeout=600)
        said.append(proc.stdout + proc.stderr)
        assert proc.returncode == code, proc.stderr[-3000:]
        return " ".join(proc.stderr.split())

    try:
        front.open = {"/v1/models"}
        words = run("--concurrency", "1", code=1)
        assert f"server {front.url} wants a key (HTTP 401) and none was sent: OPENAI_API_KEY is not set" in words
        assert [q["path"] for q in front.seen] == ["/v1/models", "/v1/completions"]  # stopped at the first refusal
        assert "Traceback" not in words and not rows_of(out) and not S.read_manifest(out)["complete"]
        front.open, front.seen[:] = set(), []
        words = run(code=1)
        assert len(front.seen) == 1 and "wants a key (HTTP 401)" in words      # vLLM's --api-key guards /v1/models too
        words = run("--api-key-env", "REGEN_KEY", code=1, REGEN_KEY=wrong)
        assert f"server {front.url} refused the key read from REGEN_KEY (HTTP 401; the key is not shown)" in words
        assert len(front.seen) == 2 and front.seen[-1]["auth"] == f"Bearer {wrong}"
        run("--api-key-env", "REGEN_KEY", code=0, REGEN_KEY=key)
        assert rows_of(out) == [x for x in embedded["rows"] if int(x["id"].split("#")[1]) < 4]
        assert {q["auth"] for q in front.seen[2:]} == {f"Bearer {key}"} and len(front.seen) > 3
        assert S.read_manifest(out)["engine"]["key_envs"] == {front.url: "REGEN_KEY"}
        run(code=0, OPENAI_API_KEY=key)                                           # the default variable
    finally:
        front.close()

    userinfo = f"https://user:{password}@127.0.0.1:1"
    res = longspec("regenerate", str(project), "longcot", "--server", userinfo, work=work)
    said.append(res.stdout + res.stderr)
    words = " ".join(res.stderr.replace("│", " ").split())
    assert res.returncode == 2 and "credentials in a URL" in words and "https://***@127.0.0.1:1" in words
    res = longspec("regenerate", str(project), "longcot", "--server", front.url, "--api-key-env", "NO_SUCH_KEY_VAR",
                   work=work)
    said.append(res.stdout + res.stderr)
    assert res.returncode == 2 and "--api-key-env NO_SUCH_KEY_VAR: the variable is not set" in res.stderr
    for secret in (key, wrong, password):
        assert not any(secret in text for text in said)
        written = [p for p in (*work.rglob("*"), *project.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]
        assert not written, written
