"""Regeneration's output folder (PROJECT/data/regen/STAGE/): ordered parquet shards and manifest.json.

    part-SSSSSSSS-EEEEEEEE.parquet   the kept rows of source records [S, E), in source order;
                                     written whole (temp file + rename), so a file that exists is
                                     complete; its counts ride in its own footer (COUNTS_KEY), and
                                     so do its failed rows (FAILED_KEY: index, id, reason) and the
                                     record index of each row it holds (INDEX_KEY)
    manifest.json                    what made the rows (target and tokenizer digests, the
                                     source's fingerprint, prompt rule, settings, engine) and the
                                     counts (with the first untrainable rows' ids); a rerun with another source, target or setting is
                                     refused with the reason (or starts over with force)

Resume: the shards cover records [0, E) without a gap; a rerun starts at the last E. Rows come
to `OrderedWriter.put` in any order; it holds them (a bounded reorder buffer: the caller keeps at
most `window` rows in flight) and cuts a shard at every `shard_rows` records, in order.

Failed rows (a request refused for itself, an answer that cannot be read): a rerun asks them again
first (`open_folder` lists them) and `patch_shards` rewrites each shard they belong to with the
rows now made in their source places, so the folder ends as one uninterrupted run writes it. A
failed row counts no tokens (its retry counts them once).
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

from longspec.data.records import DataError
from longspec.data.regen import COLUMNS, META_COLUMNS, Row, output_record
from longspec.formats import datafiles
from longspec.files.atomic import atomic_write_bytes, atomic_write_json
from longspec.runs.regenstate import FORMAT, MANIFEST, target_digest  # one owner: status compares the digest

COUNTS_KEY = b"longspec.regen.counts"
FAILED_KEY = b"longspec.regen.failed"
INDEX_KEY = b"longspec.regen.index"
COUNTS = ("kept", "truncated", "failed", "skipped", "untrainable", "prompt_tokens", "completion_tokens")
FIRST_IDS = 5                    # the first untrainable rows' ids kept with the counts (UNTRAINABLE_IDS)
UNTRAINABLE_IDS = "untrainable_ids"
_SHARD = re.compile(r"part-(\d{8})-(\d{8})\.parquet$")


class RegenRefused(DataError):
    """The folder holds rows made otherwise (another source, target or setting)."""


# ----------------------------------------------------------------------------- fingerprints

def source_fingerprint(train_file) -> dict:
    """The train_file's files with their sizes and content sha256."""
    from longspec.runs.runfolder import cached_sha256

    try:
        files = datafiles.resolve(train_file).files
    except datafiles.SourceError as e:
        raise DataError(e.message) from None
    return {"train_file": str(train_file),
            "files": [{"path": str(f), "size": f.stat().st_size, "sha256": cached_sha256(f)} for f in files]}


def expectations(train_file, target, collator: str, settings: dict, prompt_rule: dict) -> dict:
    """What the manifest must hold for the folder's rows to be reused."""
    from longspec.formats.prepared import tokenizer_fingerprint

    return {"format": FORMAT, "collator": collator, "source": source_fingerprint(train_file),
            "target": {"path": str(target), "digest": target_digest(target)},
            "tokenizer": tokenizer_fingerprint(target), "prompt_rule": prompt_rule, "settings": settings}


def mismatch(old: dict, new: dict) -> str | None:
    """Why rows made under `old` cannot be continued under `new` (None: they can)."""
    if old.get("format") != new["format"]:
        return f"the folder was written by another format ({old.get('format')})"
    if old.get("source") != new["source"]:
        was = {f["path"]: f for f in (old.get("source") or {}).get("files", [])}
        now = {f["path"]: f for f in new["source"]["files"]}
        changed = sorted(Path(p).name for p in set(was) | set(now) if was.get(p) != now.get(p))
        return f"the source changed ({', '.join(changed[:3]) or new['source']['train_file']})"
    if (old.get("target") or {}).get("digest") != new["target"]["digest"]:
        return f"the target changed ({new['target']['path']}: config or weights)"
    if old.get("tokenizer") != new["tokenizer"]:
        return "the target's tokenizer changed"
    if old.get("collator") != new["collator"]:
        return f"the collator changed ({old.get('collator')} -> {new['collator']})"
    if old.get("prompt_rule") != new["prompt_rule"]:
        return "the prompt rule changed (another longspec version)"
    was, now = old.get("settings") or {}, new["settings"]
    diff = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    return f"a setting changed ({'; '.join(diff)})" if diff else None


# ----------------------------------------------------------------------------- the folder

def read_manifest(out: Path) -> dict | None:
    try:
        doc = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def shards(out: Path) -> list[tuple[int, int, Path]]:
    """The complete shards as (start, end, path), by start."""
    found = []
    for p in out.glob("part-*.parquet") if out.is_dir() else ():
        m = _SHARD.match(p.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(found)


def shard_meta(path: Path) -> tuple[dict, list[dict]]:
    """(the shard's counts, its failed rows [{index, id, reason}])."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(str(path)).metadata or {}
    return json.loads(meta.get(COUNTS_KEY, b"{}")), json.loads(meta.get(FAILED_KEY, b"[]"))


def shard_counts(path: Path) -> dict:
    return shard_meta(path)[0]


def refuse_own_output(train_file, out: Path) -> None:
    """A train_file inside the folder being written (after `regenerate --use`) is refused."""
    src = Path(train_file).absolute()
    if src == out or out in src.parents:
        old = (read_manifest(out) or {}).get("source", {}).get("train_file")
        raise RegenRefused(f"train_file {train_file} is the regeneration folder itself"
                           + (f"; its rows were made from {old}: give that as train_file=..." if old else ""))


def open_folder(out: Path, expect: dict, force: bool) -> tuple[int, dict, dict[int, str]]:
    """(the record index a run starts at, the counts of the rows already written, the failed rows
    to ask again {index: reason}); a folder made otherwise is refused, or with force started over
    (its shards removed). A folder made the same way is continued, force or not."""
    old = read_manifest(out)
    parts = shards(out)
    why = mismatch(old, expect) if old is not None else None
    if why and not force:
        raise RegenRefused(f"{out}: {why}; its rows were made otherwise (--force starts over)")
    if old is None and parts and not force:
        raise RegenRefused(f"{out}: shards without a {MANIFEST}; not a regeneration folder this run can continue")
    if why or old is None:
        for _, _, p in parts:
            p.unlink()
        parts = []
    end, totals, retry = 0, new_counts(), {}
    for start, stop, p in parts:
        if start != end:
            raise RegenRefused(f"{out}: records {end}..{start - 1} have no shard (a gap); rerun with --force")
        counts, failed = shard_meta(p)
        add_counts(totals, counts)
        retry.update({int(f["index"]): f.get("reason", "") for f in failed})
        end = stop
    for tmp in out.glob(".part-*.tmp") if out.is_dir() else ():   # a write a kill cut short
        tmp.unlink(missing_ok=True)
    return end, totals, retry


def new_counts() -> dict:
    return {**dict.fromkeys(COUNTS, 0), UNTRAINABLE_IDS: []}


def add_counts(totals: dict, counts: dict) -> None:
    """Add a shard's counts to `totals`; the untrainable rows' ids: the first FIRST_IDS."""
    for k, v in counts.items():
        if k == UNTRAINABLE_IDS:
            totals[k] = (list(totals.get(k) or []) + list(v))[:FIRST_IDS]
        else:
            totals[k] = totals.get(k, 0) + v


def write_manifest(out: Path, expect: dict, engine: dict, totals: dict, records: int | None,
                   done: int, complete: bool, rerun: str | None = None) -> None:
    """The manifest; `engines` lists every engine that wrote rows here (a resume may use another);
    `complete`: every record done and none failed; `rerun`: the command that goes on
    (longspec.runs.regenstate.folder_state reads these for status, --use and the demo)."""
    old = read_manifest(out) or {}
    engines = [e for e in old.get("engines", []) if e != engine] if done else []
    atomic_write_json(out / MANIFEST, {**expect, "engine": engine, "engines": engines + [engine],
                                       "counts": totals, "records": records, "done": done,
                                       "complete": complete, "rerun": rerun,
                                       "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def _arrow_type(pa, column: str):
    if column == "messages":
        return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    return pa.int64() if column.endswith("_tokens") else pa.string()


def write_shard(out: Path, collator: str, start: int, end: int, records: list[dict], counts: dict,
                failed: list[dict], index: list[int]) -> Path:
    """One shard of records [start, end), written whole (temp file, fsync, rename); `index` holds
    each record's source index, `failed` the rows to ask again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = COLUMNS[collator] + META_COLUMNS
    schema = pa.schema([(c, _arrow_type(pa, c)) for c in names],
                       metadata={COUNTS_KEY: json.dumps(counts), FAILED_KEY: json.dumps(failed),
                                 INDEX_KEY: json.dumps(index)})
    table = pa.Table.from_pylist([{c: r.get(c) for c in names} for r in records], schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    path = out / f"part-{start:08d}-{end:08d}.parquet"
    atomic_write_bytes(path, buf.getvalue())
    return path


class OrderedWriter:
    """Rows in, shards out in source order: a row is held until every earlier record is done."""

    def __init__(self, out: Path, collator: str, start: int, shard_rows: int, keep_truncated: bool,
                 totals: dict):
        self.out, self.collator, self.shard_rows = out, collator, shard_rows
        self.keep_truncated = keep_truncated
        self.next = self.shard_start = start          # the next record index to write; the open shard's first
        self.held: dict[int, Row] = {}                # finished rows waiting for an earlier one
        self.records: list[dict] = []
        self.index: list[int] = []                    # the open shard's records' source indices
        self.failed: list[dict] = []                  # the open shard's failed rows
        self.counts = new_counts()
        self.totals = totals
        self.problems: list[str] = []

    def put(self, row: Row) -> None:
        self.held[row.index] = row
        while self.next in self.held:
            self._take(self.held.pop(self.next))
            self.next += 1
            if self.next - self.shard_start >= self.shard_rows:
                self.flush()

    def _take(self, row: Row) -> None:
        take(row, self.counts, self.records, self.index, self.failed, self.collator, self.keep_truncated)
        if row.status in ("failed", "skipped", "untrainable") and len(self.problems) < 20:
            self.problems.append(f"{row.id}: {row.status}: {row.reason}")

    def flush(self) -> None:
        """Write the open shard (the records taken so far), if it covers any record."""
        if self.next == self.shard_start:
            return
        write_shard(self.out, self.collator, self.shard_start, self.next, self.records, self.counts,
                    self.failed, self.index)
        add_counts(self.totals, self.counts)
        self.shard_start, self.records, self.counts = self.next, [], new_counts()
        self.index, self.failed = [], []

    def pending(self) -> dict[str, Any]:
        """The counts including the open shard's (for the progress line)."""
        return {k: self.totals.get(k, 0) + self.counts.get(k, 0) for k in COUNTS}


def take(row: Row, counts: dict, records: list[dict], index: list[int], failed: list[dict], collator: str,
         keep_truncated: bool) -> None:
    """Count a finished row into a shard's counts; its record (kept, or truncated when kept) or its
    failure (index, id, reason: a rerun asks it again) into the shard's lists."""
    counts[row.status] = counts.get(row.status, 0) + 1
    if row.status == "untrainable" and len(counts.setdefault(UNTRAINABLE_IDS, [])) < FIRST_IDS:
        counts[UNTRAINABLE_IDS].append(row.id)
    if row.status == "failed":
        failed.append({"index": row.index, "id": row.id, "reason": row.reason})
        return
    counts["prompt_tokens"] += row.prompt_tokens
    counts["completion_tokens"] += sum(a.tokens for a in row.answers)
    if row.status == "kept" or (row.status == "truncated" and keep_truncated):
        records.append(output_record(row, collator))
        index.append(row.index)


def patch_shards(out: Path, collator: str, keep_truncated: bool, rows: list[Row], totals: dict) -> list[str]:
    """Put rows asked again (a shard's failed rows, any status now but pending) into their shards,
    each rewritten whole with its records in source order; `totals` follows. The rows' problems."""
    import pyarrow.parquet as pq

    redone = {r.index: r for r in rows if r.status != "pending"}
    problems = []
    for start, end, path in shards(out):
        counts, failed = shard_meta(path)
        mine = [redone[f["index"]] for f in failed if f["index"] in redone]
        if not mine:
            continue
        meta = pq.read_schema(str(path)).metadata or {}
        index = json.loads(meta.get(INDEX_KEY, b"[]"))
        records = pq.read_table(str(path)).to_pylist()
        if len(index) != len(records):
            raise RegenRefused(f"{path}: its rows carry no source index (an older longspec wrote it); rerun with --force")
        failed = [f for f in failed if f["index"] not in redone]
        now = dict(counts, failed=counts.get("failed", 0) - len(mine))
        now[UNTRAINABLE_IDS] = list(counts.get(UNTRAINABLE_IDS) or [])
        for row in mine:
            take(row, now, records, index, failed, collator, keep_truncated)
            if row.status in ("failed", "skipped", "untrainable"):
                problems.append(f"{row.id}: {row.status}: {row.reason}")
        order = sorted(range(len(index)), key=index.__getitem__)
        write_shard(out, collator, start, end, [records[k] for k in order], now,
                    sorted(failed, key=lambda f: f["index"]), [index[k] for k in order])
        for k in COUNTS:
            totals[k] = totals.get(k, 0) + now.get(k, 0) - counts.get(k, 0)
        fresh = [i for i in now[UNTRAINABLE_IDS] if i not in (counts.get(UNTRAINABLE_IDS) or [])]
        add_counts(totals, {UNTRAINABLE_IDS: fresh})
    return problems
