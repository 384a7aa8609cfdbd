"""Training data as users download it: which files a `train_file` names, their format, their columns.

A train_file is one of
  FILE                 JSON array / JSON lines text, a parquet file or an arrow file (the first
                       bytes decide, not the name)
  FOLDER               parquet shards (FOLDER/*.parquet, one split: the hub's data/train-*.parquet),
                       or a folder written by `datasets`' save_to_disk (state.json names its arrow
                       files; a DatasetDict's folder: its `train` split, or its only one)
  GLOB                 parquet or arrow shards, e.g. /data/SlimPajama-6B/data/train-*.parquet

Pure: pyarrow is imported only when a parquet/arrow file's schema or rows are read (`columns`,
`iter_rows`), so `validate` on JSONL data never loads it. Rows are streamed a record batch at a
time (parquet: one row group read at a time), so memory does not grow with the set. A row is the
record a JSONL line would be: its columns, a null left out (the key a JSON object lacked when
`datasets` unified the objects' keys into columns), inside structs too.
"""

from __future__ import annotations

import codecs
import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

JSON, PARQUET, ARROW = "json", "parquet", "arrow"
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"
SNIFF_BYTES = 4096
SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
PYARROW_HINT = "pip install 'longspec[train]' (pyarrow reads parquet and arrow files)"

# The columns (fields) each collator reads: a record holding every field of one alternative fits
# (longspec.data.collators applies them record by record; tests/trainer/test_data.py holds the two together).
COLLATOR_COLUMNS: dict[str, tuple[tuple[str, ...], ...]] = {
    "short_text": (("text",), ("target",)),
    "long_data": (("text",), ("article", "abstract"), ("conversation",), ("messages",)),
    "long_cot": (("problem", "qwq"), ("prompt", "response")),
}


class SourceError(ValueError):
    """A train_file (or benchmark file) that names no readable data; the message names the path."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class Source:
    spec: Path                      # the train_file as given
    kind: str                       # json | parquet | arrow
    files: tuple[Path, ...]         # in reading order

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    @property
    def table(self) -> bool:
        return self.kind != JSON


class RowAt(NamedTuple):
    """Where a table row is: its file and its 0-based row number there (as `datasets` indexes)."""
    file: Path
    row: int

    def __str__(self) -> str:
        return f"{self.file}:row {self.row}"

    def short(self) -> str:
        return f"{self.file.name}:row {self.row}"


def has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def names_data(path: str | Path) -> bool:
    """Whether the path names something to read (a file, a folder, a glob that matches): the
    details of what is wrong with it come from `resolve`."""
    text = str(path)
    return Path(text).exists() or (has_glob(text) and bool(glob.glob(text)))


def sniff(path: Path) -> str:
    """json | parquet | arrow from a file's first bytes; SourceError for a binary file of another kind."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{path}: is a folder, not a data file") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from None
    if head.startswith(PARQUET_MAGIC):
        return PARQUET
    if head.startswith(ARROW_FILE_MAGIC) or head.startswith(ARROW_STREAM_MAGIC):
        return ARROW
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e.reason}), nor a parquet or arrow file",
                          "give JSON/JSONL text, parquet files or a save_to_disk folder") from None
    if b"\x00" in head:
        raise SourceError(f"{path}: a binary file, not JSON/JSONL text nor a parquet or arrow file",
                          "give JSON/JSONL text, parquet files or a save_to_disk folder")
    return JSON


def resolve(path: str | Path) -> Source:
    """The data files a train_file names, in order; SourceError when it names none it can read."""
    text = str(path)
    p = Path(text)
    if has_glob(text) and not p.exists():
        files = [Path(f) for f in sorted(glob.glob(text)) if Path(f).is_file()]
        if not files:
            raise SourceError(f"{text}: no file matches")
        return _shards(p, files)
    if p.is_dir():
        return _folder(p)
    kind = sniff(p)
    if kind == PARQUET:
        _parquet_footer(p)
    return Source(p, kind, (p,))


def _shards(spec: Path, files: list[Path]) -> Source:
    kinds = {sniff(f) for f in files}
    if kinds - {PARQUET, ARROW} or len(kinds) > 1:
        raise SourceError(f"{spec}: the files are of several kinds ({', '.join(sorted(kinds))}); "
                          "a set of shards is all parquet or all arrow")
    kind = kinds.pop()
    if kind == PARQUET:
        _parquet_footer(files[0])
    return Source(spec, kind, tuple(files))


def _folder(p: Path) -> Source:
    if (p / "dataset_dict.json").is_file():          # DatasetDict.save_to_disk: one folder per split
        try:
            splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            raise SourceError(f"{p / 'dataset_dict.json'}: not a datasets split list") from None
        split = "train" if "train" in splits else (splits[0] if len(splits) == 1 else None)
        if split is None:
            raise SourceError(f"{p}: a saved DatasetDict with splits {', '.join(map(str, splits))} and no 'train'",
                              f"point train_file at one split's folder, e.g. {p / str(splits[0])}")
        return _folder(p / split)
    if (p / "state.json").is_file():                 # Dataset.save_to_disk
        try:
            names = [d["filename"] for d in json.loads((p / "state.json").read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise SourceError(f"{p / 'state.json'}: not a datasets save_to_disk state (no _data_files)") from None
        files = [p / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise SourceError(f"{p}: save_to_disk folder without its arrow file(s) {', '.join(missing)}".rstrip())
        return _shards(p, files)
    files = sorted(f for f in p.glob("*.parquet") if f.is_file() and not f.name.startswith("."))
    if not files:
        files = sorted(f for f in p.glob("*.arrow") if f.is_file() and not f.name.startswith("."))
    if not files:
        hint = (f"the hub's layout keeps them in data/: give {p / 'data' / 'train-*.parquet'}"
                if (p / "data").is_dir() else "give a JSON/JSONL file, parquet shards or a save_to_disk folder")
        raise SourceError(f"{p}: is a folder with no .parquet or .arrow files nor a saved dataset (state.json)", hint)
    splits = sorted({s for f in files for s in SPLITS if f.name.startswith((f"{s}-", f"{s}.", f"{s}_"))})
    if len(splits) > 1:
        raise SourceError(f"{p}: holds the splits {', '.join(splits)}; train on one",
                          f"give a glob such as {p / (splits[-1] if 'train' not in splits else 'train') }-*.parquet")
    return _shards(p, files)


def _parquet_footer(path: Path) -> None:
    """A parquet file ends with its footer and the magic bytes again: one that does not was cut."""
    try:
        with open(path, "rb") as f:
            f.seek(-len(PARQUET_MAGIC), 2)
            tail = f.read()
    except OSError:
        tail = b""
    if tail != PARQUET_MAGIC:
        raise SourceError(f"{path}: not a complete parquet file (no footer: cut short while copying?)")


# --------------------------------------------------------------------------- schema and rows

def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise SourceError("reading parquet or arrow files needs pyarrow, which is not installed", PYARROW_HINT) from None
    return pyarrow


def columns(src: Source) -> list[str]:
    """The column names of the set's first file, from its footer or schema message (no rows read)."""
    if not src.table:
        raise ValueError("columns() reads parquet/arrow files")
    pa = _pyarrow()
    f = src.files[0]
    try:
        if src.kind == PARQUET:
            return list(pa.parquet.read_schema(f).names)
        with pa.OSFile(str(f)) as stream:
            return list(_arrow_reader(pa, f, stream).schema.names)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{f}: cannot read as {src.kind} ({_first_line(e)})") from None


def fitting(collator: str, names: list[str]) -> tuple[str, ...] | None:
    """The first column alternative of the collator that the columns hold, None if none does."""
    return next((alt for alt in COLLATOR_COLUMNS.get(collator, ()) if all(c in names for c in alt)), None)


def wanted(collator: str) -> str:
    return " | ".join(" + ".join(alt) for alt in COLLATOR_COLUMNS.get(collator, ()))


class RowReader:
    """(RowAt, record) of every row of a table source, a record batch at a time; `tell()` is the
    bytes read so far (progress)."""

    def __init__(self, src: Source, batch_rows: int = 1024):
        self.src, self.batch_rows, self.done = src, batch_rows, 0

    def tell(self) -> int:
        return self.done

    def __iter__(self) -> Iterator[tuple[RowAt, dict]]:
        pa = _pyarrow()
        for f in self.src.files:
            base, size = self.done, f.stat().st_size
            row = 0
            try:
                for batch, frac in self._batches(pa, f):
                    names = batch.schema.names
                    cols = [_values(batch.column(i)) for i in range(batch.num_columns)]
                    for values in zip(*cols):
                        yield RowAt(f, row), {k: v for k, v in zip(names, values) if v is not None}
                        row += 1
                    self.done = base + int(size * frac)
            except (pa.ArrowException, OSError) as e:
                raise SourceError(f"{f}: cannot read as {self.src.kind} ({_first_line(e)})") from None
            self.done = base + size

    def _batches(self, pa, f: Path):
        if self.src.kind == PARQUET:
            pf = pa.parquet.ParquetFile(str(f), buffer_size=1 << 20)
            n = max(pf.num_row_groups, 1)
            for g in range(pf.num_row_groups):                     # one row group in memory at a time
                for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=[g], use_threads=False):
                    yield batch, g / n
            return
        with pa.OSFile(str(f)) as stream:
            reader = _arrow_reader(pa, f, stream)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                n = max(reader.num_record_batches, 1)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i), i / n
            else:
                for batch in reader:
                    yield batch, min(stream.tell() / max(f.stat().st_size, 1), 1.0)


def _values(column) -> list:
    """A column's Python values; inside structs (a JSON object's unified keys) a null is a key
    that object lacked, left out as at the top."""
    values = column.to_pylist()
    return [_drop_nulls(v) for v in values] if "struct<" in str(column.type) else values


def _drop_nulls(v):
    if isinstance(v, dict):
        return {k: _drop_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_nulls(x) for x in v]
    return v


def tail_rows(src: Source, k: int) -> tuple[int, list[tuple[int, RowAt, dict]]]:
    """(the rows of a table source, its last ``k`` rows as (index, RowAt, record) in order),
    reading only what they are in: the parquet footers and last row groups, the arrow files
    memory-mapped (a record batch is converted only when one of the last rows is in it). The
    cost does not grow with the data, where RowReader reads it all."""
    pa = _pyarrow()
    pieces: list[tuple[Path, int, int, object]] = []      # (file, first row there, rows, loader)
    total = 0
    try:
        for f in src.files:
            row = 0
            for n, load in _pieces(pa, src.kind, f):
                pieces.append((f, row, n, load))
                row += n
            total += row
        out: list[tuple[int, RowAt, dict]] = []
        index = total
        for f, first, n, load in reversed(pieces):
            if len(out) >= k:
                break
            take = min(n, k - len(out))
            part = load().slice(n - take)
            names = part.schema.names
            cols = [_values(part.column(i)) for i in range(part.num_columns)]
            rows = [{c: v for c, v in zip(names, values) if v is not None} for values in zip(*cols)]
            index -= take
            out[:0] = [(index + j, RowAt(f, first + n - take + j), rec) for j, rec in enumerate(rows)]
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{src.spec}: cannot read as {src.kind} ({_first_line(e)})") from None
    return total, out


def _pieces(pa, kind: str, f: Path):
    """(rows, loader) of each row group (parquet) or record batch (arrow) of one file, in order."""
    if kind == PARQUET:
        pf = pa.parquet.ParquetFile(str(f))
        for g in range(pf.num_row_groups):
            yield pf.metadata.row_group(g).num_rows, (lambda g=g: pf.read_row_group(g, use_threads=False))
        return
    source = pa.memory_map(str(f))
    reader = _arrow_reader(pa, f, source)
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)                      # memory-mapped: no copy until converted
            yield batch.num_rows, (lambda b=batch: b)
    else:
        for batch in reader:
            yield batch.num_rows, (lambda b=batch: b)


def iter_rows(src: Source, batch_rows: int = 1024) -> Iterator[tuple[RowAt, dict]]:
    return iter(RowReader(src, batch_rows))


def _arrow_reader(pa, f: Path, stream):
    with open(f, "rb") as head:
        is_file = head.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
    return pa.ipc.open_file(stream) if is_file else pa.ipc.open_stream(stream)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
