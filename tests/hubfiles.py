"""Data files in the layouts users download from the hub, written locally with pyarrow (nothing is
downloaded): parquet shards (SlimPajama's data/train-*.parquet), a `datasets` save_to_disk folder,
the AIME parquet, LongBench's data.zip."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path


def table(records: list[dict]):
    """The records as `datasets` stores JSON objects: one column per key of any record (null where
    a record lacks it), structs for nested objects."""
    import pyarrow as pa

    return pa.Table.from_struct_array(pa.array(records))


def write_parquet_shards(records: list[dict], folder: Path, shards: int = 2, row_group: int = 300,
                         split: str = "train") -> list[Path]:
    """folder/<split>-0000i-of-0000n.parquet, as the hub's parquet datasets lay them out."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(records) // shards)
    out = []
    for i in range(shards):
        path = folder / f"{split}-{i:05d}-of-{shards:05d}.parquet"
        pq.write_table(table(records[i * per:(i + 1) * per]), path, row_group_size=row_group)
        out.append(path)
    return out


def write_saved_dataset(records: list[dict], folder: Path, batch: int = 100) -> Path:
    """A `datasets.Dataset.save_to_disk` folder: an arrow IPC stream, state.json naming it, dataset_info.json."""
    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    t = table(records)
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as f:
        with pa.ipc.new_stream(f, t.schema) as w:
            for b in t.to_batches(max_chunksize=batch):
                w.write_batch(b)
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": name}], "_fingerprint": "0123456789abcdef", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return folder


def write_aime_parquet(path: Path, problems: list, ids: list[int] | None = None) -> Path:
    """An AIME set as AI-MO/aimo-validation-aime ships it: id, problem, solution, answer, url."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = ids or list(range(60, 60 + len(problems)))
    pq.write_table(pa.table({"id": ids, "problem": problems, "solution": ["work ."] * len(problems),
                             "answer": [str(i) for i in ids], "url": [f"https://aops/{i}" for i in ids]}), path)
    return path


def zip_longbench(folder: Path, out: Path) -> Path:
    """LongBench's data.zip as the hub serves it: data/<task>.jsonl."""
    with zipfile.ZipFile(out, "w") as z:
        for f in sorted(folder.glob("*.jsonl")):
            z.write(f, f"data/{f.name}")
    return out
