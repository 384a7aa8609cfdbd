"""Regeneration's rows: what the target is asked for each record of a stage, and the record the
stage then trains on (`python -m longspec.regenerate`; the shards and the manifest are
longspec.data.regenstore, the engines longspec.decode.engines).

The prompt rules (PROMPT_RULE, recorded in the manifest):

  chat      chat and chain-of-thought records (long_cot, long_data's conversations and arXiv
            summaries): system and user turns are kept, assistant turns dropped; the target
            answers each assistant turn on its own regenerated history, rendered by the target's
            chat template with the template settings the stage's collator renders with
            (CHAT_TEMPLATE_KWARGS: none), so what is generated is what is trained.
  document  plain documents (short_text, long_data's code/book/`text`): the document's first
            `prefix_tokens` tokens are the context, the target's continuation the new text; the
            record keeps the prefix as `context` (untrained, longspec.data.collators) and the
            continuation as `text` (trained).

A row's id is its source file's name and its 0-based record index there (`base.jsonl#12`,
`train-00000-of-00002.parquet#7`): stable across runs, the key resume skips by.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from longspec.data.chat import ChatError, end_of_turn, end_of_turn_ids, render
from longspec.data.collators import RecordError, long_cot_messages, long_data_messages
from longspec.data.records import DataError, read_records, tail_records

PROMPT_RULE = {"version": 1,
               "chat": "system and user turns kept, each assistant turn regenerated on the regenerated history",
               "document": "the first prefix_tokens tokens as untrained context, the continuation trained"}
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {}   # what longspec.data.collators renders with (split_chat's defaults)
DOCUMENT_SOURCES = ("code", "book")         # long_data's document kinds kept in the output record


@dataclass
class Request:
    """One generation: the prompt as token ids (the embedded engine) and as text (a server, which
    tokenizes it with the tokenizer's own special tokens: the same ids)."""
    ids: list[int]
    text: str
    max_new: int
    stop_ids: tuple[int, ...]
    stop_texts: tuple[str, ...]


@dataclass
class Row:
    """One source record being regenerated (turn by turn for a chat)."""
    index: int                      # position in the source: rows are written in this order
    id: str
    kind: str                       # "chat" | "document" | "bad"
    rec: dict
    messages: list[dict] = field(default_factory=list)   # chat: the turns, answers filled in as made
    todo: list[int] = field(default_factory=list)         # chat: indices of assistant turns left
    context: str = ""                                     # document: the prefix
    answers: list = field(default_factory=list)     # longspec.decode.engines.Answer per turn
    prompt_tokens: int = 0
    status: str = "pending"         # pending | kept | truncated | failed | skipped | untrainable
    reason: str = ""


def source_rows(train_file, collator: str, start: int = 0) -> Iterator[Row]:
    """The train_file's records as rows, from record index `start` on (earlier ones are read, not
    kept). A record the collator cannot read becomes a row of kind "bad" (counted as failed)."""
    counts: dict[str, int] = {}
    for i, (at, rec) in enumerate(read_records(train_file)):
        name = at.file.name if hasattr(at, "file") else Path(train_file).name
        n = counts[name] = counts.get(name, -1) + 1
        if i < start:
            continue
        row = Row(index=i, id=f"{name}#{n}", kind="bad", rec=rec)
        try:
            msgs = chat_messages(rec, collator)
        except RecordError as e:
            row.status, row.reason = "failed", str(e)
            yield row
            continue
        if msgs is None:
            row.kind = "document"
        else:
            row.kind = "chat"
            row.todo = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
            row.messages = [dict(m) for m in msgs]
        yield row


def count_records(train_file, limit: int | None = None) -> int:
    """How many records a run goes over: with `limit`, read no further than it; parquet and arrow
    from their footers (tail_records reads only the last row group); JSONL read once."""
    if limit is not None:
        return sum(1 for _ in itertools.islice(read_records(train_file), limit))
    return tail_records(train_file, 1)[0]


def chat_messages(rec: dict, collator: str) -> list[dict] | None:
    """The conversation the collator trains, None for a document; RecordError if it reads neither."""
    if collator == "short_text":
        if not isinstance(rec.get("text", rec.get("target")), str):
            raise RecordError("missing field 'text'")
        return None
    if collator == "long_data":
        msgs = long_data_messages(rec)
        if msgs is None and not isinstance(rec.get("text"), str):
            raise RecordError("missing field 'text'")
        return msgs
    if collator == "long_cot":
        return long_cot_messages(rec)
    raise DataError(f"unknown collator {collator!r}")


def document_text(rec: dict) -> str:
    return rec["text"] if "text" in rec or "target" not in rec else rec["target"]


# ----------------------------------------------------------------------------- requests

class Prompter:
    """The next request of a row, by the prompt rules above, capped by max_seq_length."""

    def __init__(self, tokenizer, max_seq_length: int, prefix_tokens: int, max_new_tokens: int | None):
        self.tok, self.max_seq_length = tokenizer, max_seq_length
        self.prefix_tokens, self.max_new_tokens = prefix_tokens, max_new_tokens
        self.turn_stop_ids = end_of_turn_ids(tokenizer)
        self.eos_ids = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
        self._turn_text: str | None = None
        # What the tokenizer adds to a text by itself (Llama 3: its BOS). A server tokenizes the
        # prompt text with it; the rendered chat already holds it, so it is left out of that text.
        added = tokenizer("", add_special_tokens=True)["input_ids"]
        self.added_text = tokenizer.decode(added) if added else ""

    def turn_stop_text(self) -> str:
        """The end-of-turn text a server is told to stop at (`<|im_end|>`), without its newline."""
        if self._turn_text is None:
            try:
                self._turn_text = end_of_turn(self.tok, [{"role": "user", "content": "hi"}],
                                              **CHAT_TEMPLATE_KWARGS).strip()
            except ChatError:
                self._turn_text = ""
        return self._turn_text

    def limit(self, prompt_len: int) -> int:
        """The new-token limit: max_seq_length minus the prompt, or --max-new-tokens when lower."""
        room = self.max_seq_length - prompt_len
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)

    def next_request(self, row: Row) -> Request | None:
        """The row's next generation; None when the row is done (its status then set)."""
        if row.kind == "document":
            return None if row.answers else self._document(row)
        if not row.todo:
            if row.status == "pending":
                row.status, row.reason = "failed", "the conversation has no assistant turn"
            return None
        turn = row.todo[0]
        try:
            text = render(self.tok, row.messages[:turn], True, **CHAT_TEMPLATE_KWARGS)
        except ChatError as e:
            row.status, row.reason = "failed", str(e)
            return None
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.added_text and text.startswith(self.added_text):
            text = text[len(self.added_text):]
        return self._capped(row, ids, text, self.turn_stop_ids, (self.turn_stop_text(),))

    def _document(self, row: Row) -> Request | None:
        ids = self.tok(document_text(row.rec), add_special_tokens=False)["input_ids"]
        if len(ids) <= self.prefix_tokens:
            row.status, row.reason = "skipped", f"document of {len(ids)} tokens, not longer than the prefix"
            return None
        row.context = self.tok.decode(ids[:self.prefix_tokens])
        full = self.tok(row.context, add_special_tokens=True)["input_ids"]   # as the trainer reads it
        return self._capped(row, full, row.context, self.eos_ids, ())

    def _capped(self, row: Row, ids: list[int], text: str, stop_ids, stop_texts) -> Request | None:
        room = self.limit(len(ids))
        if room < 1:
            row.status = "skipped"
            row.reason = f"prompt of {len(ids)} tokens leaves no room within max_seq_length={self.max_seq_length}"
            return None
        row.prompt_tokens = len(ids)
        return Request(ids, text, room, tuple(stop_ids), tuple(s for s in stop_texts if s))

    def problem(self, row: Row, req: Request, ans) -> str | None:
        """Why a server's answer cannot be kept (the row then fails, and a rerun asks it again):
        text the tokenizer cannot take, more tokens than the request allowed (counted here with
        the target's tokenizer, with a little room for a retokenization that differs), an empty
        chat answer. A document's empty continuation is no fault: check_trainable counts it.
        An answer whose token count the server did not say, or said wrong, gets the count made here."""
        try:
            ans.text.encode("utf-8")
        except UnicodeEncodeError:
            return "the answer holds text that is not Unicode (a lone surrogate)"
        if row.kind == "chat" and not ans.text.strip():
            return "the server's answer is empty"
        try:
            n = len(self.tok(ans.text, add_special_tokens=False)["input_ids"])
        except Exception as e:                                     # noqa: BLE001 (any refusal of the tokenizer)
            return f"the target's tokenizer cannot take the answer ({type(e).__name__})"
        if n > req.max_new + 16 + req.max_new // 20:
            return f"the answer has {n:,} tokens, more than the {req.max_new:,} the request allowed"
        if not n <= ans.tokens <= req.max_new + 1:
            ans.tokens = n + (ans.finish == "stop")
        return None

    def take(self, row: Row, req: Request, ans) -> None:
        """Record an answer; a chat answer cut at the limit ends the row as truncated. A document's
        continuation is kept however it ends (its finish reason says which): a document has no
        end to reach, and the trainer cuts every document at max_seq_length too."""
        row.answers.append(ans)
        if row.kind == "chat":
            row.messages[row.todo.pop(0)]["content"] = ans.text
            if ans.finish == "length":
                row.status, row.reason = "truncated", f"answer cut at {req.max_new} new tokens"
                return
        if row.kind == "document" or not row.todo:
            row.status = "kept"


def check_trainable(row: Row, tokenizer, collator: str, max_seq_length: int, keep_truncated: bool) -> None:
    """A row that would be written but whose record trains no token within max_seq_length (the
    target ended the document at once, an answer after a prompt that fills the length) becomes
    "untrainable": not written, counted. The rule is longspec.data.encoding's, which prepare applies."""
    if not (row.status == "kept" or (row.status == "truncated" and keep_truncated)):
        return
    from longspec.data.encoding import untrainable

    why = untrainable(output_record(row, collator), tokenizer, collator, max_seq_length)
    if why is not None:
        last = row.answers[-1] if row.answers else None
        row.status = "untrainable"
        row.reason = why + (f" (the target's answer: {last.tokens} new token{'s' * (last.tokens != 1)}, "
                            f"finish {last.finish})" if last else "")


# ----------------------------------------------------------------------------- output

def output_record(row: Row, collator: str) -> dict:
    """The record the stage trains on, plus the row's id, finish reason and token counts."""
    finish = row.answers[-1].finish if row.answers else ""
    meta = {"id": row.id, "finish_reason": finish, "prompt_tokens": row.prompt_tokens,
            "completion_tokens": sum(a.tokens for a in row.answers)}
    if row.kind == "document":
        out = {"context": row.context, "text": row.answers[0].text}
        if collator == "long_data" and row.rec.get("source") in DOCUMENT_SOURCES:
            out["source"] = row.rec["source"]
        return {**out, **meta}
    if collator == "long_cot":
        return {"prompt": row.messages[0]["content"], "response": row.messages[1]["content"], **meta}
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in row.messages], **meta}


COLUMNS = {  # the shard columns per collator (pyarrow types by name: longspec.data.regenstore)
    "short_text": ("id", "context", "text"),
    "long_data": ("id", "source", "context", "text", "messages"),
    "long_cot": ("id", "prompt", "response"),
}
META_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens")
