"""Evaluation prompts with the real tiny tokenizer (longspec.tiny: its chat template, its vocabulary):
chat questions, document prefixes, length buckets, LongBench / AIME files."""
from __future__ import annotations

import json

import pytest

from longspec.measure import benchfiles, report, prompts as P
from tests.hubfiles import write_aime_parquet, write_parquet_shards, zip_longbench


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from longspec.tiny import cached_target

    path, _ = cached_target("qwen2")
    return AutoTokenizer.from_pretrained(str(path))


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_a_chat_records_prompt_ends_with_the_generation_header_and_holds_nothing_of_its_answer(tok):
    answer = "the quiet fox follows the red boat under the moon ."
    msgs = [{"role": "system", "content": "you are a helpful assistant ."},
            {"role": "user", "content": "remember : the age of ada is 12 ."},
            {"role": "assistant", "content": "ok , the age of ada is 12 ."},
            {"role": "user", "content": "tell me a story ."},
            {"role": "assistant", "content": answer}]
    stops = P.end_of_turn_ids(tok)
    [p] = P.record_prompts({"messages": msgs}, "long.jsonl:3", tok, [64, 512], stops)
    want = tok(tok.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert p.ids == want and p.kind == "chat" and p.record == "long.jsonl:3"
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert p.ids[-len(header):] == header                                  # ends with the generation header
    assert tok.decode(p.ids).endswith("<|im_start|>user\ntell me a story .<|im_end|>\n<|im_start|>assistant\n")
    assert not _contains(p.ids, tok(answer, add_special_tokens=False)["input_ids"])
    assert not _contains(p.ids, tok(" fox follows", add_special_tokens=False)["input_ids"])
    assert answer not in tok.decode(p.ids)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert p.stops == stops and set(stops) == {tok.eos_token_id, im_end}  # a server stops at the end of turn


def test_a_chain_of_thought_record_gives_its_problem_alone(tok):
    rec = {"problem": "add the numbers 3 , 4 .", "qwq": "let me think step by step . 3 plus 4 is 7 ."}
    [p] = P.record_prompts(rec, "cot.jsonl:1", tok, [512], P.end_of_turn_ids(tok))
    assert p.kind == "cot"
    assert tok.decode(p.ids) == "<|im_start|>user\nadd the numbers 3 , 4 .<|im_end|>\n<|im_start|>assistant\n"
    P.limit_new_tokens([p], None, 4096)
    assert p.max_new == 200                                                # upstream's AIME figure
    P.limit_new_tokens([p], None, 512)
    assert p.max_new == 64                                                 # an eighth of the stage's length


def test_a_document_prompt_in_bucket_L_has_L_tokens(tok):
    text = " ".join(f"the cat sees the dog near the river . {i}" for i in range(200))
    ids = tok(text)["input_ids"]
    lengths = [64, 256, 1024, 4096]
    assert 1024 < len(ids) < 4096
    prompts = P.record_prompts({"text": text}, "doc.jsonl:1", tok, lengths, ())
    assert [len(p.ids) for p in prompts] == [64, 256, 1024]               # none at 4096: the document is shorter
    for p in prompts:
        L = report.bucket_of(len(p.ids), lengths)
        assert L == len(p.ids) and p.ids == ids[:L] and p.kind == "document"
    P.limit_new_tokens(prompts, None, 32768)
    assert {p.max_new for p in prompts} == {1024}                         # upstream's LongBench figure


def test_length_buckets():
    assert report.parse_lengths("1k,4k, 16k,32768") == [1024, 4096, 16384, 32768]
    for bad in ("1k,x", "0", "-4k", ""):
        with pytest.raises(ValueError):
            report.parse_lengths(bad)
    assert report.default_lengths(32768) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert report.default_lengths(3000) == [1024, 2048, 3000]
    assert report.default_lengths(512) == [256, 512]                  # two buckets at least
    assert report.default_lengths(128) == [64, 128]
    assert [report.bucket_of(n, [256, 512]) for n in (1, 256, 257, 512, 513)] == [256, 256, 512, 512, None]
    assert report.result_name(prompts=None, bench=None, nondefault=[]) == "eval.json"
    assert report.result_name(prompts=None, bench="longbench:/x/y", nondefault=[]) == "eval-longbench.json"
    assert report.result_name(prompts="/a/my p.jsonl", bench=None, nondefault=["gamma2"]) == \
        "eval-prompts-my-p-gamma2.json"


def write_longbench(folder, tasks=("gov_report", "qmsum", "lcc"), n=2, words=40):
    """LongBench-format files (one JSON object per line, LongBench's fields) in the tiny vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        lines = []
        for i in range(n):
            ctx = (" ".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(words // 8)) if task == "lcc"
                   else " ".join(["the red fox sees the old house near the river ."] * (words // 10)))
            lines.append(json.dumps({"input": "what does the fox see ?" if task == "qmsum" else "",
                                     "context": ctx, "answers": ["the house ."], "length": len(ctx.split()),
                                     "dataset": task, "language": "en", "all_classes": None,
                                     "_id": f"{task}-{i}"}))
        (folder / f"{task}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_longbench_files_become_task_prompts_in_the_target_chat_template(tok, tmp_path):
    folder = write_longbench(tmp_path / "lb")
    prompts, info = benchfiles.longbench_prompts(folder, tok, min_tokens=0, max_tokens=100_000, n=None)
    assert info["tasks"] == {"gov_report": 2, "qmsum": 2, "lcc": 2} and len(prompts) == 6
    by_task = {p.task: p for p in reversed(prompts)}                     # the first of each task
    gov = tok.decode(by_task["gov_report"].ids)
    assert gov.startswith("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n"
                          "You are given a report by a government agency.")
    assert gov.endswith("<|im_start|>assistant\nSummary:")
    assert "Query: what does the fox see ?<|im_end|>" in tok.decode(by_task["qmsum"].ids)
    assert by_task["lcc"].record == "lcc:lcc-0" and by_task["lcc"].kind == "longbench"
    lo = len(by_task["gov_report"].ids)
    kept, info = benchfiles.longbench_prompts(folder, tok, min_tokens=lo, max_tokens=100_000, n=1)
    assert all(len(p.ids) > lo for p in kept) and info["left_out_by_length"] >= 1
    assert all(n <= 1 for n in info["tasks"].values())


def test_malformed_bench_files_name_file_and_line(tok, tmp_path):
    folder = write_longbench(tmp_path / "lb", tasks=("multi_news",))
    path = folder / "multi_news.jsonl"
    path.write_text(path.read_text() + json.dumps({"input": "", "answers": []}) + "\n")
    with pytest.raises(P.PromptError) as e:
        benchfiles.longbench_prompts(folder, tok, min_tokens=0, max_tokens=100_000, n=None)
    assert e.value.code == 3 and e.value.message.startswith(f"{path}:3: field 'context'")
    path.write_text("{not json\n")
    with pytest.raises(P.PromptError) as e:
        benchfiles.longbench_prompts(folder, tok, min_tokens=0, max_tokens=100_000, n=None)
    assert e.value.code == 3 and e.value.message.startswith(f"{path}:1: not valid JSON")
    with pytest.raises(P.PromptError) as e:
        benchfiles.longbench_prompts(tmp_path / "nowhere", tok, min_tokens=0, max_tokens=1, n=None)
    assert e.value.code == 2 and "THUDM/LongBench" in e.value.hint           # nothing is downloaded
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"problem": "add 3 and 4 ."}) + "\n" + json.dumps({"question": "add 5 and 6 ."})
                    + "\n\n" + json.dumps({"answer": 7}) + "\n")
    with pytest.raises(P.PromptError) as e:
        benchfiles.aime_prompts(aime, tok, n=None)
    assert e.value.code == 3 and e.value.message.startswith(f"{aime}:4: needs a string 'problem' or 'question'")
    aime.write_text("\n".join(aime.read_text().splitlines()[:3]) + "\n")   # a malformed line anywhere fails
    prompts, info = benchfiles.aime_prompts(aime, tok, n=2)
    assert [p.task for p in prompts] == ["aime", "aime"] and info["tasks"] == {"aime": 2}
    assert tok.decode(prompts[1].ids).endswith("<|im_start|>user\nadd 5 and 6 .<|im_end|>\n<|im_start|>assistant\n")


def test_downloaded_bench_files_read_as_they_are(tok, tmp_path):
    folder = write_longbench(tmp_path / "lb")
    zipped = zip_longbench(folder, tmp_path / "data.zip")
    want, info = benchfiles.longbench_prompts(folder, tok, min_tokens=0, max_tokens=100_000, n=None)
    got, zinfo = benchfiles.longbench_prompts(zipped, tok, min_tokens=0, max_tokens=100_000, n=None)
    assert [(p.ids, p.record, p.task) for p in got] == [(p.ids, p.record, p.task) for p in want]
    assert zinfo["tasks"] == info["tasks"] and zinfo["prompt_source"] == str(zipped)
    (folder / "qmsum.jsonl").write_text('{"context": "the fox .", "input": 3}\n')
    with pytest.raises(P.PromptError) as e:
        benchfiles.longbench_prompts(zip_longbench(folder, tmp_path / "bad.zip"), tok, min_tokens=0,
                                     max_tokens=100_000, n=None)
    assert e.value.code == 3 and e.value.message.startswith(f"{tmp_path / 'bad.zip'}:data/qmsum.jsonl:1: field 'input'")

    problems = ["add 3 and 4 .", "add 5 and 6 ."]
    pq_file = write_aime_parquet(tmp_path / "aime.parquet", problems)
    jsonl = tmp_path / "aime.jsonl"
    jsonl.write_text("".join(json.dumps({"problem": t}) + "\n" for t in problems))
    prompts, info = benchfiles.aime_prompts(pq_file, tok, n=None)
    plain, _ = benchfiles.aime_prompts(jsonl, tok, n=None)
    assert [p.ids for p in prompts] == [p.ids for p in plain] and [p.record for p in prompts] == ["aime:60", "aime:61"]
    write_aime_parquet(tmp_path / "nulls.parquet", ["add 1 and 1 .", None])
    with pytest.raises(P.PromptError) as e:
        benchfiles.aime_prompts(tmp_path / "nulls.parquet", tok, n=None)
    assert e.value.code == 3 and e.value.message.startswith(f"{tmp_path / 'nulls.parquet'}:row 1: needs a string 'problem'")


def test_stage_prompts_from_parquet_name_file_and_row(tok, tmp_path):
    recs = [{"problem": f"add {i} and {i + 1} .", "qwq": f"it is {2 * i + 1} ."} for i in range(6)]
    path, = write_parquet_shards(recs, tmp_path, shards=1, row_group=4)
    jsonl = tmp_path / "cot.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    conf = {"data": {"collator": "long_cot", "on_bad_record": "error"}}
    got, info = P.stage_prompts(path, tok, conf, None, lengths=[64, 128], per_length={64: 3, 128: 3})
    want, _ = P.stage_prompts(jsonl, tok, conf, None, lengths=[64, 128], per_length={64: 3, 128: 3})
    assert [p.ids for p in got] == [p.ids for p in want] and info["records"] == 6
    assert [p.record for p in got] == [f"{path.name}:row {i}" for i in (3, 4, 5)]


def test_decoding_stops_at_the_end_of_turn_or_the_eos():
    from longspec.decode.chain import _finish

    assert _finish([5, 2, 7], 10, (0, 2)) == ([5, 2], True)       # the end-of-turn token, kept
    assert _finish([5, 0, 2], 10, (0, 2)) == ([5, 0], True)       # the EOS
    assert _finish([5, 6], 10, (0, 2)) == ([5, 6], False)
    assert _finish([5, 6, 7], 2, 0) == ([5, 6], True)             # one id, as before
    assert _finish([5, 0], 10, None) == ([5, 0], False)


def test_evaluate_refuses_a_bucket_the_device_cannot_hold_before_any_weight_loads(tmp_path, monkeypatch, capsys):
    """longspec.evaluate's own check (the CLI's is tests/cli/test_eval_memory.py): the target folder
    has a config.json and no weights, so a refusal after loading would read differently."""
    import json

    from longspec import evaluate
    from longspec.machine import evalmemory

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_config.yaml").write_text(f"stage: long\nmodel_name_or_path: {target}\nprecision: bf16\n"
                                              "data:\n  max_seq_length: 131072\n")
    (run / "draft.pth").write_bytes(b"x")
    monkeypatch.setattr(evalmemory, "cpu_available", lambda: 64 * 1024 ** 3)
    code = evaluate.main([str(run), "--draft", str(run / "draft.pth"), "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and out["error"].startswith("the 128k length bucket needs about")
    assert "64.0 GiB is available" in out["error"] and out["hint"].startswith("--lengths 1k,2k,4k,8k,16k,32k ")
