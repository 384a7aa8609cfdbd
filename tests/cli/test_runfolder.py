"""Run-folder contract, read side: metrics parsing and tailing, JSON files, checkpoints and
the config fingerprint shared with the trainer."""

from __future__ import annotations

import hashlib
import json
import os
import time

from longspec.runs import runfolder as R

from .conftest import write_checkpoint, write_metrics


def _line(obj) -> str:
    return json.dumps(obj) + "\n"


# ----------------------------------------------------------------------------- fingerprint

def test_config_fingerprint_is_exactly_file_bytes_then_sorted_overrides_without_output_dir(tmp_path):
    exp = tmp_path / "base.yaml"
    exp.write_bytes(b"lr: 1\r\n# comment\n")
    overrides = ["seed=2", "output_dir=/x", "max_steps=5", "+data.max_seq_length=64"]
    want = hashlib.sha256(b"lr: 1\r\n# comment\n" + "\n".join(
        sorted(["seed=2", "max_steps=5", "+data.max_seq_length=64"])).encode()).hexdigest()
    assert R.config_fingerprint(exp, overrides) == want
    assert R.config_fingerprint(exp, []) == hashlib.sha256(exp.read_bytes()).hexdigest()
    # order of overrides and output_dir do not matter; any byte of the file does
    assert R.config_fingerprint(exp, list(reversed(overrides))) == want
    assert R.config_fingerprint(exp, overrides[:1] + overrides[2:]) == want
    exp.write_bytes(b"lr: 1\n# comment\n")
    assert R.config_fingerprint(exp, overrides) != want


# ----------------------------------------------------------------------------- metrics

def test_metrics_skip_malformed_and_partial_lines_and_count_them(tmp_path):
    out = tmp_path / "run"
    write_metrics(out, 3, 10, end=False, extra_lines=["{not json", "[1, 2]", ""])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "total_steps": 10, "lo')  # the trainer died mid-line
    rd = R.RunDir(out)
    log = rd.metrics()
    assert [r["step"] for r in log.steps] == [1, 2, 3]
    assert [e["event"] for e in log.events] == ["start"]
    assert log.skipped == 3  # "{not json", "[1, 2]", the partial last line
    assert rd.last_step_record()["step"] == 3
    assert [e["event"] for e in rd.events()] == ["start"]


def test_last_step_record_reads_backwards_across_blocks(tmp_path):
    out = tmp_path / "run"
    write_metrics(out, 3000, 3000, end=True)  # ~ 400 KB: several 64 KB blocks
    assert (out / "metrics.jsonl").stat().st_size > 200_000
    rec = R.RunDir(out).last_step_record()
    assert rec["step"] == 3000 and rec["total_steps"] == 3000
    assert R.RunDir(tmp_path / "missing").last_step_record() is None


def test_metrics_tail_reads_only_appended_bytes_and_waits_for_a_partial_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    tail = R.MetricsTail(p)
    b = tail.poll()
    assert b.missing and b.records == []
    p.write_text(_line({"event": "start", "step": 0}) + '{"step": 1, "lo')
    b = tail.poll()
    assert [r.get("event") for r in b] == ["start"] and not b.reset
    with open(p, "a") as f:
        f.write('ss": 2.5}\n' + _line({"step": 2, "loss": 2.0}))
    b = tail.poll()
    assert [(r["step"], r["loss"]) for r in b] == [(1, 2.5), (2, 2.0)]
    assert tail.offset == p.stat().st_size
    assert tail.poll().records == []
    with open(p, "a") as f:
        f.write("garbage\n" + _line({"step": 3}))
    assert [r["step"] for r in tail.poll()] == [3]
    assert tail.skipped == 1


def test_metrics_tail_restarts_on_truncation_replacement_and_deletion(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(_line({"step": i, "loss": 1.0}) for i in range(1, 6)))
    tail = R.MetricsTail(p)
    assert len(tail.poll()) == 5
    # truncated and restarted by a fresh run
    p.write_text(_line({"event": "start", "step": 0}))
    b = tail.poll()
    assert b.reset and [r.get("event") for r in b] == ["start"]
    # replaced by rename (new inode), even when the new file is larger than the old offset
    new = tmp_path / "new.jsonl"
    new.write_text("".join(_line({"step": i, "loss": 9.0}) for i in range(100, 110)))
    os.replace(new, p)
    b = tail.poll()
    assert b.reset and [r["step"] for r in b] == list(range(100, 110))
    # rewritten in place with the same inode, not shorter: the first bytes differ
    with open(p, "r+") as f:
        f.write(_line({"step": 7, "loss": 0.5}))
        f.write("".join(_line({"step": i, "loss": 0.5}) for i in range(8, 20)))
    b = tail.poll()
    assert b.reset and [r["step"] for r in b][:2] == [7, 8]
    # deleted
    p.unlink()
    b = tail.poll()
    assert b.missing and b.reset
    p.write_text(_line({"step": 1}))
    b = tail.poll()
    assert [r["step"] for r in b] == [1] and not b.missing


def test_metrics_tail_started_past_the_end_of_a_shorter_file_restarts(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(_line({"step": 1}))
    tail = R.MetricsTail(p)
    tail.offset = 10_000  # a monitor that opened at an old end offset
    b = tail.poll()
    assert b.reset and [r["step"] for r in b] == [1]


def test_metrics_tail_started_mid_file_still_notices_an_in_place_rewrite(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(_line({"step": i}) for i in range(1, 20)))
    tail = R.MetricsTail(p)
    tail.offset = p.stat().st_size  # the monitor read the history itself
    assert tail.poll().records == []
    with open(p, "r+") as f:  # same inode, not shorter, different start
        f.write("".join(_line({"step": i, "loss": 0.1}) for i in range(100, 125)))
    b = tail.poll()
    assert b.reset and b.records[0]["step"] == 100


def test_append_metrics_writes_one_line_per_record(tmp_path):
    p = tmp_path / "m.jsonl"
    R.append_metrics(p, {"step": 1, "loss": 1.5})
    R.append_metrics(p, {"event": "end", "step": 1})
    assert R.read_metrics(p).records == [{"step": 1, "loss": 1.5}, {"event": "end", "step": 1}]


# ----------------------------------------------------------------------------- files

def test_stage_complete_malformed_reads_as_none_with_a_reason(tmp_path):
    rd = R.RunDir(tmp_path)
    assert rd.stage_complete() is None and rd.stage_complete_error is None
    (tmp_path / "stage_complete.json").write_text('{"stage": "base", "sha2')
    assert rd.stage_complete() is None and "not valid JSON" in rd.stage_complete_error
    (tmp_path / "stage_complete.json").write_text('["a"]')
    assert rd.stage_complete() is None and "expected a JSON object" in rd.stage_complete_error
    (tmp_path / "stage_complete.json").write_text('{"stage": "base", "sha256": "nope"}')
    assert rd.stage_complete() is None and "sha256" in rd.stage_complete_error
    good = {"stage": "base", "sha256": "a" * 64, "weights": "draft_model_weights.pth"}
    (tmp_path / "stage_complete.json").write_text(json.dumps(good))
    assert rd.stage_complete() == good and rd.stage_complete_error is None
    assert rd.weights_for(good) == tmp_path / "draft_model_weights.pth" == rd.final_weights


def test_checkpoints_are_only_complete_ones_sorted_by_step(tmp_path):
    write_checkpoint(tmp_path, 1000)
    write_checkpoint(tmp_path, 200)
    write_checkpoint(tmp_path, 1200, complete=False)  # being written: no checkpoint.json yet
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-300").write_text("a file, not a folder")
    bad = write_checkpoint(tmp_path, 1100, complete=False)
    (bad / "checkpoint.json").write_text("{half")
    assert [c.step for c in R.RunDir(tmp_path).checkpoints()] == [200, 1000]
    assert R.RunDir(tmp_path / "nope").checkpoints() == []


def test_run_info_reads_run_json(tmp_path):
    rd = R.RunDir(tmp_path)
    assert rd.run_info() is None
    (tmp_path / "run.json").write_text(json.dumps({"pid": 5, "overrides": ["seed=1"]}))
    assert rd.run_info()["overrides"] == ["seed=1"]


def test_cached_sha256_rehashes_after_any_change(tmp_path):
    f = tmp_path / "w.pth"
    f.write_bytes(b"a" * 1000)
    assert R.cached_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    assert R.cached_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    st = f.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(f, "r+b") as fh:
        fh.write(b"b")  # same size ...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and mtime put back: ctime still moves
    assert R.cached_sha256(f) == hashlib.sha256(b"b" + b"a" * 999).hexdigest()


def test_one_cache_root_honours_xdg_and_keeps_the_newest_entries(tmp_path, monkeypatch):
    from longspec.files import atomic

    monkeypatch.delenv("LONGSPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert atomic.cache_root() == tmp_path / "xdg" / "longspec"
    for i in range(4):
        atomic.cache_put("t.json", f"k{i}", i, keep=3)
    atomic.cache_put("t.json", "k1", 11, keep=3)  # a rewrite is the newest entry
    assert json.loads((tmp_path / "xdg" / "longspec" / "t.json").read_text()) == {"k2": 2, "k3": 3, "k1": 11}
    assert atomic.cache_get("t.json", "k0") is None and atomic.cache_get("t.json", "k1") == 11
    assert atomic.lock_path("t.json").parent == tmp_path / "xdg" / "longspec" / "locks"
    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / "own"))
    assert atomic.cache_root() == tmp_path / "own"


def test_last_lifecycle_event_ignores_checkpoints_and_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    for rec in ({"event": "start", "step": 0}, {"step": 1}, {"event": "preempted", "step": 1, "signal": "SIGTERM"},
                {"event": "checkpoint", "step": 1}):
        R.append_metrics(p, rec)
    assert R.last_lifecycle_event(R.RunDir(tmp_path).events())["event"] == "preempted"
    R.append_metrics(p, {"event": "resume", "step": 1})
    assert R.last_lifecycle_event(R.RunDir(tmp_path).events())["event"] == "resume"
    assert R.last_lifecycle_event([]) is None


def test_a_simtau_line_is_neither_a_step_record_nor_an_event(tmp_path):
    rec = {"record": "simtau", "step": 10, "total_steps": 40, "tau": 2.1, "alpha": [0.6, 0.5], "gamma": 2}
    step = {"step": 10, "total_steps": 40, "loss": 1.0, "lr": 1e-4}
    assert R.is_simtau_record(rec) and not R.is_step_record(rec)
    assert R.is_step_record(step) and not R.is_simtau_record(step)
    assert not R.is_simtau_record({**rec, "alpha": "x"}) and not R.is_simtau_record({**rec, "tau": None})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (step, rec, step | {"step": 11})) + "\n")
    log = R.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in log.steps] == [10, 11] and log.simtau == [rec]
    rd = R.RunDir(tmp_path)
    assert rd.last_step_record()["step"] == 11 and rd.last_simtau_record() == rec
    assert rd.best() is None and rd.best_draft() is None


def test_tau_seconds_and_the_loop_seconds_read_from_metrics_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tau = {"record": "simtau", "step": 0, "total_steps": 4, "tau": 1.5, "alpha": [0.5], "gamma": 1}
    lines = [{**tau, "eval_s": 0.5, "continuations_s": 2.0}, {**tau, "step": 2, "eval_s": 0.25},
             {**tau, "step": 4, "eval_s": True}, {"event": "end", "step": 4, "time": 1.0, "elapsed_s": 9.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = R.read_metrics(path)
    assert log.tau_seconds == 2.75 and log.loop_seconds == 9.0          # a boolean is no seconds
    assert log.continuations_seconds == 2.0
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    assert R.read_metrics(path).loop_seconds is None                   # not ended yet
