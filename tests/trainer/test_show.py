"""longspec.show: records token by token as the trainer encodes them, and the first-records
check the prepared cache's manifest carries for `validate`."""

import json

import pytest

from longspec.data.preview import first_records_check, show_records
from longspec.tiny import build_tiny


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")["target"])


def write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_show_records_are_the_trainers_tokens_with_counts(tmp_path, tok):
    from longspec.data.encoding import build_dataset

    path = write(tmp_path / "d.jsonl", [{"problem": "add 2 , 3 .", "qwq": "2 plus 3 is 5 ."},
                                        {"prompt": " ".join(["fact ."] * 80), "response": "done ."}])
    recs = show_records(path, tok, "long_cot", 64, 5)
    ds = build_dataset(path, tok, "long_cot", 64)
    assert [r["index"] for r in recs] == [0, 1] and [r["line"] for r in recs] == [1, 2]
    for r, sample in zip(recs, (ds[0], ds[1])):
        assert [i for i, _, _ in r["tokens"]] == sample["input_ids"].tolist()
        assert [t for _, _, t in r["tokens"]] == sample["labels"].ne(-100).tolist()
        assert r["prompt"] + r["trained"] == len(r["tokens"])
    assert "".join(t for _, t, tr in recs[0]["tokens"] if tr) == "2 plus 3 is 5 .<|im_end|>\n"
    assert recs[0]["cut"] == 0 and recs[0]["end_of_turn_trained"] is True
    assert recs[1]["cut"] > 0                                   # the long prompt was capped
    empty = write(tmp_path / "e.jsonl", [{"text": ""}, {"text": "the cat ."}])   # nothing to train: skipped, as prepare does
    assert [r["index"] for r in show_records(empty, tok, "short_text", 64, 5)] == [1]


def test_first_records_check_counts_cut_ends_and_trained_system_markup(tmp_path, tok):
    cot = write(tmp_path / "cot.jsonl", [{"problem": "q .", "qwq": " ".join(["step ."] * 200)},
                                         {"problem": "q .", "qwq": "a ."}])
    chk = first_records_check(cot, tok, "long_cot", 128)
    assert chk == {"records": 2, "chat": 2, "no_end_of_turn": 1, "first_no_end_of_turn": 1, "end_of_turn": "<|im_end|>",
                   "system_trained": 0, "untrained_answers": 0}
    pasted = write(tmp_path / "txt.jsonl", [{"text": "<|im_start|>system\nbe nice .<|im_end|>\nhello ."},
                                            {"text": "just a story ."}])
    chk = first_records_check(pasted, tok, "short_text", 128)
    assert chk["system_trained"] == 1 and chk["chat"] == 0


def test_the_end_of_turn_check_wants_the_templates_closing_token_not_the_newline_after_it(tmp_path, tok):
    """validate's end-of-turn facts: the token the template closes a turn with (<|im_end|>, not the
    newline after it), trained after the last answer; the warning names the token and the record."""
    from longspec.data.chat import end_of_turn_tokens
    from longspec.data.preview import _end_trained, inspect_record
    from longspec.formats.prepared import PreparedState, prepared_warnings

    closing = end_of_turn_tokens(tok)
    assert [tok.decode([i]) for i in closing] == ["<|im_end|>"]
    kinds: list[str] = []
    from longspec.data.encoding import encode_full
    ids, trained, _ = encode_full({"problem": "q .", "qwq": "a ."}, tok, "long_cot", 128, kinds)
    assert _end_trained(ids, trained, kinds, closing)
    assert inspect_record({"problem": "q .", "qwq": "a ."}, tok, "long_cot", 128)["end_of_turn_trained"]
    at = ids.index(closing[0], len(ids) - 2)
    assert kinds[at + 1:] == ["end"] and trained[at + 1]          # the newline after it, trained
    trained[at] = False                                           # the old pad rule's outcome for pad = <|im_end|>
    assert not _end_trained(ids, trained, kinds, closing)
    cot = write(tmp_path / "cot.jsonl", [{"problem": "q .", "qwq": "a ."}, {"problem": "q .", "qwq": "a ."},
                                         {"problem": "q .", "qwq": " ".join(["step ."] * 200)}])
    chk = first_records_check(cot, tok, "long_cot", 128)
    (warning,) = prepared_warnings(PreparedState("ready", extra={"chat_check": chk}))
    assert warning.startswith("1 of the first 3 records are chats whose end-of-turn token <|im_end|> is not "
                              "trained after their last answer (first: line 3)")
