"""longspec.data.encoding with the real tiny tokenizer: labels per record kind, truncation, EOS, bad input,
JSON arrays, padding and the sharded loader."""

import json

import pytest
import torch

from longspec.data.encoding import (DataError, build_dataset, collate, encode_record, make_loader,
                           read_records)
from longspec.tiny import build_tiny

IGNORE = -100


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny["target"])


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def one(tmp_path, tok, rec, collator, max_len=4096):
    ds = build_dataset(write_jsonl(tmp_path / "d.jsonl", [rec]), tok, collator, max_len)
    s = ds[0]
    return s["input_ids"].tolist(), s["labels"].tolist()


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def chat(tok, msgs, gen=False):
    return ids_of(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))


# ---------------------------------------------------------------- short_text

def test_short_text_labels_every_token_and_the_document_end_though_it_is_the_pad(tmp_path, tok):
    text = "the red cat sees the dog . count from 3 : 3 4 5 ."
    ids, labels = one(tmp_path, tok, {"text": text}, "short_text")
    assert tok.pad_token_id == tok.eos_token_id            # Qwen-style: <|endoftext|> is both
    assert ids == ids_of(tok, text) + [tok.eos_token_id]
    assert labels == ids                                    # by position: the document end is trained


def test_short_text_reads_upstream_target_field(tmp_path, tok):
    ids, _ = one(tmp_path, tok, {"target": "the old king ."}, "short_text")
    assert ids == ids_of(tok, "the old king .") + [tok.eos_token_id]


def test_truncation_cuts_to_max_seq_length(tmp_path, tok):
    text = " ".join(str(i) for i in range(100))
    ids, labels = one(tmp_path, tok, {"text": text}, "short_text", max_len=7)
    assert ids == ids_of(tok, text)[:7] and labels == ids  # EOS cut off, all trained


# ---------------------------------------------------------------- long_data

def test_long_data_code_and_book_are_plain_text_without_eos(tmp_path, tok):
    code = "def f0(x):\n    return x + 3\n"
    ids, labels = one(tmp_path, tok, {"source": "code", "text": code}, "long_data")
    assert ids == ids_of(tok, code)                          # no EOS, as upstream's stage 2
    assert labels == ids
    ids2, _ = one(tmp_path, tok, {"source": "book", "text": code}, "long_data")
    assert ids2 == ids


def trained_text(tok, ids, labels):
    return tok.decode([t for t, l in zip(ids, labels) if l != IGNORE])


def test_long_data_arxiv_uses_upstreams_instruction_and_trains_the_summary(tmp_path, tok):
    rec = {"source": "arxiv", "article": "fact : the age of ada is 10 .", "abstract": "ada is 10 ."}
    ids, labels = one(tmp_path, tok, rec, "long_data")
    msgs = [{"role": "user", "content": "Please summarize the following article: fact : the age of ada is 10 ."},
            {"role": "assistant", "content": "ada is 10 ."}]
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    head = chat(tok, msgs[:1], gen=True)
    assert ids[:len(head)] == head and labels[:len(head)] == [IGNORE] * len(head)
    assert trained_text(tok, ids, labels) == "ada is 10 .<|im_end|>\n"   # answer + end of turn


def test_long_data_arxiv_lists_become_turn_pairs(tmp_path, tok):
    rec = {"source": "arxiv", "article": ["a one .", "a two ."], "abstract": ["s one .", "s two ."]}
    ids, labels = one(tmp_path, tok, rec, "long_data")
    text = tok.decode(ids)
    assert text.count("<|im_start|>assistant\n") == 2
    assert text.index("s one .") < text.index("a two .") < text.index("s two .")
    assert trained_text(tok, ids, labels) == "s one .<|im_end|>\ns two .<|im_end|>\n"


def test_long_data_tulu_and_messages_chats_train_each_answer(tmp_path, tok):
    conv = [{"role": "system", "content": "you are a helpful assistant ."},
            {"role": "user", "content": "count from 3 to 5 ."},
            {"role": "assistant", "content": "3 4 5 ."},
            {"role": "user", "content": "and from 7 ?"},
            {"role": "assistant", "content": "7 8 9 ."}]
    expect = chat(tok, conv)
    for rec in ({"source": "tulu-v2", "conversation": conv}, {"messages": conv},
                {"messages": [{"from": t["role"].replace("user", "human").replace("assistant", "gpt"),
                               "value": t["content"]} for t in conv]}):
        ids, labels = one(tmp_path, tok, rec, "long_data")
        assert ids == expect
        assert trained_text(tok, ids, labels) == "3 4 5 .<|im_end|>\n7 8 9 .<|im_end|>\n"


def test_long_data_unknown_source_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"source": "wiki", "body": "x"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: unknown source 'wiki'"):
        build_dataset(path, tok, "long_data", 128)


def test_long_data_missing_conversation_names_the_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"source": "tulu-v2", "dialog": []}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing field 'conversation'"):
        build_dataset(path, tok, "long_data", 128)


# ---------------------------------------------------------------- long_cot

@pytest.mark.parametrize("fields", [("problem", "qwq"), ("prompt", "response")])
def test_long_cot_trains_only_the_answer(tmp_path, tok, fields):
    q, a = "add the numbers 2 , 3 .", "let me think . 0 plus 2 is 2 . 2 plus 3 is 5 ."
    ids, labels = one(tmp_path, tok, {fields[0]: q, fields[1]: a}, "long_cot")
    head = chat(tok, [{"role": "user", "content": q}], gen=True)
    assert ids[: len(head)] == head
    assert labels[: len(head)] == [IGNORE] * len(head)
    trained = [t for t in labels if t != IGNORE]
    assert tok.decode(trained) == a + "<|im_end|>\n"  # the turn end is part of the answer
    assert len(trained) == len(ids) - len(head)


@pytest.fixture(scope="module")
def qwq_tok(tiny):
    """QwQ's arrangement: EOS is the end of turn <|im_end|>, the pad is <|endoftext|>."""
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tiny["target"])
    t.eos_token, t.pad_token = "<|im_end|>", "<|endoftext|>"
    assert t.eos_token_id != t.pad_token_id
    return t


def test_qwq_chat_template_trains_the_end_of_turn_and_not_the_padding(tmp_path, qwq_tok):
    tok, im_end, pad = qwq_tok, qwq_tok.convert_tokens_to_ids("<|im_end|>"), qwq_tok.pad_token_id
    recs = [{"problem": "add 2 , 3 .", "qwq": "2 plus 3 is 5 ."},
            {"problem": "q .", "qwq": "a ."}]
    ds = build_dataset(write_jsonl(tmp_path / "d.jsonl", recs), tok, "long_cot", 4096)
    first = ds[0]
    ids, labels = first["input_ids"].tolist(), first["labels"].tolist()
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assert len(ends) == 2                                    # the user turn's and the answer's
    assert labels[ends[0]] == IGNORE                         # inside the prompt: not trained
    assert labels[ends[1]] == im_end                         # the answer's end of turn: trained
    b = collate([ds[0], ds[1]], pad)
    n1 = len(ds[1]["input_ids"])
    assert b["input_ids"][1, n1:].eq(pad).all() and b["labels"][1, n1:].eq(IGNORE).all()
    assert (b["labels"] == pad).sum() == 0                   # no pad is ever a label
    row1 = b["labels"][1, :n1].tolist()
    assert im_end in row1                                    # the shorter row's turn end too
    # a plain document ends with this tokenizer's EOS (<|im_end|>), which is not its pad
    ids, labels = one(tmp_path, tok, {"text": "the dog ."}, "short_text")
    assert ids[-1] == im_end and labels[-1] == im_end


def test_long_cot_long_prompt_keeps_room_for_the_answer(tmp_path, tok):
    prompt = " ".join(f"fact : the code of ada is {i} ." for i in range(200))
    ids, labels = one(tmp_path, tok, {"prompt": prompt, "response": "the answer is 5 ."},
                      "long_cot", max_len=256)
    assert len(ids) <= 256
    assert tok.decode([t for t in labels if t != IGNORE]) == "the answer is 5 .<|im_end|>\n"
    assert tok.decode(ids).count("<|im_start|>assistant\n") == 1  # header kept before the answer


def test_long_cot_missing_answer_names_the_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "q", "qwq": "a"}, {"problem": "q2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'qwq'"):
        build_dataset(path, tok, "long_cot", 128)


# ---------------------------------------------------------------- bad input

def test_bad_json_line_reports_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, '{"text": "b"', {"text": "c"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON"):
        build_dataset(path, tok, "short_text", 64)


def test_skip_mode_counts_every_kind_of_bad_record(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"text": "a ."}, "{oops", "[1, 2]", {"txt": "no"}, "", {"text": 5},
                        {"text": "b ."}])
    ds = build_dataset(path, tok, "short_text", 64, on_bad_record="skip")
    assert len(ds) == 2 and ds.skipped == 4
    assert [p.split(": ", 1)[0] for p in ds.problems] == [f"{path}:{n}" for n in (2, 3, 4, 6)]
    assert "missing field 'text'" in ds.problems[2]
    assert ds.num_tokens == sum(len(ds[i]["input_ids"]) for i in range(2))


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_zero_usable_records_is_always_an_error(tmp_path, tok, mode):
    path = write_jsonl(tmp_path / "d.jsonl", [{"txt": "a"}, {"body": "b"}])
    with pytest.raises(DataError, match="no usable records|missing field"):
        build_dataset(path, tok, "short_text", 64, on_bad_record=mode)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable records"):
        build_dataset(empty, tok, "short_text", 64, on_bad_record=mode)


def test_record_with_nothing_to_train_is_skipped_and_counted_not_bad(tmp_path, tok):
    # an empty text is only its EOS, the first token, which nothing predicts: nothing to learn, nothing malformed
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": "a ."}])
    ds = build_dataset(path, tok, "short_text", 64)
    assert len(ds) == 1 and ds.untrainable == 1 and ds.skipped == 0
    with pytest.raises(DataError, match=r"no usable records .*0 bad, 1 with nothing to train"):
        build_dataset(write_jsonl(tmp_path / "e.jsonl", [{"text": ""}]), tok, "short_text", 64)


def test_missing_and_unreadable_files_are_named(tmp_path, tok):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        build_dataset(tmp_path / "nope.jsonl", tok, "short_text", 64)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8"):
        build_dataset(latin, tok, "short_text", 64)
    with pytest.raises(DataError, match="is a folder"):
        build_dataset(tmp_path, tok, "short_text", 64)


def test_unknown_collator_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="unknown collator 'dpo'"):
        build_dataset(path, tok, "dpo", 64)


# ---------------------------------------------------------------- JSON arrays

def test_json_array_input_with_real_line_numbers(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"text": "the dog ."},\n  {"text": "the cat ."},\n'
                    '  {\n    "txt": "oops"\n  }\n]\n')
    assert [line for line, _ in read_records(path)] == [2, 3, 4]  # fields: the collator's job
    with pytest.raises(DataError, match=r"d\.json:4: missing field 'text'"):
        build_dataset(path, tok, "short_text", 64)
    ds = build_dataset(path, tok, "short_text", 64, on_bad_record="skip")
    assert len(ds) == 2 and ds.skipped == 1


def test_broken_json_array_is_an_error_even_in_skip_mode(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"text": "a"},\n {"text": }]')
    with pytest.raises(DataError, match=r"d\.json:2: invalid JSON"):
        list(read_records(path, "skip"))


# ---------------------------------------------------------------- collate + loader

def test_collate_pads_right_and_masks_padding(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the big red dog sees the cat ."},
                                              {"text": "a ."}])
    ds = build_dataset(path, tok, "short_text", 64)
    pad = tok.pad_token_id
    assert pad == tok.eos_token_id  # the tiny target pads with EOS, like upstream's configs
    b = collate([ds[0], ds[1]], pad)
    n0, n1 = len(ds[0]["input_ids"]), len(ds[1]["input_ids"])
    assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (2, n0)
    assert b["input_ids"][1, n1:].eq(pad).all()
    assert b["labels"][1, n1:].eq(IGNORE).all()
    assert b["labels"][1, n1 - 1] == pad     # the real EOS is the pad token here: trained all the same
    assert b["labels"][1, :n1].ne(IGNORE).all()
    assert b["attention_mask"].sum(1).tolist() == [n0, n1]


def _loader_batches(ds, **kw):
    args = dict(batch_size=2, seed=7, rank=0, world_size=1, pad_token_id=0) | kw
    return make_loader(ds, **args)


def test_loader_shards_shuffles_and_resumes(tmp_path, tok):
    records = [{"text": f"count from {i} : {i} ."} for i in range(11)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ds = build_dataset(path, tok, "short_text", 64)
    key = {tuple(ds[i]["input_ids"].tolist()): i for i in range(len(ds))}

    def order(loader):
        return [key[tuple(row[m.bool()].tolist())]
                for b in loader for row, m in zip(b["input_ids"], b["attention_mask"])]

    a, b = _loader_batches(ds), _loader_batches(ds)
    first = order(a)
    assert first == order(b) and sorted(first) == list(range(11))  # same seed, same order
    assert order(a) != first  # the next pass is the next epoch
    assert order(_loader_batches(ds, seed=8)) != first

    ranks = [_loader_batches(ds, rank=r, world_size=3) for r in range(3)]
    per_rank = [order(r) for r in ranks]
    assert {len(r) for r in ranks} == {2} and {len(p) for p in per_rank} == {4}
    assert set().union(*per_rank) == set(range(11))  # 12 slots: one sample wraps around

    resumed = _loader_batches(ds, skip_batches=2)
    assert order(resumed) == first[4:]
    assert order(resumed) == order(_loader_batches(ds, epoch=1))  # then whole epochs again


def test_the_column_table_validate_reads_is_what_the_collators_accept(tok):
    """formats.datafiles.COLLATOR_COLUMNS (validate's column check) against longspec.data.collators, record by record."""
    from longspec.data.collators import RecordError
    from longspec.formats.datafiles import COLLATOR_COLUMNS

    chat = [{"role": "user", "content": "add 1 and 2 ."}, {"role": "assistant", "content": "3 ."}]
    value = {"conversation": chat, "messages": chat}
    for collator, alternatives in COLLATOR_COLUMNS.items():
        for alt in alternatives:
            rec = {c: value.get(c, "the fox sees the moon .") for c in alt}
            assert encode_record(rec, tok, collator, 256)[0], (collator, alt)
            for c in alt:                             # one column fewer: no other alternative is complete
                rest = {k: v for k, v in rec.items() if k != c}
                if not any(set(a) <= set(rest) for a in alternatives):
                    with pytest.raises(RecordError):
                        encode_record(rest, tok, collator, 256)
        with pytest.raises(RecordError):
            encode_record({"unrelated": "x"}, tok, collator, 256)
