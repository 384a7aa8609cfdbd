"""One encoder ("collator") per stage: a record's fields -> pieces of text, each with its kind.

Pieces are (text, kind): "text" (a plain document, trained), "prompt" (not trained: system,
user, the template's default system text, the generation header), "answer" and "end" (the
assistant's answer and its end of turn, trained). Chats are split by longspec.data.chat.split_chat
(the rule in docs/DESIGN.md). Each encoder returns (pieces, plain, add_eos): plain documents get
the tokenizer's own special tokens (a BOS for Llama) and, where add_eos, its EOS.

  short_text  stage 1: `text` (or upstream's `target`) + EOS, as upstream's `text + eos_token`.
  long_data   stage 2: upstream `source` kinds: code/book `text` as it is (no EOS, as upstream),
              arxiv `article` + `abstract` as a summary chat with upstream's instruction,
              tulu-v2 `conversation` and plain `messages` chats.
  long_cot    stage 3: `problem` + `qwq` (QwQ-LongCoT) or `prompt` + `response`: one user turn,
              one answer.

A document (short_text, long_data's `text`) may carry a `context` string: read before `text` as
an untrained "prompt" piece (the document's prefix a regenerated continuation follows,
longspec.data.regen); the BOS, when the tokenizer adds one, goes before the context.
"""

from __future__ import annotations

from longspec.data.chat import ChatError, split_chat

LONG_SOURCES = ("code", "book", "arxiv", "tulu-v2")
# Upstream's stage-2 instruction for arXiv records (general_collator.py, LongDataNoMaskSFTCollator).
ARXIV_INSTRUCTION = "Please summarize the following article: {article}"
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}


class RecordError(ValueError):
    """One record that does not fit its collator (becomes DataError("file:line: ...") or a skip)."""


class Untrainable(RecordError):
    """A well-formed record with no token to train within max_seq_length (an empty answer, a prompt
    that fills the length): skipped and counted by `prepare`, never written by `regenerate`
    (longspec.data.encoding.assemble is the one rule that raises it)."""


def _field(rec: dict, name: str, kinds=(str,), what: str = "a string"):
    if name not in rec:
        raise RecordError(f"missing field '{name}'")
    value = rec[name]
    if not isinstance(value, kinds):
        raise RecordError(f"field '{name}' must be {what}, not {type(value).__name__}")
    return value


def messages_of(rec: dict, name: str) -> list[dict]:
    """A record's conversation as [{"role", "content"}] (ShareGPT `from`/`value` accepted)."""
    turns = _field(rec, name, (list,), "a list of turns")
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, dict) and "from" in t and "value" in t:  # ShareGPT spelling
            t = {"role": t["from"], "content": t["value"]}
        if not (isinstance(t, dict) and isinstance(t.get("role"), str)
                and isinstance(t.get("content"), str)):
            raise RecordError(f"field '{name}' turn {i}: needs string 'role' and 'content'")
        out.append({"role": _ROLE_ALIASES.get(t["role"], t["role"]), "content": t["content"]})
    if not out:
        raise RecordError(f"field '{name}' is an empty conversation")
    return out


def chat_pieces(tokenizer, messages: list[dict]) -> list[tuple[str, str]]:
    try:
        return split_chat(tokenizer, messages).pieces
    except ChatError as e:
        raise RecordError(str(e)) from None


def document_pieces(rec: dict, name: str) -> list[tuple[str, str]]:
    """A document's pieces: its optional untrained `context`, then the trained `name` field."""
    text = [(_field(rec, name), "text")]
    return ([(_field(rec, "context"), "prompt")] + text) if "context" in rec else text


def _short_text(rec: dict, tokenizer):
    name = "text" if "text" in rec or "target" not in rec else "target"
    return document_pieces(rec, name), True, True


def long_data_messages(rec: dict) -> list[dict] | None:
    """Stage 2's conversation of a record (an arXiv summary with upstream's instruction, a tulu-v2
    or plain `messages` chat), None for a document (code, book, `text`): what the trainer trains
    and what evaluation asks (longspec.measure.prompts)."""
    source = rec.get("source")
    if source in ("code", "book") or (source not in LONG_SOURCES and "text" in rec):
        return None
    if source == "arxiv" or (source is None and "article" in rec):
        article = _field(rec, "article", (str, list), "a string or a list of strings")
        abstract = _field(rec, "abstract", (str, list), "a string or a list of strings")
        articles = [article] if isinstance(article, str) else article
        abstracts = [abstract] if isinstance(abstract, str) else abstract
        if len(articles) != len(abstracts) or not articles or not all(
                isinstance(x, str) for x in articles + abstracts):
            raise RecordError("fields 'article' and 'abstract' must be strings or equal-length "
                              "lists of strings")
        msgs = []
        for art, abs_ in zip(articles, abstracts):
            msgs += [{"role": "user", "content": ARXIV_INSTRUCTION.format(article=art)},
                     {"role": "assistant", "content": abs_}]
        return msgs
    if source == "tulu-v2" or (source is None and ("conversation" in rec or "messages" in rec)):
        name = "conversation" if "conversation" in rec or "messages" not in rec else "messages"
        return messages_of(rec, name)
    if source is None:
        raise RecordError("missing field 'source' (or one of 'text', 'article', 'conversation', "
                          "'messages')")
    raise RecordError(f"unknown source {source!r} without a 'text' field; known sources: "
                      f"{', '.join(LONG_SOURCES)}")


def _long_data(rec: dict, tokenizer):
    msgs = long_data_messages(rec)
    if msgs is None:
        return document_pieces(rec, "text"), True, False
    return chat_pieces(tokenizer, msgs), False, False


def long_cot_messages(rec: dict) -> list[dict]:
    """A stage-3 record as a two-turn chat (the question, the answer)."""
    if "problem" in rec or "qwq" in rec:
        prompt, answer = _field(rec, "problem"), _field(rec, "qwq")
    elif "prompt" in rec or "response" in rec:
        prompt, answer = _field(rec, "prompt"), _field(rec, "response")
    else:
        raise RecordError("missing fields: needs 'problem' + 'qwq' or 'prompt' + 'response'")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _long_cot(rec: dict, tokenizer):
    return chat_pieces(tokenizer, long_cot_messages(rec)), False, False


ENCODERS = {"short_text": _short_text, "long_data": _long_data, "long_cot": _long_cot}
