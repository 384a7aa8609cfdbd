"""Training data: the label rule, padding, loaders; the readers of a train_file's records are
longspec.data.records (re-exported here).

A sample is {"input_ids": (T,) long, "labels": (T,) long}; labels[t] is input_ids[t] where the
token is trained and -100 where it is not (unshifted, Hugging Face style: the loss shifts).

The collators (the `data.collator` key: short_text, long_data, long_cot) live in
longspec.data.collators; what a chat record trains (answers and their end of turn, never system,
user or header text) in longspec.data.chat. Plain stage-1 documents end with the tokenizer's EOS
(upstream's `text + eos_token`); stage-2 code/book documents get none, as upstream.

What is trained is decided by position, never by token id: a piece's kind says whether its tokens
are trained, and padding (added by `collate`, past each sample's end) never is. The reference
trainer drops every label equal to the pad id instead; with a pad that is also a real token
(pad = EOS, pad = the end of turn `<|im_end|>`, no pad at all so that the EOS pads) that left the
answers' end of turn or the documents' end untrained. Here they are trained whatever the pad.
"""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from longspec.data.collators import ENCODERS, RecordError, Untrainable  # noqa: F401  (re-exported)
from longspec.data.records import BAD_RECORD_MODES, DataError, read_records, where  # noqa: F401  (re-exported)

IGNORE = -100
# Bump whenever the tokens or labels a collator produces change: prepared caches made by an
# older rule are then rebuilt (it is part of their key).
COLLATOR_VERSION = 5  # 5: labels by position (a real token equal to the pad id is trained)
COLLATORS = ("short_text", "long_data", "long_cot")
_KEEP_PROBLEMS = 20  # skipped-record messages kept for the log


# --------------------------------------------------------------------------- encoding

def load_tokenizer(path) -> Any:
    """The target's tokenizer as the trainer uses it (pad = EOS when it has none, as the reference
    configs set); DataError when the folder has no usable one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"model_name_or_path = {path}: no usable tokenizer ({str(e).splitlines()[0]})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _encode_plan(rec: dict, tokenizer, collator: str):
    """A record's pieces and how each is tokenized: (pieces, add_eos, [special tokens per piece])."""
    pieces, plain, add_eos = ENCODERS[collator](rec, tokenizer)
    return pieces, add_eos, [plain and i == 0 for i in range(len(pieces))]


def encode_record(rec: dict, tokenizer, collator: str, max_seq_length: int,
                  kinds: list[str] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and their trained flags for one record (RecordError if it does not fit);
    `kinds`, when given, receives each kept token's piece kind (longspec.data.collators)."""
    ids, trained, _ = encode_full(rec, tokenizer, collator, max_seq_length, kinds)
    return ids, trained


def encode_full(rec: dict, tokenizer, collator: str, max_seq_length: int,
                kinds: list[str] | None = None) -> tuple[list[int], list[bool], int]:
    """encode_record plus the length before the prompt cap and truncation."""
    pieces, add_eos, special = _encode_plan(rec, tokenizer, collator)
    toks = [tokenizer(text, add_special_tokens=sp)["input_ids"] for (text, _), sp in zip(pieces, special)]
    return assemble(pieces, toks, add_eos, tokenizer.eos_token_id, max_seq_length, kinds)


def untrainable(rec: dict, tokenizer, collator: str, max_seq_length: int) -> str | None:
    """Why a well-formed record trains nothing within max_seq_length (assemble's rule, which
    `prepare` applies too), None when it trains a token; RecordError for a malformed record."""
    try:
        encode_full(rec, tokenizer, collator, max_seq_length)
    except Untrainable as e:
        return str(e)
    return None


def encode_records(recs: list[dict], tokenizer, collator: str,
                   max_seq_length: int) -> list[tuple[list[int], list[bool], int] | RecordError]:
    """encode_record for many records with one batched tokenizer call per special-token mode:
    (ids, trained, untruncated length) per record, or its RecordError. Same tokens as encode_record."""
    rendered: list = []
    texts: dict[bool, list[str]] = {True: [], False: []}
    for rec in recs:
        try:
            pieces, add_eos, special = _encode_plan(rec, tokenizer, collator)
        except RecordError as e:
            rendered.append(e)
            continue
        slots = []
        for (text, _), sp in zip(pieces, special):
            slots.append((sp, len(texts[sp])))
            texts[sp].append(text)
        rendered.append((pieces, add_eos, slots))
    encoded = {special: tokenizer(batch, add_special_tokens=special)["input_ids"] if batch else []
               for special, batch in texts.items()}
    eos = tokenizer.eos_token_id
    out: list = []
    for item in rendered:
        if isinstance(item, RecordError):
            out.append(item)
            continue
        pieces, add_eos, slots = item
        try:
            out.append(assemble(pieces, [encoded[s][j] for s, j in slots], add_eos, eos, max_seq_length))
        except RecordError as e:
            out.append(e)
    return out


def assemble(pieces, toks: list[list[int]], add_eos: bool, eos: int | None,
             max_seq_length: int, kinds: list[str] | None = None) -> tuple[list[int], list[bool], int]:
    """The one label rule, by position: pieces' tokens in order, prompt pieces capped, EOS appended
    where the collator asks (a document boundary, as the reference adds), "prompt" pieces untrained
    and every other token trained (whatever its id: the pad id too), truncated. Untrainable when no
    token after the first is trained (the loss shifts: the first token is never predicted).
    Returns (ids, trained, length before the prompt cap and truncation)."""
    ids: list[int] = []
    trained: list[bool] = []
    kind_of: list[str] = []
    full = 0
    for (_, kind), piece in zip(pieces, toks):
        full += len(piece)
        if kind == "prompt":
            piece = _cap_prompt(piece, max_seq_length)
        ids += piece
        trained += [kind != "prompt"] * len(piece)
        kind_of += [kind] * len(piece)
    if add_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)                               # a document boundary, as the reference adds
        trained.append(True)
        kind_of.append("text")
        full += 1
    ids, trained = ids[:max_seq_length], trained[:max_seq_length]
    if kinds is not None:
        kinds[:] = kind_of[:max_seq_length]
    if not any(trained[1:]):
        raise Untrainable(f"no trained tokens within max_seq_length={max_seq_length}")
    return ids, trained, full


def _cap_prompt(toks: list[int], max_seq_length: int) -> list[int]:
    """Keep room for the answer: a prompt longer than the cap keeps its head and its tail
    (the tail holds the assistant header the answer follows)."""
    cap = max_seq_length - min(1024, max_seq_length // 2)
    if len(toks) <= cap:
        return toks
    tail = min(cap // 2, 64)
    return toks[: cap - tail] + toks[len(toks) - tail:]


# --------------------------------------------------------------------------- dataset

class TokenDataset(Dataset):
    """Pre-tokenized samples; `skipped` bad records, `problems` their first messages."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]], skipped: int,
                 problems: list[str], path: Path):
        self.samples = samples  # [(ids (T,) int32, trained (T,) bool)]
        self.skipped = skipped
        self.problems = problems
        self.path = path
        self.num_tokens = sum(len(ids) for ids, _ in samples)
        self.num_label_tokens = sum(int(m.sum()) for _, m in samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, trained = self.samples[i]
        ids = ids.long()
        return {"input_ids": ids, "labels": torch.where(trained, ids, IGNORE)}


def build_dataset(path, tokenizer, collator: str, max_seq_length: int,
                  on_bad_record: str = "error") -> TokenDataset:
    """Read and tokenize a whole train_file (read_records) for one stage's collator."""
    if collator not in ENCODERS:
        raise DataError(f"unknown collator {collator!r}; choose one of {', '.join(COLLATORS)}")
    if on_bad_record not in BAD_RECORD_MODES:
        raise DataError(f"on_bad_record must be one of {', '.join(BAD_RECORD_MODES)}, "
                        f"not {on_bad_record!r}")
    if not isinstance(max_seq_length, int) or max_seq_length < 1:
        raise DataError(f"max_seq_length must be a positive integer, not {max_seq_length!r}")
    path = Path(path)
    problems: list[str] = []
    samples = []
    untrained = 0
    for line, rec in read_records(path, on_bad_record, problems):
        try:
            ids, trained = encode_record(rec, tokenizer, collator, max_seq_length)
        except Untrainable:
            untrained += 1                    # skipped and counted whatever on_bad_record says, as prepare does
            continue
        except RecordError as e:
            msg = f"{where(path, line)}: {e} (collator {collator})"
            if on_bad_record == "error":
                raise DataError(msg) from None
            problems.append(msg)
            continue
        samples.append((torch.tensor(ids, dtype=torch.int32), torch.tensor(trained)))
    if not samples:
        raise DataError(f"{path}: no usable records for collator {collator} "
                        f"({len(problems)} bad, {untrained} with nothing to train within max_seq_length="
                        f"{max_seq_length})" + (f"; first: {problems[0]}" if problems else ""))
    ds = TokenDataset(samples, len(problems), problems[:_KEEP_PROBLEMS], path)
    ds.untrainable = untrained
    return ds


# --------------------------------------------------------------------------- batching

def collate(batch: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids, labels (-100 on padding: by position, whatever
    the pad id), attention_mask (B, T)."""
    width = max(len(s["input_ids"]) for s in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
    for b, s in enumerate(batch):
        n = len(s["input_ids"])
        input_ids[b, :n] = s["input_ids"]
        labels[b, :n] = s["labels"]
        attention_mask[b, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class ShardedBatchSampler(Sampler):
    """This rank's batches of one epoch: a seeded shuffle of all indices (the same on every
    rank), padded by wrap-around to a multiple of world_size, dealt round-robin, then batched.

    Each full pass moves to the next epoch; `set_epoch(e, skip_batches=n)` jumps (resume).
    `len()` is the full epoch's batch count, skipped batches included.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, epoch: int = 0, skip_batches: int = 0):
        if num_samples < 1:
            raise ValueError("no samples to batch")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        self.n, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.set_epoch(epoch, skip_batches)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, not {skip_batches}")
        self.epoch, self.skip_batches = epoch, skip_batches

    @staticmethod
    def epoch_order(n: int, seed: int, epoch: int, world_size: int) -> list[int]:
        """Every rank's indices of one epoch, interleaved: rank r's are order[r::world_size]."""
        order = list(range(n))
        random.Random(f"longspec-data-{seed}-{epoch}").shuffle(order)
        total = math.ceil(n / world_size) * world_size
        return order + order[:total - n]

    def epoch_indices(self, epoch: int) -> list[int]:
        return self.epoch_order(self.n, self.seed, epoch, self.world_size)[self.rank::self.world_size]

    def __len__(self) -> int:
        return math.ceil(math.ceil(self.n / self.world_size) / self.batch_size)

    def __iter__(self):
        mine, skip = self.epoch_indices(self.epoch), self.skip_batches
        self.skip_batches = 0
        for start in range(skip * self.batch_size, len(mine), self.batch_size):
            yield mine[start:start + self.batch_size]
        self.epoch += 1


def make_loader(dataset: Dataset, batch_size: int, seed: int, rank: int, world_size: int,
                pad_token_id: int, skip_batches: int = 0, epoch: int = 0) -> DataLoader:
    """A DataLoader over this rank's shard; `loader.batch_sampler.set_epoch(...)` to steer."""
    sampler = ShardedBatchSampler(len(dataset), batch_size, seed, rank, world_size, epoch,
                                  skip_batches)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                      collate_fn=functools.partial(collate, pad_token_id=pad_token_id))
