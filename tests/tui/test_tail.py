"""LineTail (train.log) and Series (chart data): incremental, bounded, robust to rewrites."""

from __future__ import annotations

import math
import os

from longspec_cli.tui.series import Series
from longspec.files.tail import LineTail, read_range_chunks


def test_partial_line_waits_for_its_newline(tmp_path):
    p = tmp_path / "train.log"
    p.write_text("one\ntw")
    t = LineTail(p)
    assert t.poll().lines == ["one"]
    assert t.poll().lines == []  # idle: nothing new
    with open(p, "a") as f:
        f.write("o\nthree\n")
    assert t.poll().lines == ["two", "three"]


def test_start_at_end_reads_only_the_tail(tmp_path):
    p = tmp_path / "log"
    p.write_text("".join(f"line {i}\n" for i in range(1000)) + "cut")
    t = LineTail(p)
    assert t.start_at_end(3) == ["line 997", "line 998", "line 999"]
    before = [x for chunk in read_range_chunks(p, t.history_end) for x in chunk]
    assert before[-1] == b"line 996" and len(before) == 997
    with open(p, "a") as f:
        f.write("ted\n")
    assert t.poll().lines == ["cutted"]


def test_start_at_end_with_a_small_window(tmp_path):
    p = tmp_path / "log"
    p.write_text("".join(f"{i:04d}\n" for i in range(100)))
    t = LineTail(p)
    lines = t.start_at_end(1000, max_bytes=52)  # the window starts inside line 89: it is dropped
    assert lines == [f"{i:04d}" for i in range(90, 100)]
    assert t.history_end == 450 and t.offset == os.path.getsize(p)


def test_truncation_restarts_from_the_top(tmp_path):
    p = tmp_path / "log"
    p.write_text("a\nb\nc\n")
    t = LineTail(p)
    t.poll()
    p.write_text("x\n")  # shorter: truncated and rewritten
    r = t.poll()
    assert r.reset == "truncated" and r.lines == ["x"]


def test_replaced_file_is_read_from_its_start(tmp_path):
    p = tmp_path / "log"
    p.write_text("old 1\nold 2\n")
    t = LineTail(p)
    t.poll()
    tmp = tmp_path / "log.new"
    tmp.write_text("new 1\nnew 2\nnew 3\n")
    os.replace(tmp, p)  # rotation: another inode under the same name
    r = t.poll()
    assert r.reset == "replaced" and r.lines == ["new 1", "new 2", "new 3"]


def test_copy_truncate_rotation_that_grew_past_the_offset(tmp_path):
    p = tmp_path / "log"
    p.write_text("first line of the old file\n")
    t = LineTail(p)
    t.poll()
    with open(p, "r+") as f:  # same inode, new content already longer than our offset
        f.truncate(0)
        f.write("a brand new file after rotation, longer than before\nsecond\n")
    r = t.poll()
    assert r.reset == "replaced" and r.lines[0].startswith("a brand new file")


def test_deletion_and_reappearance(tmp_path):
    p = tmp_path / "log"
    p.write_text("a\n")
    t = LineTail(p)
    t.poll()
    p.unlink()
    assert t.poll().reset == "deleted"
    assert t.poll().reset is None  # reported once
    p.write_text("b\n")
    assert t.poll().lines == ["b"]


def test_missing_file_is_quiet(tmp_path):
    t = LineTail(tmp_path / "nope")
    assert t.start_at_end(10) == []
    r = t.poll()
    assert r.lines == [] and r.reset is None


def test_read_cap_splits_a_backlog(tmp_path):
    p = tmp_path / "log"
    p.write_text("".join(f"{i:05d}\n" for i in range(1000)))
    t = LineTail(p, read_cap=600)
    got, polls = [], 0
    while True:
        r = t.poll()
        got += r.lines
        polls += 1
        if not r.more:
            break
    assert got == [f"{i:05d}" for i in range(1000)] and polls > 5


def test_series_view_stays_bounded_and_keeps_the_shape():
    s = Series(max_points=100)
    for i in range(1, 100_001):
        s.add(i, 10.0 / i, 1e-4)
    c = s.chart()
    assert len(s) == 100_000 and 100 <= len(c.steps) <= 200
    assert c.steps == tuple(sorted(c.steps))
    assert c.loss[0] > c.loss[-1]
    assert math.isclose(sum(c.steps) / len(c.steps), 50_000, rel_tol=0.05)


def test_series_rollback_on_resume():
    s = Series(max_points=10)
    for i in range(1, 51):
        s.add(i, 1.0, 1e-4)
    s.add(31, 5.0, 1e-4)  # resumed from the checkpoint at step 30: steps 31..50 are rolled back
    assert list(s.steps)[-2:] == [30.0, 31.0] and len(s) == 31
    assert s.chart().loss[-1] > 1.0


def test_series_skips_nonfinite_values_in_the_view():
    s = Series()
    s.add(1, float("nan"), 1e-4)
    s.add(2, float("inf"), None)
    s.add(3, 2.0, 1e-4)
    c = s.chart()
    assert c.loss == (None, None, 2.0) and c.lr == (1e-4, None, 1e-4)
