"""The prepared-data cache: a stage's train_file tokenized once into memory-mapped files.

    ensure(train_file, target, data_conf, ...)   the cache for these inputs, built when missing or
                                                 stale (under a lock: one process per cache tokenizes,
                                                 the others wait and use what it built)
    build(...)                                   stream, batch-encode (optionally in worker
                                                 processes), write, manifest last
    PreparedDataset                              the cache served as a torch Dataset (memmap)
    default_workers(collator, size)              how many tokenizing processes a file is worth

The cache layout and its state checks live in longspec.formats.prepared (pure, read by `status`).
Tokens and labels come from longspec.data.encoding (encode_records), the single owner of them.
`python -m longspec.prepare` runs `ensure` for a composed stage.
"""
from __future__ import annotations

import collections
import hashlib
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longspec.data.records import DataError
from longspec.formats import datafiles, prepared as P
from longspec.files.atomic import fsync_path

CHUNK_RECORDS = 512          # records per batched tokenizer call / per worker task
LOCK_POLL_S = 2.0


class CacheWriteError(Exception):
    """The cache could not be written (a full disk): a clear message, no half cache."""


class UntrainableRefused(DataError):
    """More records train nothing within max_seq_length than data.max_untrainable_share allows
    (longspec.formats.prepared.untrainable_refusal): refused, exit 1, not unreadable input."""


class _Untrained(str):
    """An encoded record's result when it trains nothing within max_seq_length (its reason)."""


# ----------------------------------------------------------------------------- dataset

class PreparedDataset:
    """A prepared cache, memory-mapped: the same items as encoding.TokenDataset."""

    def __init__(self, folder: Path, man: dict):
        self.folder, self.manifest = folder, man
        build, dtype = man["build"], np.dtype(man["dtype"])
        self.tokens = np.memmap(folder / f"{build}.tokens.bin", dtype=dtype, mode="r")
        self.mask = np.memmap(folder / f"{build}.mask.bin", dtype=np.uint8, mode="r")
        self.offsets = np.memmap(folder / f"{build}.idx", dtype=np.int64, mode="r")
        self.skipped = man.get("skipped", 0)
        self.problems = man.get("problems", [])
        self.untrainable = man.get("untrainable", 0)
        self.untrainable_problems = man.get("untrainable_problems", [])
        self.path = Path(man["key"]["source"])
        self.num_tokens, self.num_label_tokens = man["tokens"], man["trained_tokens"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int):
        import torch

        from longspec.data.encoding import IGNORE

        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = torch.from_numpy(self.tokens[a:b].astype(np.int64))
        trained = torch.from_numpy(self.mask[a:b].astype(bool))
        return {"input_ids": ids, "labels": torch.where(trained, ids, IGNORE)}


# ----------------------------------------------------------------------------- build

class _Writer:
    """Append-only data files under temporary names, hashed as written."""

    def __init__(self, folder: Path, build: str, dtype):
        self.folder, self.build, self.dtype = folder, build, np.dtype(dtype)
        self.names = {"tokens": f"{build}.tokens.bin", "mask": f"{build}.mask.bin", "idx": f"{build}.idx"}
        self.files = {k: open(folder / f".{n}.tmp", "wb") for k, n in self.names.items()}
        self.hashes = {k: hashlib.sha256() for k in self.names}
        self.offset = 0
        self._put("idx", np.zeros(1, dtype=np.int64))

    def _put(self, kind: str, arr: np.ndarray) -> None:
        data = arr.tobytes()
        self.files[kind].write(data)
        self.hashes[kind].update(data)

    def add(self, ids: list[int], trained: list[bool]) -> None:
        self._put("tokens", np.asarray(ids, dtype=self.dtype))
        self._put("mask", np.asarray(trained, dtype=np.uint8))
        self.offset += len(ids)
        self._put("idx", np.asarray([self.offset], dtype=np.int64))

    def commit(self) -> dict[str, dict]:
        """fsync, rename to the final names; returns {name: {size, sha256, stat}} for the manifest."""
        out = {}
        for kind, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            final = self.folder / self.names[kind]
            os.replace(self.folder / f".{self.names[kind]}.tmp", final)
            out[self.names[kind]] = {"size": final.stat().st_size, "sha256": self.hashes[kind].hexdigest()}
        fsync_path(self.folder)
        for name, info in out.items():
            info["stat"] = P.stat_key(self.folder / name)
        return out

    def discard(self) -> None:
        for kind, f in self.files.items():
            f.close()
            (self.folder / f".{self.names[kind]}.tmp").unlink(missing_ok=True)


class _Progress:
    """records, tokens/s and ETA (by bytes read) on stderr, at most a few times a second."""

    def __init__(self, total_bytes: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = max(total_bytes, 1), label, enabled
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def show(self, records: int, tokens: int, done_bytes: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < (0.25 if self.tty else 5.0)):
            return
        self.last = now
        el = max(now - self.t0, 1e-9)
        frac = min(done_bytes / self.total, 1.0)
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(frac * 24)
        text = (f"{self.label} [{bar:<24}] {frac:6.1%} {records:,} records {P.human(tokens / el)} tok/s "
                f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + text, end=end, file=sys.stderr, flush=True)


@dataclass
class Options:
    collator: str
    max_seq_length: int
    on_bad_record: str


def build(train_file: Path, target: str, fields: dict, folder: Path, tokenizer, workers: int = 1,
          progress: bool = True, label: str = "prepare", limit: float = P.UNTRAINABLE_LIMIT) -> dict:
    """Tokenize `train_file` into `folder` (under the caller's lock). Returns the manifest. Records
    with nothing to train are skipped and counted; more than `limit` of them refuse the build."""
    from longspec.data import encoding

    opts = Options(*(fields[k] for k in P.DATA_OPTIONS))
    if opts.collator not in encoding.ENCODERS:
        raise encoding.DataError(f"unknown collator {opts.collator!r}; choose one of {', '.join(encoding.COLLATORS)}")
    try:
        src = datafiles.resolve(fields["source"])          # absolute, as the cache's key names it
    except datafiles.SourceError as e:
        raise encoding.DataError(e.message) from None
    folder.mkdir(parents=True, exist_ok=True)
    _clean_strays(folder, keep=None)
    src_before = [P.stat_key(f) for f in src.files]
    build_id = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    writer = _Writer(folder, build_id, dtype)
    problems: list[str] = []
    untrained: list[str] = []                               # the first untrainable records' FILE:row N
    counts = collections.Counter()
    hist: collections.Counter = collections.Counter()
    fileobj: list = []
    bar = _Progress(src.size, label, progress)
    t0 = time.monotonic()
    try:
        records = encoding.read_records(src.spec, opts.on_bad_record, problems, opened=fileobj.append)
        for line, result in _encoded(records, tokenizer, target, opts, workers):
            if isinstance(result, _Untrained):                 # well-formed, nothing to train: skipped
                counts["untrainable"] += 1
                if len(untrained) < encoding._KEEP_PROBLEMS:
                    untrained.append(f"{encoding.where(train_file, line)}: {result} (collator {opts.collator})")
                continue
            if isinstance(result, str):
                msg = f"{encoding.where(train_file, line)}: {result} (collator {opts.collator})"
                if opts.on_bad_record == "error":
                    raise encoding.DataError(msg)
                problems.append(msg)
                continue
            ids, trained, full = result
            writer.add(ids, trained)
            counts["records"] += 1
            counts["tokens"] += len(ids)
            counts["trained_tokens"] += sum(trained)
            counts["truncated"] += full > len(ids)
            hist[max(len(ids) - 1, 0).bit_length()] += 1
            if counts["records"] % CHUNK_RECORDS == 0:
                bar.show(counts["records"], counts["tokens"], _tell(fileobj))
        tally = {"key": fields, "records": counts["records"], "untrainable": counts["untrainable"],
                 "untrainable_problems": untrained}
        why = P.untrainable_refusal(tally, limit)
        if why is not None:
            raise UntrainableRefused(f"{train_file}: {why}")
        if counts["records"] == 0:
            raise encoding.DataError(f"{train_file}: no usable records for collator {opts.collator} "
                                 f"({len(problems)} bad, {counts['untrainable']} with nothing to train)"
                                 + (f"; first: {(problems or untrained)[0]}" if problems or untrained else ""))
        bar.show(counts["records"], counts["tokens"], bar.total, final=True)
        if [P.stat_key(f) for f in src.files] != src_before:
            raise encoding.DataError(f"{train_file} changed while it was being prepared; run it again")
        files = writer.commit()
    except BaseException:
        writer.discard()
        raise
    man = {"format": P.FORMAT, "key": fields, "build": build_id, "dtype": np.dtype(dtype).name,
           "collator_version": encoding.COLLATOR_VERSION,
           "source": {"size": src.size, "files": [
               {"path": str(f), "size": f.stat().st_size, "stat": st, "sha256": _source_sha(f)}
               for f, st in zip(src.files, src_before)]},
           "records": counts["records"], "tokens": counts["tokens"],
           "trained_tokens": counts["trained_tokens"], "truncated": counts["truncated"],
           "skipped": len(problems), "problems": problems[:encoding._KEEP_PROBLEMS],
           "untrainable": counts["untrainable"], "untrainable_problems": untrained,
           "histogram": [[1 if b == 0 else (1 << (b - 1)) + 1, 1 << b, hist[b]] for b in sorted(hist)],
           "files": files, "seconds": round(time.monotonic() - t0, 3), "created_at": time.time(),
           "chat_check": _chat_check(train_file, tokenizer, opts)}
    from longspec.files.atomic import atomic_write_json

    atomic_write_json(folder / P.MANIFEST, man)       # the commit point
    _clean_strays(folder, keep=build_id)
    return man


def _chat_check(train_file: Path, tokenizer, opts: Options) -> dict | None:
    """The first records' end-of-turn / system-text counts `validate` warns from (longspec.data.preview)."""
    from longspec.data import preview

    try:
        return preview.first_records_check(train_file, tokenizer, opts.collator, opts.max_seq_length)
    except ValueError:
        return None


def _source_sha(path: Path) -> str:
    from longspec.runs.runfolder import cached_sha256

    return cached_sha256(path)


def _tell(fileobj: list) -> int:
    try:
        return fileobj[0].tell()
    except (IndexError, OSError, ValueError, AttributeError):
        return 0


def _clean_strays(folder: Path, keep: str | None) -> None:
    """Remove data files of older or interrupted builds (called under the lock)."""
    man = P.read_manifest(folder) if keep is None else {"build": keep}
    current = (man or {}).get("build")
    for p in folder.iterdir():
        if p.name == P.MANIFEST or (current and p.name.startswith(f"{current}.")):
            continue
        if p.name.endswith((".bin", ".idx", ".tmp")):
            p.unlink(missing_ok=True)


def _encoded(records, tokenizer, target: str, opts: Options, workers: int):
    """(line, (ids, trained, full) or error text) in file order; batched, in workers when asked."""
    chunks = _chunks(records)
    if workers <= 1:
        for chunk in chunks:
            yield from _encode_chunk(chunk, tokenizer, opts)
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")       # a forked Rust tokenizer may deadlock
    with ctx.Pool(workers, initializer=_worker_init, initargs=(target,)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_worker_encode, (chunk, opts)))
            if len(pending) >= 2 * workers:          # bounded: RSS does not grow with the file
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def _chunks(records):
    chunk: list = []
    for item in records:
        chunk.append(item)
        if len(chunk) >= CHUNK_RECORDS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_chunk(chunk: list, tokenizer, opts: Options) -> list:
    from longspec.data.encoding import RecordError, Untrainable, encode_records

    results = encode_records([rec for _, rec in chunk], tokenizer, opts.collator, opts.max_seq_length)
    return [(line, _Untrained(r) if isinstance(r, Untrainable) else str(r) if isinstance(r, RecordError) else r)
            for (line, _), r in zip(chunk, results)]


_WORKER: dict[str, Any] = {}


def _worker_init(target: str) -> None:
    from longspec.data import encoding

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER["tok"] = encoding.load_tokenizer(target)


def _worker_encode(chunk: list, opts: Options) -> list:
    return _encode_chunk(chunk, _WORKER["tok"], opts)


# ----------------------------------------------------------------------------- ensure (locked)

def ensure(train_file: str | Path, target: str, data_conf: dict, tokenizer=None, workers: int = 1,
           progress: bool = True, label: str = "prepare", say=None) -> tuple[PreparedDataset, dict, bool]:
    """The stage's prepared data: (dataset, manifest, built). Checks the cache and, when it is
    missing, stale or corrupt, builds it under a file lock; processes that find the lock held wait
    and then use what the holder built. Raises encoding.DataError for bad data."""
    from filelock import FileLock, Timeout

    from longspec.data import encoding
    from longspec.files.atomic import lock_path

    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    train_file = Path(train_file)
    fields = P.key_fields(train_file, target, data_conf)
    folder = P.cache_dir(fields)
    limit = P.untrainable_limit(data_conf)
    try:
        man = P.check(folder, fields, encoding.COLLATOR_VERSION)
        return _within(PreparedDataset(folder, man), man, limit, train_file), man, False
    except P.CacheProblem:
        pass
    lock = FileLock(str(lock_path(folder)))
    waited = False
    while True:
        try:
            lock.acquire(timeout=LOCK_POLL_S)
            break
        except Timeout:
            if not waited:
                say(f"{label}: another process is preparing {train_file.name}; waiting for it ({folder})")
                waited = True
    try:
        try:
            man = P.check(folder, fields, encoding.COLLATOR_VERSION)      # built while we waited
            return _within(PreparedDataset(folder, man), man, limit, train_file), man, False
        except P.CacheProblem as e:
            why = str(e)
        say(f"{label}: tokenizing {train_file} ({why}) into {folder}")
        tok = tokenizer if tokenizer is not None else encoding.load_tokenizer(target)
        try:
            man = build(train_file, target, fields, folder, tok, workers=workers, progress=progress, label=label,
                        limit=limit)
        except OSError as e:
            if getattr(e, "filename", None) and Path(e.filename) == train_file:
                raise
            raise CacheWriteError(f"cannot write the prepared data under {folder}: {e.strerror or e}; "
                                  "nothing half-written was left (free space, or set LONGSPEC_CACHE_DIR "
                                  "to a larger disk)") from None
        return PreparedDataset(folder, man), man, True
    finally:
        lock.release()


def _within(ds: PreparedDataset, man: dict, limit: float, train_file: Path) -> PreparedDataset:
    """A cache built under a higher data.max_untrainable_share than the stage's now is refused."""
    why = P.untrainable_refusal(man, limit)
    if why is not None:
        raise UntrainableRefused(f"{train_file}: {why}")
    return ds


WORKERS_FROM_BYTES = 32 << 20  # below this, starting worker processes costs more than it saves


def default_workers(collator: str, size: int) -> int:
    """Plain text: one process (the fast tokenizer's batch encode is already parallel).
    Chat collators render templates in Python: one worker per core, up to 8, for big files."""
    if collator == "short_text" or size < WORKERS_FROM_BYTES:
        return 1
    return max(1, min(8, os.cpu_count() or 1))
