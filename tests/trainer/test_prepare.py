"""Prepared data: the memory-mapped cache gives the in-memory path's batches; it is rebuilt when its
source or its bytes change; an interrupted build leaves nothing that looks whole; concurrent
processes tokenize once. Real tokenizer (the tiny preset's), real files, real processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longspec.data import encoding, records
from longspec.data import cache
from longspec.formats import prepared as P

REPO = Path(__file__).resolve().parents[2]
STAGES = {"base": ("short_text", 96), "long": ("long_data", 128), "longcot": ("long_cot", 128)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from longspec.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


@pytest.fixture(scope="module")
def tok(tiny):
    return encoding.load_tokenizer(str(tiny["target"]))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / "cache"))


def opts(collator: str, seq: int, **kw) -> dict:
    return {"collator": collator, "max_seq_length": seq, "on_bad_record": "error", **kw}


def batches(ds, rank: int, world: int, skip: int, epoch: int):
    loader = encoding.make_loader(ds, batch_size=3, seed=7, rank=rank, world_size=world, pad_token_id=0,
                              skip_batches=skip, epoch=epoch)
    return list(loader)


@pytest.mark.parametrize("stage", list(STAGES))
def test_prepared_cache_gives_the_in_memory_batches_resume_skips_included(stage, tiny, tok):
    collator, seq = STAGES[stage]
    path = Path(tiny["data"][stage])
    mem = encoding.build_dataset(path, tok, collator, seq)
    ds, man, built = cache.ensure(path, str(tiny["target"]), opts(collator, seq), tokenizer=tok,
                                    progress=False)
    assert built and len(ds) == len(mem) == man["records"]
    assert man["tokens"] == mem.num_tokens and man["trained_tokens"] == mem.num_label_tokens
    for rank, world, skip, epoch in ((0, 1, 0, 0), (1, 2, 2, 1)):
        got, want = batches(ds, rank, world, skip, epoch), batches(mem, rank, world, skip, epoch)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            for k in ("input_ids", "labels", "attention_mask"):
                assert torch.equal(g[k], w[k]), (stage, k)
    again, _, built = cache.ensure(path, str(tiny["target"]), opts(collator, seq), tokenizer=tok)
    assert not built and again.folder == ds.folder                  # a restart does not re-tokenize


def test_workers_give_the_same_cache_as_one_process(tiny, tok):
    path = Path(tiny["data"]["longcot"])
    one = cache.ensure(path, str(tiny["target"]), opts("long_cot", 128), tokenizer=tok, progress=False)[1]
    os.environ["LONGSPEC_CACHE_DIR"] += "-workers"
    two = cache.ensure(path, str(tiny["target"]), opts("long_cot", 128), workers=2, progress=False)[1]
    assert [one["files"][n]["sha256"] for n in sorted(one["files"])] == \
        [two["files"][n]["sha256"] for n in sorted(two["files"])]


def test_changed_source_and_damaged_cache_are_rebuilt_never_used(tiny, tok, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text(Path(tiny["data"]["base"]).read_text().splitlines()[0] + "\n" +
                   Path(tiny["data"]["base"]).read_text().splitlines()[1] + "\n")
    o = opts("short_text", 96)
    ds, man, built = cache.ensure(src, str(tiny["target"]), o, tokenizer=tok, progress=False)
    assert built and man["records"] == 2
    fields = P.key_fields(src, tiny["target"], o)

    with src.open("a") as f:                                          # the train file changes
        f.write(json.dumps({"text": "one more record for the stale check"}) + "\n")
    with pytest.raises(P.CacheProblem, match="stale"):
        P.check(ds.folder, fields, encoding.COLLATOR_VERSION)
    ds, man, built = cache.ensure(src, str(tiny["target"]), o, tokenizer=tok, progress=False)
    assert built and man["records"] == 3

    tokens = ds.folder / f"{man['build']}.tokens.bin"                 # its bytes are truncated
    with tokens.open("r+b") as f:
        f.truncate(tokens.stat().st_size - 2)
    with pytest.raises(P.CacheProblem, match="corrupt"):
        P.check(ds.folder, fields, encoding.COLLATOR_VERSION)
    ds, man, built = cache.ensure(src, str(tiny["target"]), o, tokenizer=tok, progress=False)
    assert built and len(ds) == 3

    mask = ds.folder / f"{man['build']}.mask.bin"                     # same length, other bytes
    raw = bytearray(mask.read_bytes())
    raw[0] ^= 1
    mask.write_bytes(bytes(raw))
    with pytest.raises(P.CacheProblem, match="checksum"):
        P.check(ds.folder, fields, encoding.COLLATOR_VERSION)
    assert cache.ensure(src, str(tiny["target"]), o, tokenizer=tok, progress=False)[2]


def test_bad_record_names_file_and_line_in_error_and_skip_mode(tiny, tok, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"nope": 1}\n{"text": "also fine"}\n')
    with pytest.raises(encoding.DataError, match=r"bad\.jsonl:2: missing field 'text'"):
        cache.ensure(src, str(tiny["target"]), opts("short_text", 64), tokenizer=tok, progress=False)
    assert not list((tmp_path / "cache" / "prepared").glob("*/manifest.json"))
    ds, man, _ = cache.ensure(src, str(tiny["target"]), opts("short_text", 64, on_bad_record="skip"),
                                tokenizer=tok, progress=False)
    assert len(ds) == 2 and man["skipped"] == 1 and "bad.jsonl:2" in man["problems"][0]


def test_untrainable_records_are_skipped_and_counted_and_too_many_refuse_the_stage(tiny, tok, tmp_path):
    """A record with nothing to train (an empty answer) is no malformed record: on_bad_record: error
    still trains the rest, counting it; above data.max_untrainable_share the stage is refused."""
    docs = Path(tiny["data"]["base"]).read_text().splitlines()[:40]
    src = tmp_path / "few.jsonl"
    src.write_text("\n".join(docs[:3] + ['{"text": ""}'] + docs[3:9] + ['{"text": ""}'] + docs[9:]) + "\n")
    ds, man, built = cache.ensure(src, str(tiny["target"]), opts("short_text", 96), tokenizer=tok, progress=False)
    assert built and len(ds) == man["records"] == 40 and man["untrainable"] == 2 and man["skipped"] == 0
    assert man["untrainable_problems"] == [f"{src}:{n}: no trained tokens within max_seq_length=96 (collator short_text)"
                                           for n in (4, 11)]
    r = P.result_of(man, {"stage": "base", "data": {}}, 1, ds.folder, True, 0.1)
    assert r["untrainable"] == 2 and r["untrainable_share"] == round(2 / 42, 6) and r["max_untrainable_share"] == 0.05
    text = "\n".join(P.result_text(r))
    assert "untrainable records (nothing to train within max_seq_length) 2" in text
    assert f"untrainable, skipped: {src}:4: no trained tokens" in text
    # the same cache under a lower limit: refused with the figures, without tokenizing again
    with pytest.raises(cache.UntrainableRefused, match=r"2 of 42 records \(4\.76%\) train no token within "
                       r"max_seq_length=96 \(collator short_text\), more than data\.max_untrainable_share=0\.01"):
        cache.ensure(src, str(tiny["target"]), opts("short_text", 96, max_untrainable_share=0.01), progress=False)
    # many: a third of the records train nothing; refused, no cache left; malformed ones still follow on_bad_record
    many = tmp_path / "many.jsonl"
    many.write_text("".join(doc + "\n" + '{"text": ""}\n' * (i % 2) for i, doc in enumerate(docs[:20])))
    n_empty = 10
    with pytest.raises(cache.UntrainableRefused, match=rf"{many}: 10 of 30 records \(33\.33%\) train no token"):
        cache.ensure(many, str(tiny["target"]), opts("short_text", 96), tokenizer=tok, progress=False)
    fields = P.key_fields(many, tiny["target"], opts("short_text", 96))
    assert P.read_manifest(P.cache_dir(fields)) is None
    with many.open("a") as f:
        f.write('{"txet": "misspelt"}\n')
    with pytest.raises(encoding.DataError, match=r"many\.jsonl:\d+: missing field 'text'"):
        cache.ensure(many, str(tiny["target"]), opts("short_text", 96, max_untrainable_share=1.0), tokenizer=tok,
                     progress=False)
    ds, man, _ = cache.ensure(many, str(tiny["target"]), opts("short_text", 96, on_bad_record="skip",
                                                              max_untrainable_share=0.5), tokenizer=tok, progress=False)
    assert (len(ds), man["untrainable"], man["skipped"]) == (20, n_empty, 1)


def records_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def data_sha(man: dict) -> list[str]:
    return [man["files"][n]["sha256"] for n in sorted(man["files"])]


def test_hub_layouts_give_the_jsonl_cache_and_every_shard_is_in_its_key(tiny, tok, tmp_path):
    from tests.hubfiles import write_parquet_shards, write_saved_dataset

    target = str(tiny["target"])
    slim = [dict(r, meta={"redpajama_set_name": "RedPajamaC4"}) for r in records_of(tiny["data"]["base"])[:600]]
    plain = tmp_path / "slim.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in slim))
    shards = write_parquet_shards(slim, tmp_path / "SlimPajama" / "data", shards=2, row_group=128)
    write_parquet_shards(slim[:5], tmp_path / "SlimPajama" / "data", shards=1, split="test")
    saved = write_saved_dataset(records_of(tiny["data"]["long"]), tmp_path / "long_saved")
    qwq = write_parquet_shards(records_of(tiny["data"]["longcot"]), tmp_path / "qwq", shards=1)[0]
    for src, ref, (collator, seq) in ((tmp_path / "SlimPajama" / "data" / "train-*.parquet", plain, STAGES["base"]),
                                      (saved, tiny["data"]["long"], STAGES["long"]),
                                      (qwq, tiny["data"]["longcot"], STAGES["longcot"])):
        want = cache.ensure(ref, target, opts(collator, seq), tokenizer=tok, progress=False)[1]
        ds, got, built = cache.ensure(src, target, opts(collator, seq), tokenizer=tok, progress=False)
        assert built and got["records"] == want["records"] and data_sha(got) == data_sha(want), src
        where = "first_no_end_of_turn"                      # where the record is: a line, or SHARD:row N
        assert {**got["chat_check"], where: None} == {**want["chat_check"], where: None}
        assert (got["chat_check"][where] is None) == (want["chat_check"][where] is None)
    assert [f["path"] for f in got["source"]["files"]] == [str(qwq)]

    glob = str(tmp_path / "SlimPajama" / "data" / "train-*.parquet")
    fields = P.key_fields(glob, target, opts(*STAGES["base"]))
    folder = P.cache_dir(fields)
    assert "*" not in folder.name and P.check(folder, fields, encoding.COLLATOR_VERSION)["records"] == 600
    with pytest.raises(encoding.DataError, match="splits test, train"):      # the folder holds two splits
        list(encoding.read_records(tmp_path / "SlimPajama" / "data"))
    os.utime(shards[0])                                                 # touched, same bytes: still ready
    assert P.check(folder, fields, encoding.COLLATOR_VERSION)
    extra = write_parquet_shards(slim[:3], tmp_path / "extra", shards=1)[0]
    extra.rename(shards[0].parent / "train-00002-of-00002.parquet")     # a shard more
    with pytest.raises(P.CacheProblem, match=r"stale: the files of train-\*\.parquet changed .*added train-00002"):
        P.check(folder, fields, encoding.COLLATOR_VERSION)
    (shards[0].parent / "train-00002-of-00002.parquet").unlink()
    write_parquet_shards(slim[:300] + [{"text": "x"}] + slim[301:], shards[0].parent, shards=2, row_group=128)  # shard 0 rewritten alike
    with pytest.raises(P.CacheProblem, match="stale: train-00001-of-00002.parquet changed"):
        P.check(folder, fields, encoding.COLLATOR_VERSION)


def test_bad_rows_of_a_table_are_named_by_file_and_row(tiny, tok, tmp_path):
    from tests.hubfiles import write_parquet_shards

    recs = [{"problem": "add 1 and 2 .", "qwq": "it is 3 ."}, {"problem": "add 2 and 2 ."},
            {"problem": "add 3 and 2 .", "qwq": "it is 5 ."}]
    path = write_parquet_shards(recs, tmp_path / "cot", shards=1)[0]
    with pytest.raises(encoding.DataError, match=rf"{path}:row 1: missing field 'qwq' \(collator long_cot\)"):
        cache.ensure(path.parent, str(tiny["target"]), opts("long_cot", 64), tokenizer=tok, progress=False)
    ds, man, _ = cache.ensure(path.parent, str(tiny["target"]), opts("long_cot", 64, on_bad_record="skip"),
                                tokenizer=tok, progress=False)
    assert len(ds) == 2 and man["skipped"] == 1 and man["problems"][0].startswith(f"{path}:row 1:")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(path.read_bytes()[:-30])                           # copied halfway
    with pytest.raises(encoding.DataError, match="not a complete parquet file"):
        list(encoding.read_records(cut))


def big_jsonl(path: Path, mb: int) -> Path:
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 40}) + "\n"
    with path.open("w") as f:
        f.write(line * (mb * (1 << 20) // len(line)))
    return path


def write_stage(root: Path, tiny: dict, train_file: Path) -> Path:
    (root / "conf" / "exp").mkdir(parents=True, exist_ok=True)
    (root / "conf" / "exp" / "s.yaml").write_text(
        f"# @package _global_\nstage: base\nmodel_name_or_path: {tiny['target']}\n"
        f"train_file: {train_file}\noutput_dir: {root / 'run'}\nprecision: fp32\n"
        "data: {collator: short_text, max_seq_length: 256}\n")
    return root / "conf"


def prepare_cmd(conf: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "longspec.prepare", "--config-dir", str(conf), "+exp=s", "--json", *extra]


def env(tmp_path: Path, **kw) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), LONGSPEC_CACHE_DIR=str(tmp_path / "cache"),
                TOKENIZERS_PARALLELISM="false", **kw)


def test_kill_9_during_prepare_leaves_no_half_cache(tiny, tmp_path):
    src = big_jsonl(tmp_path / "big.jsonl", 24)
    conf = write_stage(tmp_path, tiny, src)
    proc = subprocess.Popen(prepare_cmd(conf), env=env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    root = tmp_path / "cache" / "prepared"
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.stat().st_size > 0 for p in root.glob("*/.*.tmp")):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = next(root.iterdir())
    assert not (folder / P.MANIFEST).exists()
    fields = P.key_fields(src, tiny["target"], opts("short_text", 256))
    with pytest.raises(P.CacheProblem, match="not prepared"):
        P.check(folder, fields)
    ok = subprocess.run(prepare_cmd(conf), env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    result = json.loads(ok.stdout.strip().splitlines()[-1])
    assert result["built"] and P.check(folder, fields)["records"] == result["records"]
    assert not list(folder.glob(".*.tmp"))                            # the killed build's leftovers are gone


def test_two_ranks_on_a_missing_cache_tokenize_once(tiny, tmp_path):
    src = big_jsonl(tmp_path / "mid.jsonl", 4)
    conf = write_stage(tmp_path, tiny, src)
    procs = [subprocess.Popen(prepare_cmd(conf), env=env(tmp_path, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert sorted(r["built"] for r in results) == [False, True]
    assert results[0]["cache"] == results[1]["cache"] and results[0]["tokens"] == results[1]["tokens"]
    assert sum("tokenizing" in o[1] for o in outs) == 1


def test_json_array_read_in_small_chunks_gives_the_whole_read_records(tmp_path, monkeypatch):
    recs = [{"text": f"record {i} " + "x" * (i % 37), "n": 10 ** (i % 9)} for i in range(300)]
    path = tmp_path / "a.json"
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in recs) + "\n]\n")
    whole = list(encoding.read_records(path))
    monkeypatch.setattr(records, "ARRAY_CHUNK", 5)            # every record spans several chunks
    assert list(encoding.read_records(path)) == whole and [r for _, r in whole] == recs
    path.write_text('[{"text": "a"},\n{"text": "b"}\n{"text": "c"}]')
    with pytest.raises(encoding.DataError, match=r"a\.json:3: expected ',' or ']'"):
        list(encoding.read_records(path))


def test_a_full_disk_mid_build_leaves_no_cache_and_says_so(tiny, tok, tmp_path, monkeypatch):
    import errno

    src = big_jsonl(tmp_path / "d.jsonl", 1)
    real = cache._Writer._put
    calls = {"n": 0}

    def put(self, kind, arr):                      # the disk fills up after a few records
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, kind, arr)

    monkeypatch.setattr(cache._Writer, "_put", put)
    with pytest.raises(cache.CacheWriteError, match="No space left on device"):
        cache.ensure(src, str(tiny["target"]), opts("short_text", 256), tokenizer=tok, progress=False)
    folder = next((tmp_path / "cache" / "prepared").iterdir())
    assert list(folder.iterdir()) == []                # no manifest, no temp files
    monkeypatch.setattr(cache._Writer, "_put", real)
    assert cache.ensure(src, str(tiny["target"]), opts("short_text", 256), tokenizer=tok, progress=False)[2]


def test_a_cache_from_an_older_collator_version_is_stale_and_rebuilt(tiny, tok):
    """status reads the collator version from longspec.data.encoding's source, by module name (the
    CLI never imports the trainer): when the module moves, the version must still be found, or an
    older cache would pass as ready."""
    from longspec.files.atomic import atomic_write_json
    from longspec.formats.prepared import collator_version, stage_prepared

    assert collator_version() == encoding.COLLATOR_VERSION
    path = Path(tiny["data"]["base"])
    conf = {"train_file": str(path), "model_name_or_path": str(tiny["target"]), "data": opts("short_text", 96)}
    ds, man, built = cache.ensure(path, str(tiny["target"]), opts("short_text", 96), tokenizer=tok, progress=False)
    assert built and stage_prepared(conf, REPO).state == "ready"
    atomic_write_json(ds.folder / "manifest.json", {**man, "collator_version": encoding.COLLATOR_VERSION - 1})
    st = stage_prepared(conf, REPO)
    assert (st.state, st.reason) == ("stale", "stale: prepared by another version of the collators")
    again, man2, built = cache.ensure(path, str(tiny["target"]), opts("short_text", 96), tokenizer=tok, progress=False)
    assert built and man2["collator_version"] == encoding.COLLATOR_VERSION
    assert stage_prepared(conf, REPO).state == "ready"
