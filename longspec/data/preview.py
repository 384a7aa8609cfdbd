"""A stage's first records as the trainer encodes them, token by token, and the check on them.

    inspect_record(rec, tokenizer, collator, max_seq_length)   one record: tokens with their trained
                                flag, the prompt / trained / cut counts, chat end-of-turn facts
    show_records(path, ...)     the first K records of a train_file (`python -m longspec.show`)
    first_records_check(...)    the same look at the first CHECK_RECORDS records, summed for the
                                prepared cache's manifest, so that `validate` can warn without a
                                tokenizer: chat records whose end of turn (the template's own
                                closing token, a newline after it does not count) is not trained
                                after their last answer, naming the token and the first record; records
                                that train a system turn's markup (chat text pasted into a document)

The tokens come from longspec.data.encoding's own encoder (encode_full), the one owner of them.
"""
from __future__ import annotations

from pathlib import Path

CHECK_RECORDS = 64          # records `first_records_check` looks at
DEFAULT_SHOW = 3


def inspect_record(rec: dict, tokenizer, collator: str, max_seq_length: int) -> dict:
    """One record as the trainer sees it: tokens with their trained flag and the counts."""
    from longspec.data import encoding
    from longspec.data.chat import ChatError, end_of_turn_tokens, split_chat

    kinds: list[str] = []
    ids, trained, full = encoding.encode_full(rec, tokenizer, collator, max_seq_length, kinds)
    chat = any(k in ("answer", "end") for k in kinds) or collator == "long_cot"
    untrained_answers = 0
    if chat and collator == "long_data" and ("conversation" in rec or "messages" in rec):
        from longspec.data.collators import messages_of
        try:
            untrained_answers = split_chat(tokenizer, messages_of(
                rec, "conversation" if "conversation" in rec else "messages")).untrained_answers
        except (ChatError, encoding.RecordError):
            pass
    return {"tokens": [[int(i), tokenizer.decode([i]), bool(t)] for i, t in zip(ids, trained)],
            "prompt": sum(not t for t in trained), "trained": sum(trained), "cut": full - len(ids),
            "chat": chat,
            "end_of_turn_trained": (_end_trained(ids, trained, kinds, end_of_turn_tokens(tokenizer))
                                    if chat else None),
            "untrained_answers": untrained_answers}


def _end_trained(ids: list[int], trained: list[bool], kinds: list[str], closing: tuple[int, ...]) -> bool:
    """Whether the last kept answer is followed by a trained end-of-turn token (one of `closing`,
    the template's own; whitespace such as a trained newline after it does not count)."""
    answers = [j for j, k in enumerate(kinds) if k == "answer"]
    if not answers:
        return False
    return any(kinds[j] == "end" and trained[j] and ids[j] in closing
               for j in range(answers[-1] + 1, len(ids)))


def show_records(path: Path, tokenizer, collator: str, max_seq_length: int, count: int,
                 on_bad_record: str = "error") -> list[dict]:
    """The first `count` usable records of a train file, inspected (bad ones: as the build does;
    untrainable ones are skipped, as the build skips them)."""
    from longspec.data import encoding

    out: list[dict] = []
    for index, (line, rec) in enumerate(encoding.read_records(path, on_bad_record)):
        if len(out) >= count:
            break
        try:
            out.append({"index": index, "line": line if isinstance(line, int) else line.short(),
                        **inspect_record(rec, tokenizer, collator, max_seq_length)})
        except encoding.Untrainable:
            continue
        except encoding.RecordError as e:
            if on_bad_record == "error":
                raise encoding.DataError(f"{encoding.where(path, line)}: {e} (collator {collator})") from None
    return out


def system_markup(tokenizer) -> list[int]:
    """The token ids a system turn opens with under the tokenizer's chat template ([] without one)."""
    from longspec.data.chat import SENTINEL, ChatError, render

    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        text = render(tokenizer, [{"role": "system", "content": SENTINEL},
                                  {"role": "user", "content": "x"}])
    except ChatError:
        return []
    head = text.split(SENTINEL)[0] if SENTINEL in text else ""
    bos = tokenizer.bos_token or ""
    head = head[len(bos):] if bos and head.startswith(bos) else head
    return tokenizer(head, add_special_tokens=False)["input_ids"] if head.strip() else []


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return n > 0 and any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


def first_records_check(path: Path, tokenizer, collator: str, max_seq_length: int,
                        on_bad_record: str = "error", count: int = CHECK_RECORDS) -> dict:
    """What the manifest records for `validate`: over the first records, how many are chats,
    how many chats train no end of turn (with the first one's line and the token), how many
    records train a system turn's markup."""
    from longspec.data.chat import end_of_turn_tokens

    records = show_records(path, tokenizer, collator, max_seq_length, count, "skip")
    marker = system_markup(tokenizer)
    chats = [r for r in records if r["chat"]]
    missing = [r for r in chats if not r["end_of_turn_trained"]]
    return {"records": len(records), "chat": len(chats),
            "no_end_of_turn": len(missing),
            "first_no_end_of_turn": missing[0]["line"] if missing else None,
            "end_of_turn": "".join(tokenizer.convert_ids_to_tokens(list(end_of_turn_tokens(tokenizer))))
            if chats else None,
            "system_trained": sum(_contains([i for i, _, t in r["tokens"] if t], marker) for r in records),
            "untrained_answers": sum(r["untrained_answers"] for r in records)}
