"""Stage 2 and 3 records under the chat templates real targets ship (tests/trainer/templates/),
applied to the tiny tokenizer with each template's special tokens added. transformers' own
apply_chat_template is the judge of the prompt; the trained tokens must be exactly the answers
and their end-of-turn text, token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longspec.data.chat import split_chat
from longspec.data.encoding import DataError, build_dataset
from longspec.tiny import build_tiny

IGNORE = -100
TEMPLATES = Path(__file__).parent / "templates"

# The system turn a template writes by itself when the record has none (a record's own system replaces it).
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWQ_PREVIEW_SYSTEM = ("You are a helpful and harmless assistant. You are Qwen developed by Alibaba. "
                      "You should think step-by-step.")
DEFAULT_SYSTEM = {"qwen2.5", "qwq-32b-preview"}

# name -> (template file, special tokens to add, bos, eos, the end of turn the template writes,
#          text the template adds on its own and that must never be trained)
CASES = {
    "qwq-32b": ("qwq-32b.jinja", ["<think>", "</think>"], None, "<|im_end|>", "<|im_end|>\n", "<think>"),
    "qwen3-thinking": ("qwen3.jinja", ["<think>", "</think>"], None, "<|im_end|>", "<|im_end|>\n", None),
    "qwen3-no-thinking": ("qwen3.jinja", ["<think>", "</think>"], None, "<|im_end|>", "<|im_end|>\n",
                          "<think>\n\n</think>"),
    "llama-3.1": ("llama-3.1-instruct.jinja",
                  ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                  "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", "Cutting Knowledge Date"),
    "qwen2.5": ("qwen2.5-instruct.jinja", [], None, "<|im_end|>", "<|im_end|>\n", QWEN25_SYSTEM),
    "qwq-32b-preview": ("qwq-32b-preview.jinja", [], None, "<|im_end|>", "<|im_end|>\n", QWQ_PREVIEW_SYSTEM),
    "mistral-v0.3": ("mistral-7b-instruct-v0.3.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>",
                     "[INST]"),
    "mistral-nemo": ("mistral-nemo-instruct.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>",
                     "[INST]"),
    "tiny-chatml": (None, [], None, None, "<|im_end|>\n", None),
}
NO_THINKING = "{%- set enable_thinking = false %}\n"   # how a target folder pins Qwen3's switch off


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), family="qwen2")


def make_tok(tiny, case: str):
    from transformers import AutoTokenizer

    file, extra, bos, eos, _, _ = CASES[case]
    tok = AutoTokenizer.from_pretrained(tiny["target"])
    if file is None:
        return tok
    tok.add_special_tokens({"additional_special_tokens": extra})
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = (NO_THINKING if case == "qwen3-no-thinking" else "") + (TEMPLATES / file).read_text()
    return tok


def encode(tmp_path, tok, rec, collator, max_len=4096):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    s = build_dataset(path, tok, collator, max_len)[0]
    return s["input_ids"].tolist(), s["labels"].tolist()


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def trained_runs(ids, labels):
    """The trained tokens as contiguous runs (lists of ids)."""
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


REASONING = "let me think . 2 plus 3 is 5 . wait , check : 5 .\n</think>\n\nthe answer is 5 ."


@pytest.mark.parametrize("case", list(CASES))
def test_stage3_prompt_untrained_answer_whole_and_its_end_of_turn_trained(tmp_path, tiny, case):
    tok = make_tok(tiny, case)
    eot, own = CASES[case][4], CASES[case][5]
    question = "add the numbers 2 , 3 ."
    ids, labels = encode(tmp_path, tok, {"problem": question, "qwq": REASONING}, "long_cot")
    head = ids_of(tok, tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True))
    assert ids[:len(head)] == head                                  # the generation prompt, as rendered
    assert labels[:len(head)] == [IGNORE] * len(head)               # nothing of the prompt is trained
    assert trained_runs(ids, labels) == [ids[len(head):]]           # everything after it is
    assert tok.decode(ids[len(head):]) == REASONING + eot           # the answer whole, </think> kept
    end = ids_of(tok, eot)
    assert ids[-len(end):] == end and labels[-len(end):] == end     # the end of turn is trained
    if own:
        assert own in tok.decode(ids[:len(head)]) or own == "[INST]"
        assert own not in tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


CONV = [{"role": "system", "content": "you are a helpful assistant ."},
        {"role": "user", "content": "count from 3 to 5 ."},
        {"role": "assistant", "content": "3 4 5 ."},
        {"role": "user", "content": "and from 7 ?"},
        {"role": "assistant", "content": "7 8 9 ."}]


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("case", list(CASES))
def test_stage2_chat_trains_each_answer_and_end_never_system_or_user(tmp_path, tiny, case, system):
    tok = make_tok(tiny, case)
    eot, own = CASES[case][4], CASES[case][5]
    conv = CONV if system else CONV[1:]
    ids, labels = encode(tmp_path, tok, {"source": "tulu-v2", "conversation": conv}, "long_data")
    assert [tok.decode(r) for r in trained_runs(ids, labels)] == ["3 4 5 ." + eot, "7 8 9 ." + eot]
    text = tok.decode(ids)
    untrained = tok.decode([t for t, lab in zip(ids, labels) if lab == IGNORE])
    for words in ("you are a helpful assistant ." if system else "", "count from 3 to 5 .", "and from 7 ?"):
        assert words in untrained and words in text
    if case in DEFAULT_SYSTEM and system:
        assert own not in text                                      # the record's system replaces the default
    elif own:
        assert own in untrained
    # the last answer's context is the template's own generation prompt for it
    head = ids_of(tok, tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True))
    last = trained_runs(ids, labels)[-1]
    assert ids[len(ids) - len(last) - len(head[-3:]):len(ids) - len(last)] == head[-3:]


@pytest.mark.parametrize("case", ["qwq-32b", "llama-3.1", "mistral-v0.3", "mistral-nemo", "qwen3-no-thinking",
                                  "qwen2.5", "qwq-32b-preview"])
def test_stage2_arxiv_trains_the_summary_not_the_article(tmp_path, tiny, case):
    tok = make_tok(tiny, case)
    eot = CASES[case][4]
    rec = {"source": "arxiv", "article": "fact : the age of ada is 10 .", "abstract": "ada is 10 ."}
    ids, labels = encode(tmp_path, tok, rec, "long_data")
    assert "Please summarize the following article: fact : the age of ada is 10 ." in tok.decode(ids)
    assert [tok.decode(r) for r in trained_runs(ids, labels)] == ["ada is 10 ." + eot]


def test_qwq_earlier_answer_is_trained_as_the_history_shows_it(tiny):
    """QwQ-32B shows an earlier answer without its reasoning once a later turn follows: that is
    the text the target reads, so that is what is trained for it; the last answer stays whole."""
    tok = make_tok(tiny, "qwq-32b")
    conv = [{"role": "user", "content": "q1 ."}, {"role": "assistant", "content": REASONING},
            {"role": "user", "content": "q2 ."}, {"role": "assistant", "content": REASONING}]
    split = split_chat(tok, conv)
    assert split.untrained_answers == 0
    assert [t for t, k in split.pieces if k != "prompt"] == [
        "the answer is 5 .", "<|im_end|>\n", REASONING, "<|im_end|>\n"]
    assert split.prompt == tok.apply_chat_template(conv[:3], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("case", ["qwq-32b", "llama-3.1", "mistral-v0.3", "mistral-nemo", "qwen2.5",
                                  "qwq-32b-preview"])
def test_split_chat_gives_evaluation_the_trainers_prompt_and_answer_ids(tmp_path, tiny, case):
    tok = make_tok(tiny, case)
    conv = [{"role": "user", "content": "add the numbers 2 , 3 ."}, {"role": "assistant", "content": REASONING}]
    prompt, answer = split_chat(tok, conv).token_ids(tok)
    ids, labels = encode(tmp_path, tok, {"problem": conv[0]["content"], "qwq": REASONING}, "long_cot")
    assert prompt + answer == ids and labels[len(prompt):] == answer
    assert prompt == ids_of(tok, tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True))


def test_template_without_an_end_of_turn_is_refused_with_file_line_and_template(tmp_path, tiny):
    tok = make_tok(tiny, "tiny-chatml")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "q .", "qwq": "a ."}) + "\n" + json.dumps({"problem": "q", "qwq": "b"}))
    with pytest.raises(DataError, match=r"d\.jsonl:1: .*chat template gives no end of turn"):
        build_dataset(path, tok, "long_cot", 128)


def test_a_tokenizer_without_a_template_ends_answers_with_its_eos(tmp_path, tiny):
    tok = make_tok(tiny, "tiny-chatml")
    tok.chat_template, tok.eos_token = None, "<|im_end|>"
    ids, labels = encode(tmp_path, tok, {"problem": "q .", "qwq": "a ."}, "long_cot")
    assert tok.decode(ids) == "user: q .\nassistant: a .<|im_end|>\n"
    assert [tok.decode(r) for r in trained_runs(ids, labels)] == ["a .<|im_end|>\n"]


# The pad settings real tokenizers ship: a separate pad token, pad = EOS (Qwen's base models), pad = the
# end of turn (ChatML instruct models that set pad_token = <|im_end|>), no pad at all (Llama 3.1:
# longspec pads with the EOS then, which for the instruct model is its end of turn <|eot_id|>).
PADS = ("separate", "eos", "end-of-turn", "none")


def with_pad(tok, pad: str, eot: str, folder):
    """The tokenizer under one pad setting; "none" goes through a saved folder and load_tokenizer
    (the trainer's own fallback: pad = EOS)."""
    from longspec.data.encoding import load_tokenizer

    if pad == "eos":
        tok.pad_token = tok.eos_token
    elif pad == "end-of-turn":
        tok.pad_token = eot.strip()
    elif pad == "none":
        tok.pad_token = None
        tok.save_pretrained(folder)
        tok = load_tokenizer(folder)
        assert tok.pad_token == tok.eos_token
    return tok


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("case", list(CASES))
def test_what_is_trained_is_decided_by_position_whatever_the_pad(tmp_path, tiny, case, pad):
    """The answers' end of turn and a document's end are trained, padding never, under every pad."""
    from longspec.data.encoding import collate

    tok = make_tok(tiny, case)
    if case == "tiny-chatml":                                     # no template: answers end with the EOS
        tok.eos_token = "<|im_end|>"
    eot = CASES[case][4]
    tok = with_pad(tok, pad, eot, tmp_path / "tok")
    closing = ids_of(tok, eot.strip())
    assert len(closing) == 1
    chats = [{"source": "tulu-v2", "conversation": CONV}, {"source": "tulu-v2", "conversation": CONV[1:3]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats))
    ds = build_dataset(path, tok, "long_data", 4096)
    ids, labels = ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
    assert [tok.decode(r) for r in trained_runs(ids, labels)] == ["3 4 5 ." + eot, "7 8 9 ." + eot]
    batch = collate([ds[0], ds[1]], tok.pad_token_id)
    n1 = len(ds[1]["input_ids"])
    assert batch["labels"][1, n1:].eq(IGNORE).all() and batch["input_ids"][1, n1:].eq(tok.pad_token_id).all()
    for row, n in ((0, len(ids)), (1, n1)):                       # each row's last answer ends trained
        ends = [j for j in range(n) if batch["input_ids"][row, j] == closing[0]]
        assert batch["labels"][row, ends[-1]] == closing[0]
    # the base collator's documents: the document end (the EOS) trained, the padding after it not
    path.write_text(json.dumps({"text": "the big red dog sees the cat ."}) + "\n" + json.dumps({"text": "a ."}) + "\n")
    docs = build_dataset(path, tok, "short_text", 64)
    batch = collate([docs[0], docs[1]], tok.pad_token_id)
    n1 = len(docs[1]["input_ids"])
    for row, n in ((0, len(docs[0]["input_ids"])), (1, n1)):
        assert batch["input_ids"][row, n - 1] == tok.eos_token_id and batch["labels"][row, n - 1] == tok.eos_token_id
    assert batch["labels"][1, n1:].eq(IGNORE).all() and batch["attention_mask"][1, n1:].eq(0).all()
