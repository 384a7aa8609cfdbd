"""`longspec prepare DIR STAGE --show K` (text and --json) on the tiny demo project and on a copy
whose target carries QwQ-32B's published chat template (tests/trainer/templates/qwq-32b.jinja)."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QWQ_TEMPLATE = ROOT / "tests" / "trainer" / "templates" / "qwq-32b.jinja"

_RETEMPLATE = r"""
import sys
from transformers import AutoTokenizer
target, template = sys.argv[1], open(sys.argv[2]).read()
tok = AutoTokenizer.from_pretrained(target)
tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
tok.eos_token = "<|im_end|>"
tok.chat_template = template
tok.save_pretrained(target)
"""


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "longspec_cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def projects(tmp_path_factory):
    base = tmp_path_factory.mktemp("show")
    demo = base / "demo"
    res = cli("init", str(demo), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    qwq = base / "qwq"
    shutil.copytree(demo, qwq, symlinks=True)
    for conf in (qwq / "conf" / "exp").glob("*.yaml"):
        conf.write_text(conf.read_text().replace(str(demo), str(qwq)))
    target = qwq / "assets" / "target"
    if target.is_symlink():
        real = target.resolve()
        target.unlink()
        shutil.copytree(real, target)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _RETEMPLATE, str(target), str(QWQ_TEMPLATE)], check=True,
                   env=env, capture_output=True, timeout=300)
    return {"demo": demo, "qwq": qwq}


def show_json(proj: Path, stage: str, k: int) -> dict:
    res = cli("prepare", str(proj), stage, "--show", str(k), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def runs(rec: dict, trained: bool = True) -> list[str]:
    """The record's text as runs of trained (or untrained) tokens."""
    out, cur = [], None
    for _, text, t in rec["tokens"]:
        if t == trained:
            cur = (cur or "") + text
        elif cur is not None:
            out.append(cur)
            cur = None
    return out + ([cur] if cur is not None else [])


def test_show_text_marks_trained_spans_with_brackets_and_counts_them(projects):
    res = cli("prepare", str(projects["demo"]), "long", "--show", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "== long (long_data, max_seq_length 512)" in out
    assert out.count("-- record ") == 4 and "-- record 3 (line 4): " in out
    arxiv = out.split("-- record 2 ")[1].split("-- record 3 ")[0]
    assert "<|im_start|>user\nPlease summarize the following article: " in arxiv   # upstream's words, untrained
    assert "[we study the facts ." in arxiv                                         # the summary is trained
    st = json.loads(cli("status", str(projects["demo"]), "--json").stdout)
    assert next(s["prepared"]["state"] for s in st["stages"] if s["name"] == "long") == "missing"  # no cache built


def test_show_json_on_the_demo_trains_answers_and_their_end_of_turn(projects):
    r = show_json(projects["demo"], "long", 5)
    assert r["stage"] == "long" and r["collator"] == "long_data" and len(r["records"]) == 5
    book, code, arxiv, tulu, messages = r["records"]
    assert [rec["index"] for rec in r["records"]] == [0, 1, 2, 3, 4]
    for rec in r["records"]:
        assert all(isinstance(i, int) and isinstance(t, str) and isinstance(tr, bool) for i, t, tr in rec["tokens"])
        assert rec["prompt"] + rec["trained"] == len(rec["tokens"])
    assert book["prompt"] == 0 and code["prompt"] == 0                      # plain documents: all trained
    for chat in (arxiv, tulu, messages):
        trained = runs(chat)
        assert all(t.endswith("<|im_end|>\n") for t in trained[:-1]) and trained
        assert not any("remember :" in t or "<|im_start|>" in t for t in trained)   # user turns, headers
        assert chat["end_of_turn_trained"] is True


def test_show_json_under_qwq_32b_template(projects):
    r = show_json(projects["qwq"], "longcot", 2)
    first = r["records"][0]
    prompt = "".join(runs(first, trained=False))
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert "<think>" not in "".join(runs(first))                 # QwQ's generation header: not trained
    assert first["cut"] == 0 and first["end_of_turn_trained"] is True   # the demo's chains fit 512 tokens
    assert "".join(runs(first)).endswith("<|im_end|>\n")
    long = show_json(projects["qwq"], "long", 5)["records"]
    for chat in long[2:]:
        trained = runs(chat)
        assert trained and all(t.endswith("<|im_end|>\n") for t in trained[:-1])
        assert not any("<|im_start|>" in t for t in trained)
    res = cli("prepare", str(projects["qwq"]), "longcot", "--show", "1")
    assert res.returncode == 0 and "no end of turn trained" not in res.stdout
    assert "<think>\n[" in res.stdout                               # the answer starts after the header


def test_validate_warns_from_the_cache_when_answers_lose_their_end_of_turn(projects):
    proj = projects["demo"]
    assert "end-of-turn token is not trained" not in cli("validate", str(proj)).stdout   # no cache: no look
    res = cli("prepare", str(proj), "long", "longcot")
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(cli("validate", str(proj), "--json").stdout)
    assert not [p for p in rep["problems"] if "end-of-turn" in p["message"]]       # the demo's chats fit 512 tokens
    conf = proj / "conf" / "exp" / "longcot.yaml"
    conf.write_text(conf.read_text().replace("max_seq_length: 512", "max_seq_length: 128"))
    res = cli("prepare", str(proj), "longcot")
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(cli("validate", str(proj), "--json").stdout)
    warns = [p for p in rep["problems"] if p["severity"] == "warning" and "end-of-turn" in p["message"]]
    assert len(warns) == 1 and warns[0]["file"].endswith("longcot.yaml")            # 128 tokens cut stage 3
    assert re.search(r"\d+ of the first 64 records are chats", warns[0]["message"])
    shown = cli("prepare", str(proj), "longcot", "--show", "1")
    assert shown.returncode == 0 and "no end of turn trained" in shown.stdout
