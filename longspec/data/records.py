"""Reading a train_file's records: JSON/JSONL (a JSON array streamed in chunks, JSONL line by line
or, for its last records, backwards from its end) and parquet/arrow through formats.datafiles. Every
record is named by where it is (`FILE:LINE` or `SHARD:row N`); a bad one raises DataError naming it,
or is skipped with on_bad_record="skip". longspec.data.encoding re-exports these names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from longspec.formats import datafiles

BAD_RECORD_MODES = ("error", "skip")
ARRAY_CHUNK = 1 << 20  # characters a JSON array file is read by


class DataError(ValueError):
    """Training data that cannot be used; the message names the file (and line)."""


# --------------------------------------------------------------------------- reading

def read_records(path, on_bad_record: str = "error", skipped: list[str] | None = None,
                 opened=None) -> Iterator[tuple[Any, dict]]:
    """Yield (where, record) from a train_file: a JSONL or JSON array file (where = its line), or
    parquet/arrow data as formats.datafiles names it (where = a RowAt: file and row). `where(path, at)`
    is the text that names a record.

    A line that is not valid JSON or not an object raises DataError("<file>:<line>: ...") or,
    with on_bad_record="skip", is left out and its message appended to `skipped`. A source with no
    usable record raises DataError whatever the mode. `opened(reader)`, when given, receives an
    object whose tell() is the bytes read so far (progress).
    """
    if on_bad_record not in BAD_RECORD_MODES:
        raise ValueError(f"on_bad_record must be one of {BAD_RECORD_MODES}, not {on_bad_record!r}")
    try:
        src = datafiles.resolve(path)
    except datafiles.SourceError as e:
        raise DataError(e.message) from None
    if src.table:
        yield from _table_records(src, skipped, opened)
        return
    path = src.files[0]

    def bad(line: int, msg: str) -> None:
        full = f"{path}:{line}: {msg}"
        if on_bad_record == "error":
            raise DataError(full)
        if skipped is not None:
            skipped.append(full)

    n = 0
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading BOM is not an error
            if opened is not None:  # progress: the caller reads f.buffer.tell()
                opened(f.buffer)
            first = f.read(4096).lstrip()
            f.seek(0)
            items = _array_items(path, f) if first.startswith("[") else _jsonl_items(f)
            for line, obj, err in items:
                if err is not None:
                    bad(line, err)
                elif not isinstance(obj, dict):
                    bad(line, f"record is a JSON {type(obj).__name__}, not an object")
                else:
                    n += 1
                    yield line, obj
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if n == 0:
        bad_count = f" ({len(skipped)} bad)" if skipped else ""
        raise DataError(f"{path}: no usable records{bad_count}")


def _table_records(src, skipped, opened):
    """Rows of parquet/arrow data, streamed a record batch at a time (every row is an object)."""
    reader = datafiles.RowReader(src)
    if opened is not None:
        opened(reader)
    n = 0
    try:
        for at, rec in reader:
            n += 1
            yield at, rec
    except datafiles.SourceError as e:
        raise DataError(e.message) from None
    if n == 0:
        raise DataError(f"{src.spec}: no usable records (no rows)")


TAIL_WHOLE = 64 << 20       # tail_records reads a JSON file of up to this many bytes whole
COUNT_CHUNK = 16 << 20      # bytes a line count reads at a time


def tail_records(path, k: int, on_bad_record: str = "error", records: int | None = None
                 ) -> tuple[int, list[tuple[int, Any, dict]]]:
    """(how many records a train_file holds, its last ``k`` as (index, where, record) in order),
    without parsing the rest: parquet and arrow through their footers and last row groups
    (formats.datafiles.tail_rows); a JSONL file read backwards from its end when ``records`` (its
    record count, as heldout.json gives it: the prepared data's) is known, the lines before
    counted only for the line numbers. A JSON array, a small file or an unknown count: read_records
    over the whole file. The same records, `where`s and errors as read_records' last ``k``."""
    from collections import deque

    try:
        src = datafiles.resolve(path)
    except datafiles.SourceError as e:
        raise DataError(e.message) from None
    if src.table:
        try:
            total, rows = datafiles.tail_rows(src, k)
        except datafiles.SourceError as e:
            raise DataError(e.message) from None
        if total == 0:
            raise DataError(f"{src.spec}: no usable records (no rows)")
        return total, rows
    f = src.files[0]
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            array = fh.read(4096).lstrip().lstrip(b"\xef\xbb\xbf").lstrip().startswith(b"[")
    except OSError as e:
        raise DataError(f"{f}: cannot read ({e.strerror or e})") from None
    if records is None or array or size <= TAIL_WHOLE:
        tail: deque = deque(maxlen=k)
        count = 0
        for at, rec in read_records(f, on_bad_record):
            tail.append((count, at, rec))
            count += 1
        return count, list(tail)
    try:
        return records, _jsonl_tail(f, size, k, on_bad_record, records)
    except UnicodeDecodeError as e:
        raise DataError(f"{f}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise DataError(f"{f}: cannot read ({e.strerror or e})") from None


def _jsonl_tail(f: Path, size: int, k: int, on_bad_record: str, records: int) -> list[tuple[int, int, dict]]:
    with open(f, "rb") as fh:
        pos, buf, step = size, b"", 1 << 20
        while pos > 0:
            step = min(step * 2, pos)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf
            lines = buf.split(b"\n")
            if sum(1 for ln in lines[1:] if ln.strip()) >= k:    # lines[0] may have begun before pos
                break
        cut = buf.index(b"\n") + 1 if pos > 0 else 0
        first_line = 1
        fh.seek(0)
        left = pos + cut
        while left > 0:                                        # line numbers: newlines before the tail
            chunk = fh.read(min(COUNT_CHUNK, left))
            if not chunk:
                break
            first_line += chunk.count(b"\n")
            left -= len(chunk)
    found: list[tuple[int, dict]] = []
    for j, raw in enumerate(buf[cut:].split(b"\n")):
        text = raw.decode("utf-8-sig" if pos + cut == 0 and j == 0 else "utf-8")
        if not text.strip():
            continue
        line = first_line + j
        try:
            obj = json.loads(text)
            err = None if isinstance(obj, dict) else f"record is a JSON {type(obj).__name__}, not an object"
        except json.JSONDecodeError as e:
            obj, err = None, f"invalid JSON ({e.msg}, column {e.colno})"
        if err is not None:
            if on_bad_record == "error":
                raise DataError(f"{f}:{line}: {err}")
            continue
        found.append((line, obj))
    found = found[-k:]
    return [(records - len(found) + i, line, obj) for i, (line, obj) in enumerate(found)]


def where(path, at) -> str:
    """The text naming a record read_records gave: `FILE:LINE` or `SHARD:row N`."""
    return str(at) if isinstance(at, datafiles.RowAt) else f"{path}:{at}"


def where_short(path, at) -> str:
    """The same with the file's name alone (evaluation prompts' record ids)."""
    return at.short() if isinstance(at, datafiles.RowAt) else f"{Path(path).name}:{at}"


def _jsonl_items(lines):
    """Stream a JSONL file: (line_no, object or None, error or None)."""
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line), None
        except json.JSONDecodeError as e:
            yield line_no, None, f"invalid JSON ({e.msg}, column {e.colno})"


class _Stream:
    """A text file read in growing chunks, with the line number of any position kept cheaply."""

    def __init__(self, f, chunk: int | None = None):
        self.f, self.chunk = f, chunk or ARRAY_CHUNK
        self.buf, self.eof = "", False
        self.base_line = 1            # line number of buf[0]
        self.seen = (0, 1)            # (offset, its line): offsets asked for mostly grow

    def more(self, keep_from: int) -> int:
        """Drop buf[:keep_from], read the next chunk; returns the shift of every offset."""
        self.base_line += self.buf.count("\n", 0, keep_from)
        self.buf = self.buf[keep_from:]
        block = self.f.read(max(self.chunk, len(self.buf)))   # grows with a record that spans chunks
        self.eof = not block
        self.buf += block
        self.seen = (0, self.base_line)
        return keep_from

    def line_of(self, i: int) -> int:
        at, line = self.seen
        if i < at:
            at, line = 0, self.base_line
        line += self.buf.count("\n", at, i)
        self.seen = (i, line)
        return line


def _array_items(path: Path, f):
    """Elements of a top-level JSON array with the line each starts on, read in chunks (RSS does
    not grow with the file)."""
    dec, ws = json.JSONDecoder(), " \t\r\n"
    st = _Stream(f)
    st.more(0)
    i = st.buf.index("[") + 1

    def skip_ws(i: int) -> int:
        while True:
            while i < len(st.buf) and st.buf[i] in ws:
                i += 1
            if i < len(st.buf) or st.eof:
                return i
            i -= st.more(i)

    def decode(i: int):
        while True:
            try:
                obj, end = dec.raw_decode(st.buf, i)
                if end < len(st.buf) or st.eof:      # a number at the buffer's end may go on
                    return obj, end, i
            except json.JSONDecodeError as e:
                if st.eof:                          # no way to resynchronise inside an array
                    raise DataError(f"{path}:{st.line_of(e.pos)}: invalid JSON ({e.msg})") from None
            i -= st.more(i)

    i = skip_ws(i)
    if i < len(st.buf) and st.buf[i] == "]":
        return
    while True:
        obj, end, i = decode(i)
        yield st.line_of(i), obj, None
        i = skip_ws(end)
        if i < len(st.buf) and st.buf[i] == "]":
            rest = skip_ws(i + 1)
            if rest < len(st.buf):
                raise DataError(f"{path}:{st.line_of(rest)}: text after the closing ']'")
            return
        if i >= len(st.buf) or st.buf[i] != ",":
            raise DataError(f"{path}:{st.line_of(i)}: expected ',' or ']' in the JSON array")
        i = skip_ws(i + 1)
