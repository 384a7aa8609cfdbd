"""longspec.data.records.tail_records: the last records of a train_file without reading the rest, equal to
read_records' last ones (indices, record ids, records) in every format users download."""
from __future__ import annotations

import json

import pytest

from longspec.data import records as R
from tests import hubfiles


def full_tail(path, k):
    rows = list(R.read_records(path))
    return len(rows), [(i, at, rec) for i, (at, rec) in enumerate(rows)][-k:]


def records(n):
    return [{"text": f"document {i} " + "word " * (i % 7), "id": i} for i in range(n)]


@pytest.mark.parametrize("k", [1, 5, 40, 500])
def test_jsonl_tail_read_backwards_equals_the_full_read(tmp_path, monkeypatch, k):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in records(300)]
    lines[10:10] = ["", "   "]                       # blank lines before the tail shift line numbers
    lines[-20:-20] = [""]                            # and one inside it
    path.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr(R, "TAIL_WHOLE", 0)        # the backward reader, not the whole-file fallback
    monkeypatch.setattr(R, "COUNT_CHUNK", 1000)    # the line count in several chunks
    want = full_tail(path, k)
    assert R.tail_records(path, k, records=300) == want
    assert R.tail_records(path, k) == want         # no record count: read whole


def test_jsonl_tail_names_a_bad_line_as_read_records_does(tmp_path, monkeypatch):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in records(50)]
    lines[45] = "{not json"
    path.write_text("\n".join(lines), encoding="utf-8")
    monkeypatch.setattr(R, "TAIL_WHOLE", 0)
    with pytest.raises(R.DataError, match=r"bad\.jsonl:46: invalid JSON"):
        R.tail_records(path, 10, records=50)
    n, got = R.tail_records(path, 10, "skip", records=49)
    assert [at for _, at, _ in got] == [40, 41, 42, 43, 44, 45, 47, 48, 49, 50]
    assert [i for i, _, _ in got] == list(range(39, 49))


@pytest.mark.parametrize("layout", ["parquet", "saved"])
@pytest.mark.parametrize("k", [1, 7, 299, 1000])
def test_table_tail_reads_only_the_last_row_groups_and_equals_the_full_read(tmp_path, layout, k):
    recs = records(700)
    if layout == "parquet":
        hubfiles.write_parquet_shards(recs, tmp_path / "data", shards=3, row_group=100)
        path = tmp_path / "data"
    else:
        path = hubfiles.write_saved_dataset(recs, tmp_path / "saved", batch=64)
    assert R.tail_records(path, k) == full_tail(path, k)


def test_table_tail_reads_no_row_group_before_the_tail(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    hubfiles.write_parquet_shards(records(600), tmp_path / "data", shards=2, row_group=100)
    read = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, *a, **kw):
        read.append(i)
        return real(self, i, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    n, got = R.tail_records(tmp_path / "data", 150)
    assert n == 600 and [i for i, _, _ in got] == list(range(450, 600))
    assert read == [2, 1]                             # the second shard's last two of three row groups
