"""The tiny preset: an ordinary HF folder, a trained target, learnable stage data, built offline,
deterministically, and copied from the cache after the first build."""

import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from longspec.data.encoding import build_dataset
from longspec.tiny import (TINY_VERSION, TinyBuildError, build_tiny, cache_dir,
                           tiny_target_info)
from longspec.measure.prompts import record_prompts
from longspec.data.preview import inspect_record
from longspec.data.synthetic import pretrain_corpus, record_text

ROOT = Path(__file__).resolve().parents[2]
# the tiny preset's long and longcot max_seq_length (the same for both)
STAGE_SEQ = yaml.safe_load((ROOT / "templates" / "presets.yaml").read_text())["tiny"]["stages"]["long"]["max_seq_length"]
# sha256 of json.dumps(pretrain_corpus(random.Random(1), 300, 5)) per TINY_VERSION
CORPUS_SHA256 = {"4": "82fa4189196a5361c80a7a05389102640e0e7dcfabd58e6da0f9e4067d403e40"}

# Runs the CLI with every outgoing connection refused and reported, to prove a build is offline.
OFFLINE = """
import socket, sys
def refuse(*a, **k):
    sys.stderr.write("NETWORK-ATTEMPT %r\\n" % (a,))
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.create_connection = refuse
from longspec.tiny import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-c", OFFLINE, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=900)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_digest(target: Path) -> dict[str, str]:
    return {p.name: sha(p) for p in sorted(target.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Forward passes on a tiny model: one thread is faster than two on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny["target"]).eval()
    return tok, model


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_cli_build_json_offline_from_cache(tiny, tmp_path):
    out = tmp_path / "proj"
    r = run_cli("build", out, "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "NETWORK-ATTEMPT" not in r.stderr
    res = json.loads(r.stdout)
    assert res["cached"] is True  # the module fixture built (or found) the cache entry
    assert res["target"] == str((out / "target").resolve())
    assert res["data"] == {s: str((out / "data" / f"{s}.jsonl").resolve())
                           for s in ("base", "long", "longcot")}
    assert folder_digest(out / "target") == folder_digest(Path(tiny["target"]))
    for stage, path in res["data"].items():
        assert sha(Path(path)) == sha(Path(tiny["data"][stage]))


def test_existing_build_is_refused_unless_forced(tiny, tmp_path):
    out = Path(tiny["target"]).parent
    with pytest.raises(TinyBuildError, match="already exists"):
        build_tiny(out)
    r = run_cli("build", out, "--quiet")
    assert r.returncode == 1 and "already exists" in r.stderr and "Traceback" not in r.stderr
    again = tmp_path / "again"
    assert build_tiny(again)["cached"]
    assert build_tiny(again, force=True, seed=3)["cached"]


def test_unknown_family_is_a_usage_error(tmp_path):
    r = run_cli("build", tmp_path / "x", "--family", "gpt2")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    with pytest.raises(TinyBuildError, match="unknown tiny family"):
        build_tiny(tmp_path / "y", family="gpt2")


def test_folder_is_a_normal_hf_model_dir(tiny):
    from transformers import AutoConfig
    target = Path(tiny["target"])
    assert (target / "model.safetensors").is_file()
    cfg = AutoConfig.from_pretrained(target)
    info = tiny_target_info()
    assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size) == (64, 2, 4, 2, 128)
    assert cfg.max_position_embeddings == info["context_limit"] == 32768
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_id == info["eos_token_id"] and cfg.vocab_size == info["vocab_size"]
    assert json.loads((target / "tiny.json").read_text())["version"] == TINY_VERSION


def test_tokenizer_round_trips_and_matches_its_json(tiny, loaded):
    from tokenizers import Tokenizer
    tok, _ = loaded
    raw = Tokenizer.from_file(str(Path(tiny["target"]) / "tokenizer.json"))
    info = tiny_target_info()
    assert tok.eos_token == info["eos_token"] and tok.eos_token_id == info["eos_token_id"]
    assert tok.pad_token_id == info["pad_token_id"]
    assert 512 <= len(tok) <= info["vocab_size"]  # embedding rows beyond the tokenizer: padding
    texts = [read_jsonl(tiny["data"]["base"])[0]["text"],
             read_jsonl(tiny["data"]["long"])[1]["text"],  # code: newlines and indentation
             "  spaces,\ttabs\nand unicode: naïve café ✓ 日本 12345 ",
             record_text(read_jsonl(tiny["data"]["longcot"])[0])]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        # AutoTokenizer must cut text exactly as the tokenizer the target was trained with
        assert ids == raw.encode(text).ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_start|>")["input_ids"] == [tok.convert_tokens_to_ids("<|im_start|>")]


def test_target_predicts_held_out_synthetic_text(tiny, loaded):
    """The target was trained: its loss on the stage-1 data (not its training corpus) is far
    below uniform guessing, and far below the same architecture untrained."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tok, model = loaded
    ds = build_dataset(tiny["data"]["base"], tok, "short_text", 512)
    batch = [ds[i] for i in range(40)]

    def loss(m):
        with torch.no_grad():
            return sum(m(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss.item()
                       for s in batch) / len(batch)

    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny["target"])).eval()
    trained, uniform = loss(model), math.log(len(tok))  # ln(~650) = 6.5 nats
    assert trained < 0.4 * uniform, (trained, uniform)
    assert trained < loss(fresh) - 3.0


def test_target_continues_cyclic_lists(tiny, loaded):
    """`list : monday tuesday ...`: after the first word the target knows the next ones."""
    tok, model = loaded
    texts = [r["text"] for r in read_jsonl(tiny["data"]["base"])[:100]]
    hits = total = 0
    for text in texts:
        ids = tok(text)["input_ids"]
        toks = tok.convert_ids_to_tokens(ids)
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        start = None  # index of the current "list" token
        for i, t in enumerate(toks):
            if t == "Ġlist" or (i == 0 and t == "list"):
                start = i
            elif t == "Ġ.":
                start = None
            elif start is not None and i >= start + 4:  # "list : w1" seen; predict w2, w3, ...
                total += 1
                hits += pred[i - 1] == ids[i]
    assert total > 100
    assert hits / total > 0.6, (hits, total)  # 25 list words: a guess is right 1 time in 25


def test_stage_data_shapes(tiny, loaded):
    tok, _ = loaded
    base, long, cot = (read_jsonl(tiny["data"][s]) for s in ("base", "long", "longcot"))
    assert 2000 <= len(base) <= 3000 and all(set(r) == {"text"} for r in base)
    lengths = [len(tok(r["text"])["input_ids"]) for r in base[:200]]
    assert 100 <= sum(lengths) / len(lengths) <= 220

    kinds = {r.get("source", "messages") for r in long}
    assert kinds == {"code", "book", "arxiv", "tulu-v2", "messages"}
    assert 120 <= len(long) <= 200 and 120 <= len(cot) <= 200   # 60 demo steps x 2 leave prompts held out
    docs = [r for r in long if r.get("source") in ("book", "code")]
    doc_sizes = [len(tok(r["text"])["input_ids"]) for r in docs]
    assert min(doc_sizes) > 2 * STAGE_SEQ                       # the long-context part of stage 2
    assert 1000 <= sum(doc_sizes) / len(doc_sizes) <= 2500
    chats = [r for r in long if r.get("source") not in ("book", "code")]
    for stage, recs, collator in (("long", chats, "long_data"), ("longcot", cot, "long_cot")):
        # every chat and chain of thought trains whole at the stage's 512 tokens: each answer and
        # its end of turn (at most the trainer's prompt cap shortens a long question)
        for rec in recs:
            whole = inspect_record(rec, tok, collator, 32768)
            at_stage = inspect_record(rec, tok, collator, STAGE_SEQ)
            assert at_stage["end_of_turn_trained"] and at_stage["trained"] == whole["trained"] >= 8, (stage, rec)
        # their questions fill both of eval's buckets at 512 tokens (256 and 512)
        sizes = [len(p.ids) for rec in recs for p in record_prompts(rec, "x", tok, [256, 512], ())]
        assert len(sizes) == len(recs) and max(sizes) <= STAGE_SEQ
        assert sum(n <= 256 for n in sizes) >= len(sizes) // 5 and sum(n > 256 for n in sizes) >= len(sizes) // 5

    assert {tuple(sorted(r)) for r in cot} == {("problem", "qwq"), ("prompt", "response")}
    cot_ds = build_dataset(tiny["data"]["longcot"], tok, "long_cot", STAGE_SEQ)
    trained = [int((cot_ds[i]["labels"] != -100).sum()) for i in range(len(cot_ds))]
    assert min(trained) >= 80 and cot_ds.num_tokens > 20_000  # answers of 90-470 tokens


def test_pretrain_corpus_is_the_targets_own():
    """The stage files' lengths are the demo's; the corpus the target is trained on stays the one
    TINY_VERSION names (a change to it must bump TINY_VERSION and this digest)."""
    corpus = pretrain_corpus(random.Random(1), 300, 5)
    digest = hashlib.sha256(json.dumps(corpus).encode()).hexdigest()
    assert CORPUS_SHA256.get(TINY_VERSION) == digest


def test_seed_changes_data_not_target(tiny, tmp_path):
    other = build_tiny(tmp_path / "s1", seed=1)
    assert folder_digest(Path(other["target"])) == folder_digest(Path(tiny["target"]))
    for stage in ("base", "long", "longcot"):
        assert sha(Path(other["data"][stage])) != sha(Path(tiny["data"][stage]))


@pytest.mark.slow
def test_llama_family_folder(tmp_path):
    """The Llama-family target: same tokenizer (loaded as-is by AutoTokenizer), trained too."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    res = build_tiny(tmp_path / "llama", family="llama")
    target = Path(res["target"])
    cfg = AutoConfig.from_pretrained(target)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.max_position_embeddings,
            cfg.tie_word_embeddings) == (64, 2, 32768, False)
    tok = AutoTokenizer.from_pretrained(target)
    raw = Tokenizer.from_file(str(target / "tokenizer.json"))
    text = read_jsonl(res["data"]["base"])[0]["text"]
    assert tok(text)["input_ids"] == raw.encode(text).ids
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ds = build_dataset(res["data"]["base"], tok, "short_text", 512)
    with torch.no_grad():
        loss = sum(model(input_ids=ds[i]["input_ids"][None], labels=ds[i]["labels"][None]).loss
                   for i in range(20)).item() / 20
    assert loss < 0.4 * math.log(len(tok)), loss


@pytest.mark.slow
def test_fresh_builds_are_deterministic_and_share_one_cache_entry(tiny, tmp_path):
    """Two concurrent offline builds into an empty cache with a damaged entry: one rebuilds it
    under the lock, the other waits and copies; both equal the shared cache's bytes. The cache, the
    lock and the seeded training are the same code for every family, so one family is trained
    afresh here (the llama family's folder is checked in test_llama_family_folder)."""
    family = "qwen2"
    cache = tmp_path / "cache"
    cache.mkdir()
    damaged = cache / f"v{TINY_VERSION}-{family}"
    damaged.mkdir(parents=True)
    (damaged / "config.json").write_text("{}")
    env = {"LONGSPEC_TINY_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", OFFLINE, "build", str(tmp_path / f"o{i}"),
                               "--family", family, "--json"], cwd=ROOT, env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "NETWORK-ATTEMPT" not in err
    assert sorted(json.loads(out)["cached"] for out, _ in outs) == [False, True]
    reference = build_tiny(tmp_path / "ref", family=family)  # from the shared cache
    for i in range(2):
        assert folder_digest(tmp_path / f"o{i}" / "target") == \
            folder_digest(Path(reference["target"]))
        for stage, path in reference["data"].items():
            assert sha(tmp_path / f"o{i}" / "data" / f"{stage}.jsonl") == sha(Path(path))
    assert sorted(p.name for p in cache.iterdir()) == [damaged.name, damaged.name + ".lock"]
    assert cache_dir() != cache  # the test did not touch the shared cache's location


def test_answer_style_other_rewrites_the_answers_only(tmp_path):
    """--answer-style other: the same records with the answers worded otherwise (a second model's
    style), questions untouched, deterministic; the target's corpus is the test above's."""
    from longspec.data.synthetic import OTHER_WORDS, STAGE_DATA
    from longspec.tiny import write_data

    def answers(rec):
        turns = rec.get("conversation") or rec.get("messages") or []
        return [rec.get(k) for k in ("text", "abstract", "qwq", "response")] + \
            [m["content"] for m in turns if m["role"] == "assistant"]

    def questions(rec):
        turns = rec.get("conversation") or rec.get("messages") or []
        return [rec.get(k) for k in ("prompt", "problem", "article", "source")] + \
            [m for m in turns if m["role"] != "assistant"]

    for stage, (make, n, lengths) in STAGE_DATA.items():
        n = min(n, 20)
        mine = make(random.Random(f"s-{stage}"), n, **lengths)
        other = make(random.Random(f"s-{stage}"), n, **lengths, answer_style="other")
        assert other == make(random.Random(f"s-{stage}"), n, **lengths, answer_style="other")
        assert len(mine) == len(other) and [sorted(r) for r in mine] == [sorted(r) for r in other]
        for a, b in zip(mine, other):
            assert questions(a) == questions(b)
            changed = [(x, y) for x, y in zip(answers(a), answers(b)) if x != y]
            if a.get("source") != "code":                 # code has none of OTHER_WORDS
                assert changed, (stage, a)
            for x, y in changed:
                assert len(x.split()) == len(y.split()) and " . " not in f" {y} "
    paths = write_data(tmp_path / "d", 0, "other")
    first = json.loads(Path(paths["longcot"]).read_text().splitlines()[1])
    assert first["response"].endswith(" result equals " + first["response"].split()[-2] + " !")
    assert set(OTHER_WORDS) >= {"the", "is", "."}
    with pytest.raises(ValueError):
        make(random.Random(0), 1, answer_style="nope")


def test_cli_answer_style_other_keeps_the_target(tiny, tmp_path):
    out = tmp_path / "other"
    r = run_cli("build", out, "--answer-style", "other", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["answer_style"] == "other" and res["cached"] is True
    assert folder_digest(out / "target") == folder_digest(Path(tiny["target"]))
    mine = [json.loads(x) for x in Path(tiny["data"]["longcot"]).read_text().splitlines()]
    other = [json.loads(x) for x in Path(res["data"]["longcot"]).read_text().splitlines()]
    assert [r.get("prompt", r.get("problem")) for r in mine] == [r.get("prompt", r.get("problem")) for r in other]
    assert all(a.get("response", a.get("qwq")) != b.get("response", b.get("qwq")) for a, b in zip(mine, other))
    assert run_cli("build", tmp_path / "x", "--answer-style", "nope").returncode == 2
