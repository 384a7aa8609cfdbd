"""Evaluation prompts from training records: the question of a chat, prefixes of a document.

A stage's draft is measured where speculative decoding runs in service: from the question.

* Chat and chain-of-thought records (`messages` / `conversation`, `problem` + `qwq`,
  `prompt` + `response`, `article` + `abstract`): the conversation up to its last user turn,
  rendered through the target's chat template with the generation prompt (question_text); the
  record's own answer is the reference, never part of the prompt. Decoding stops at the
  template's end-of-turn token or the EOS, as a server would, or at the new-token limit.
* Documents (`text`, `source: code/book`): the first L tokens for every context length L of the
  measurement the document is longer than; decoding continues the document.
* `--prompts FILE` entries (strings or {"prompt": ...}) are used whole; training-style records in
  it are turned into prompts as above.

Held-out records are the ones the stage's run never drew (trained_indices replays the trainer's
sampler). Every prompt carries the record it came from (the file's line), its kind and its
new-token limit (DEFAULT_NEW_TOKENS, or --max-new-tokens).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.data.chat import end_of_turn_ids  # noqa: F401  (moved to data/chat.py; used here and re-exported)

# New tokens per prompt kind when --max-new-tokens is not given: upstream measures LongBench with
# 1,024 and AIME with 200 (sail-sg/LongSpec longspec/test). Documents and chats follow LongBench,
# chain-of-thought questions AIME; never more than an eighth of the stage's max_seq_length
# (NEW_TOKENS_SHARE), so a small stage's continuation stays near the length it was trained at.
DEFAULT_NEW_TOKENS = {"document": 1024, "chat": 1024, "longbench": 1024, "cot": 200, "aime": 200, "given": 1024}
NEW_TOKENS_SHARE = 8
MIN_NEW_TOKENS = 32
MIN_CONTEXT = 8
# Prompts per length bucket when --num-prompts is not given: a budget of prompt tokens, so
# short-context stages get many prompts (tau varies a lot from prompt to prompt) and 32k stages stay affordable.
PROMPT_TOKEN_BUDGET = 4096
MIN_PROMPTS, MAX_PROMPTS = 8, 32
SYSTEM_PROMPT = "You are a helpful assistant"   # upstream's benchmark scripts' system turn


class PromptError(Exception):
    """An unusable prompt source; `code` is the exit code (2 usage, 3 unreadable input)."""

    def __init__(self, message: str, code: int = 3, hint: str | None = None):
        super().__init__(message)
        self.message, self.code, self.hint = message, code, hint


@dataclass
class Prompt:
    ids: list[int]
    record: str                      # where it came from: "FILE:LINE" or a benchmark id
    kind: str                        # a DEFAULT_NEW_TOKENS key
    max_new: int = 0                 # filled by limit_new_tokens
    task: str | None = None          # a benchmark's task
    bucket: int | None = None        # its context-length bucket (longspec.measure.report.bucket_of)
    stops: tuple[int, ...] = field(default_factory=tuple)


# ----------------------------------------------------------------------------- chat split

def question_text(tokenizer, messages: list[dict]) -> str:
    """The conversation up to (and with) its last user turn, rendered with the generation prompt
    through the tokenizer's chat template: what a server is sent before the model answers, and the
    prompt the training rule (longspec.data.chat) gives the answer that follows."""
    from longspec.data.chat import ChatError, render

    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise PromptError("the conversation has no user turn")
    try:
        return render(tokenizer, messages[: last + 1], generation_prompt=True)
    except ChatError as e:
        raise PromptError(str(e)) from None


CHAT_FIELDS = ("messages", "conversation", "article")
COT_FIELDS = ("problem", "qwq", "prompt", "response")


def record_messages(rec: dict) -> tuple[list[dict], str] | None:
    """(messages, kind) of a chat or chain-of-thought record, None for a document: the
    conversation the stage's collator trains (longspec.data.collators), so evaluation asks the question
    the draft was trained to answer."""
    from longspec.data.collators import RecordError, long_cot_messages, long_data_messages

    if not isinstance(rec, dict):
        return None
    try:
        if any(k in rec for k in COT_FIELDS) and not any(k in rec for k in CHAT_FIELDS):
            return long_cot_messages(rec), "cot"
        if not any(k in rec for k in CHAT_FIELDS) and rec.get("source") not in ("arxiv", "tulu-v2"):
            return None
        msgs = long_data_messages(rec)
    except RecordError as e:
        raise PromptError(str(e)) from None
    return None if msgs is None else (msgs, "chat")


def document_text(rec: Any) -> str | None:
    if isinstance(rec, str):
        return rec
    if isinstance(rec, dict):
        for name in ("text", "target"):
            if isinstance(rec.get(name), str):
                return rec[name]
    return None


def record_prompts(rec: Any, where: str, tokenizer, lengths: list[int], stops: tuple[int, ...],
                   short_whole: bool = False) -> list[Prompt]:
    """The prompts one training record gives: its question, or its prefixes at each length;
    ``short_whole``: a document not longer than the smallest length, whole (at its own length)."""
    conv = record_messages(rec)
    if conv is not None:
        messages, kind = conv
        try:
            text = question_text(tokenizer, messages)
        except PromptError:
            return []
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return [Prompt(ids, where, kind, stops=stops)] if len(ids) >= MIN_CONTEXT else []
    text = document_text(rec)
    if text is None:
        return []
    ids = tokenizer(text)["input_ids"]      # the tokenizer's own specials, as the trainer encodes documents
    eos = tokenizer.eos_token_id
    stop = () if eos is None else (int(eos),)
    if short_whole and MIN_CONTEXT <= len(ids) <= lengths[0]:
        return [Prompt(ids, where, "document", stops=stop)]
    return [Prompt(ids[:n], where, "document", stops=stop) for n in lengths if len(ids) > n >= MIN_CONTEXT]


def default_num_prompts(context_tokens: int, buckets: int = 1) -> int:
    """Prompts for a length bucket: its share of PROMPT_TOKEN_BUDGET tokens, MIN_PROMPTS to MAX_PROMPTS."""
    return max(MIN_PROMPTS, min(MAX_PROMPTS, PROMPT_TOKEN_BUDGET // max(1, buckets * context_tokens)))


def measured_prompts(prompts: list[Prompt], lengths: list[int], max_new: int | None,
                     max_seq: int) -> tuple[list[Prompt], int]:
    """(the prompts a measurement decodes, how many were longer than every length): each with its
    new-token limit (limit_new_tokens) and its length bucket (longspec.measure.report.bucket_of)."""
    from longspec.measure.report import bucket_of

    limit_new_tokens(prompts, max_new, max_seq)
    for p in prompts:
        p.bucket = bucket_of(len(p.ids), lengths)
    kept = [p for p in prompts if p.bucket is not None]
    return kept, len(prompts) - len(kept)


def default_prompts(path: Path, tokenizer, conf: dict, steps: int | None, *, lengths: list[int] | None = None,
                    num_prompts: int | None = None, max_new: int | None = None) -> tuple[list[Prompt], dict, list[int]]:
    """A stage's measurement from its own records: `eval`'s default one (and, with the run's step
    count, what the trainer's simulated tau decodes: longspec.measure.chainwalk). (prompts with limits
    and buckets, info, lengths); the arguments are eval's --lengths, --num-prompts, --max-new-tokens."""
    from longspec.measure.report import default_lengths
    from longspec.project.stageview import StageView

    max_seq = StageView.of(conf).max_seq_length
    lengths = lengths or default_lengths(max_seq)
    per = {n: num_prompts or default_num_prompts(n, len(lengths)) for n in lengths}
    prompts, info = stage_prompts(path, tokenizer, conf, steps, lengths=lengths, per_length=per)
    prompts, info["prompts_over_longest"] = measured_prompts(prompts, lengths, max_new, max_seq)
    return prompts, info, lengths


def limit_new_tokens(prompts: list[Prompt], max_new: int | None, max_seq: int) -> None:
    """Each prompt's new-token limit: --max-new-tokens, else its kind's default within an eighth
    of the stage's max_seq_length (MIN_NEW_TOKENS at least)."""
    cap = max(MIN_NEW_TOKENS, max_seq // NEW_TOKENS_SHARE)
    for p in prompts:
        p.max_new = max_new or min(DEFAULT_NEW_TOKENS.get(p.kind, 1024), cap)


# ----------------------------------------------------------------------------- held-out records

def trained_indices(n: int, conf: dict, steps: int | None) -> set[int] | None:
    """Record indices the stage's run drew, replaying the trainer's own sampler
    (longspec.data.encoding.ShardedBatchSampler: seeded shuffle per epoch, dealt over ranks); None when
    that cannot be known (records skipped as bad or untrainable, unknown step count or batch layout)."""
    from longspec.data.encoding import ShardedBatchSampler
    from longspec.project.stageview import StageView

    view = StageView.of(conf)
    batch, accum = view.per_gpu_train_batch_size, view.gradient_accumulation_steps
    glob, seed = conf_get(conf, "global_batch_size"), view.seed
    if view.on_bad_record != "error" or skipped_untrainable(conf) \
            or not isinstance(steps, int) or steps < 0 \
            or not isinstance(batch, int) or not isinstance(accum, int) or batch < 1 or accum < 1:
        return None
    world = glob // (batch * accum) if isinstance(glob, int) and glob >= batch * accum else 1
    held = heldout_of(conf)
    if held is not None and isinstance(held.get("start"), int) and 0 < held["start"] <= n:
        n = held["start"]                     # the sampler deals only the records before the held-out ones
    seen: set[int] = set()
    left, epoch = steps * accum, 0                        # micro-batches each rank took
    while left > 0 and len(seen) < n:
        order = ShardedBatchSampler.epoch_order(n, seed, epoch, world)    # one shuffle for every rank
        take = min(left, math.ceil(len(order) // world / batch))
        for rank in range(world):
            seen.update(order[rank::world][:take * batch])
        left -= take
        epoch += 1
    return seen


def heldout_of(conf: dict) -> dict | None:
    """The stage's run's heldout.json (longspec.training.simtau writes it), None without one."""
    from longspec.runs import runfolder

    out = conf_get(conf, "output_dir")
    held, _ = runfolder.read_json(Path(out) / runfolder.HELDOUT) if out else (None, None)
    return held if isinstance(held, dict) else None


def skipped_untrainable(conf: dict) -> bool:
    """Whether the stage's prepared data left out records with nothing to train (its cache's
    manifest says so): its record indices are then not the train_file's."""
    from longspec.formats import prepared as P

    train, target = conf_get(conf, "train_file"), conf_get(conf, "model_name_or_path")
    if not (isinstance(train, str) and isinstance(target, str)):
        return False
    try:
        man = P.read_manifest(P.cache_dir(P.key_fields(train, target, conf_get(conf, "data"))))
    except OSError:
        return False
    return bool((man or {}).get("untrainable"))


def records_of(conf: dict) -> int | None:
    """The stage's record count as its run's heldout.json gives it (the held-out records are the
    last ones of the prepared data), None without one."""
    held = heldout_of(conf)
    if held is None:
        return None
    start, n = held.get("start"), held.get("records")
    return start + n if isinstance(start, int) and isinstance(n, int) and start > 0 and n > 0 else None


def stage_prompts(path: Path, tokenizer, conf: dict, steps: int | None, *, lengths: list[int],
                  per_length: dict[int, int]) -> tuple[list[Prompt], dict]:
    """Prompts from the newest records of the stage's data its run never drew (then drawn ones
    when too few are left), until every length bucket holds its share (per_length). Only the last
    records are read (longspec.data.records.tail_records), so this costs the same at any data size."""
    from longspec.data.records import DataError, tail_records, where_short
    from longspec.project.stageview import StageView

    want = max(256, 16 * sum(per_length.values()))
    try:
        known = None if skipped_untrainable(conf) else records_of(conf)     # the prepared count is not the file's
        count, last = tail_records(path, want, StageView.of(conf).on_bad_record, known)
    except (DataError, OSError) as e:
        raise PromptError(f"{path}: {e}", 3 if not isinstance(e, FileNotFoundError) else 2) from None
    tail = [(i, where_short(path, at), rec) for i, at, rec in last]
    seen = trained_indices(count, conf, steps)
    stops = end_of_turn_ids(tokenizer)
    prompts, fresh = _pick(tail, seen, path, tokenizer, lengths, per_length, stops, False)
    short = None
    if not prompts:          # every document shorter than the smallest length: each at its own length
        prompts, fresh = _pick(tail, seen, path, tokenizer, lengths, per_length, stops, True)
        if prompts:
            short = (f"every document is at most {lengths[0]} tokens (the smallest length): measured whole, "
                     f"in the {lengths[0]}-token bucket")
    if not prompts:
        raise PromptError(f"{path}: no record gives a prompt of at most {max(lengths)} tokens "
                          f"(collator {StageView.of(conf).collator}): a document gives "
                          f"its prefixes at each length it is longer than ({', '.join(map(str, lengths))}), "
                          f"a chat or chain-of-thought record its question", 3,
                          hint="--lengths sets the lengths (e.g. --lengths 256,512)")
    n_drawn = len(prompts) - len(fresh)
    info = {"prompt_source": str(path), "records": count,
            "records_drawn_in_training": None if seen is None else len(seen),
            "prompts_drawn_in_training": None if seen is None else n_drawn,
            "heldout_check": "replayed the trainer's sampler" if seen is not None else "not possible (unverified)"}
    if short:
        info["short_documents"] = short
    return prompts, info


def _pick(tail, seen, path: Path, tokenizer, lengths, per_length, stops, short_whole: bool):
    """(prompts in file order, the fresh ones): newest never-drawn records first, drawn ones fill the rest."""
    from longspec.measure.report import bucket_of

    fresh: list[Prompt] = []
    drawn: list[Prompt] = []
    left = dict(per_length)
    left_drawn = dict(per_length)
    for idx, line, rec in reversed(tail):
        was_drawn = seen is not None and idx in seen
        for p in record_prompts(rec, line, tokenizer, lengths, stops, short_whole):
            b = bucket_of(len(p.ids), lengths)
            room = left_drawn if was_drawn else left
            if b is not None and room.get(b, 0) > 0:
                room[b] -= 1
                (drawn if was_drawn else fresh).append(p)
        if not any(left.values()):
            break
    prompts = list(fresh)
    for p in drawn:                                   # drawn records only fill what fresh ones left
        b = bucket_of(len(p.ids), lengths)
        if left.get(b, 0) > 0:
            left[b] -= 1
            prompts.append(p)
    prompts.reverse()                                 # file order
    return prompts, fresh


# ----------------------------------------------------------------------------- --prompts FILE

def read_prompt_file(path: Path) -> list[tuple[int, Any]]:
    """A --prompts file: (line or item number, entry) from a JSON list or JSONL (blank lines skipped)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PromptError(f"{path}: no such file", 2) from None
    except OSError as e:
        raise PromptError(f"{path}: cannot read ({e})", 3) from None
    return parse_prompt_text(raw, path)


def parse_prompt_text(raw: bytes, name) -> list[tuple[int, Any]]:
    """read_prompt_file's entries from a file's bytes (`name` for messages: a path, ZIP:MEMBER)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{name}: cannot read ({e})", 3) from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise PromptError(f"{name}: not valid JSON ({e})", 3) from None
        return list(enumerate(data, 1))
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((i, json.loads(line)))
            except ValueError as e:
                raise PromptError(f"{name}:{i}: not valid JSON ({e})", 3) from None
    return out


def whole_prompt(rec: Any) -> str | None:
    """A --prompts entry used as is: a string, or {"prompt": ...} without a response."""
    if isinstance(rec, str):
        return rec
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and "response" not in rec:
        return rec["prompt"]
    return None


def file_prompts(path: Path, tokenizer, *, lengths: list[int], n: int | None) -> tuple[list[Prompt], dict]:
    """--prompts: whole prompts as given; training-style records turned into prompts (record_prompts)."""
    stops = end_of_turn_ids(tokenizer)
    prompts: list[Prompt] = []
    for line, rec in read_prompt_file(path):
        whole = whole_prompt(rec)
        if whole is not None:
            ids = tokenizer(whole)["input_ids"]
            made = [Prompt(ids, f"{path.name}:{line}", "given", stops=stops)] if ids else []
        elif isinstance(rec, dict):
            made = record_prompts(rec, f"{path.name}:{line}", tokenizer, lengths, stops)
            if not made and record_messages(rec) is None and document_text(rec) is None:
                raise PromptError(f"{path}:{line}: not a prompt nor a training record", 3)
        else:
            raise PromptError(f"{path}:{line}: must be a string or an object", 3)
        prompts += made
    if n is not None:
        prompts = prompts[:n]
    if not prompts:
        raise PromptError(f"{path}: no prompts", 3)
    return prompts, {"prompt_source": str(path)}


def conf_get(conf: dict, dotted: str, default: Any = None) -> Any:
    node: Any = conf
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
