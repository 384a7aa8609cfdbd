"""The run-folder contract (docs/DESIGN.md): what a stage's `output_dir` holds, read side + shared helpers.

    output_dir/
      draft_model_weights.pth     final draft (stage_complete.json names its sha256)
      checkpoint-<step>/          complete once checkpoint.json exists
      metrics.jsonl               step records and events, one JSON object per line (append-only)
      run.json                    launcher: pid, pgid, host, argv, started_at, proc_start (+ overrides)
      stage_complete.json         trainer, last: stage, steps, final_loss, sha256, config_sha256, ...

Readers never trust a line or a file blindly: malformed JSONL lines are skipped and counted, a
malformed JSON file reads as None plus a reason. The trainer imports `config_fingerprint` from
here so that both sides hash a config the same way. Pure: no torch, no third-party imports at
module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

WEIGHTS = "draft_model_weights.pth"
WEIGHTS_SAFETENSORS = "draft_model_weights.safetensors"
METRICS = "metrics.jsonl"
RUN_INFO = "run.json"
STAGE_COMPLETE = "stage_complete.json"
CHECKPOINT_INFO = "checkpoint.json"
SHA256_CACHE = "sha256.json"  # under atomic.cache_root()
BEST_DIR = "best"  # the draft with the highest simulated tau of the stage (best/draft_model_weights.pth)
BEST_INFO = "best.json"  # in the run folder, written after best/'s weights: step, tau, alpha, sha256
HELDOUT = "heldout.json"  # the held-out records of the simulated-tau evaluation (fixed for the run)
CONTINUATIONS = "continuations.json"  # the target's greedy continuations of eval's default prompts (longspec.measure.chainwalk)
SIMTAU = "simtau"  # the `record` field of a simulated-tau metrics line
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


# Overrides that say where or how to run, or what to measure, not what to train: left out of the
# fingerprint (so a resume accepts them). eval_tokens is not one: it sets the held-out records.
ORIGIN_ONLY_KEYS = frozenset({"exp", "output_dir", "force", "resume_schedule", "eval_steps", "eval_share",
                              "eval_gamma"})


def config_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides that change what is trained (`+exp=`, `output_dir=`, `force=`, `resume_schedule=`
    dropped)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in ORIGIN_ONLY_KEYS]


def config_fingerprint(exp_file: str | os.PathLike, overrides: Iterable[str] = ()) -> str:
    """sha256 over the experiment file's bytes, then the sorted `config_overrides`, "\\n"-joined.

    The trainer writes this into stage_complete.json as `config_sha256`; `status` and `run`
    recompute it, all through this one function.
    """
    h = hashlib.sha256()
    with open(exp_file, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    h.update("\n".join(sorted(config_overrides(overrides))).encode("utf-8"))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


@dataclass
class MetricsLog:
    records: list[dict] = field(default_factory=list)  # every parsed line, in file order
    skipped: int = 0  # malformed or partial lines

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if is_step_record(r)]

    @property
    def events(self) -> list[dict]:
        return [r for r in self.records if "event" in r]

    @property
    def simtau(self) -> list[dict]:
        return [r for r in self.records if is_simtau_record(r)]

    @property
    def continuations_seconds(self) -> float:
        """Seconds the first evaluation spent on the target's continuations (`continuations_s`)."""
        return sum(_seconds(r.get("continuations_s")) for r in self.simtau)

    @property
    def tau_seconds(self) -> float:
        """Seconds the trainer spent on tau while training: every evaluation's walk (`eval_s`) and
        the first one's continuations."""
        return sum(_seconds(r.get("eval_s")) for r in self.simtau) + self.continuations_seconds

    @property
    def loop_seconds(self) -> float | None:
        """The training loop's seconds (the last `end` event's `elapsed_s`); None before one ended."""
        ends = [_seconds(e.get("elapsed_s")) for e in self.events if e.get("event") == "end"]
        return ends[-1] if ends and ends[-1] > 0 else None


def _seconds(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


LIFECYCLE_EVENTS = ("start", "resume", "end", "error", "preempted")  # what a run did last; not `checkpoint`


def last_lifecycle_event(events: list[dict]) -> dict | None:
    """The last start / resume / end / error / preempted event: how the stage's last run stands."""
    return next((e for e in reversed(events) if e.get("event") in LIFECYCLE_EVENTS), None)


def _int_step(rec: dict) -> bool:
    return isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool)


def is_step_record(rec: dict) -> bool:
    return "event" not in rec and "record" not in rec and _int_step(rec)


def is_simtau_record(rec: dict) -> bool:
    """A simulated-tau line: {"record": "simtau", "step", "tau", "alpha": [per draft position], ...}."""
    tau, alpha = rec.get("tau"), rec.get("alpha")
    return (rec.get("record") == SIMTAU and "event" not in rec and _int_step(rec)
            and isinstance(tau, (int, float)) and not isinstance(tau, bool)
            and isinstance(alpha, list) and all(isinstance(a, (int, float)) for a in alpha))


def parse_jsonl_line(raw: bytes | str) -> dict | None:
    """One metrics line -> dict, or None when it is not a JSON object."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting too deep
        return None
    return obj if isinstance(obj, dict) else None


def parse_metrics_lines(lines: list[bytes] | list[str]) -> tuple[list[dict], int]:
    """(records, number of malformed lines) of metrics lines; blank lines are neither. One json.loads
    for the whole batch when every line is well formed (a long history parses several times faster)."""
    body = [x for x in lines if x.strip()]
    if not body:
        return [], 0
    joined = (b"[" + b",".join(body) + b"]") if isinstance(body[0], bytes) else ("[" + ",".join(body) + "]")
    try:
        objs = json.loads(joined)
        if len(objs) == len(body):
            good = [o for o in objs if type(o) is dict]
            return good, len(body) - len(good)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: a line nested too deep
        pass
    good = [o for o in map(parse_jsonl_line, body) if o is not None]
    return good, len(body) - len(good)


def read_metrics(path: str | os.PathLike) -> MetricsLog:
    try:
        data = Path(path).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return MetricsLog()
    records, skipped = parse_metrics_lines(data.split(b"\n"))
    return MetricsLog(records, skipped)


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line (the trainer's writer side; one write call per line)."""
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class MetricsTail:
    """Follow metrics.jsonl (files.tail.LineTail): each poll() parses only the complete lines appended
    since the last one. Truncation or replacement restarts from 0 (`reset` is set on that batch);
    deletion sets `missing`. Used by the monitor and by `run`'s progress line."""

    def __init__(self, path: str | os.PathLike, max_bytes_per_poll: int = 8 << 20):
        from longspec.files.tail import LineTail

        self.lines = LineTail(path, read_cap=max_bytes_per_poll)
        self.skipped = 0

    @property
    def offset(self) -> int:
        return self.lines.offset

    @offset.setter
    def offset(self, value: int) -> None:  # a caller that read the history itself starts here
        self.lines.offset = value

    def poll(self) -> "TailBatch":
        try:
            read = self.lines.poll()
        except (IsADirectoryError, PermissionError):
            return TailBatch([], missing=True)
        records, bad = parse_metrics_lines(read.lines)
        self.skipped += bad
        return TailBatch(records, reset=read.reset is not None, missing=read.missing)


@dataclass
class TailBatch:
    records: list[dict]
    reset: bool = False  # the file was truncated/replaced: drop what you had, these start over
    missing: bool = False  # the file does not exist (now)

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


# ---------------------------------------------------------------------------------------------
# JSON files, checkpoints


def read_json(path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(object, None) or (None, reason). A missing file is (None, None)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:                          # a folder, no permission, a file where a folder was, I/O
        return None, f"{p}: cannot read ({e.strerror or e})"
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting too deep
        return None, f"{p}: not valid JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"{p}: expected a JSON object, got {type(obj).__name__}"
    return obj, None


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    info: dict


class RunDir:
    """Read side of one stage's output_dir."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir)
        self.stage_complete_error: str | None = None
        self.run_info_error: str | None = None

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    @property
    def final_weights(self) -> Path:
        return self.path / WEIGHTS

    def exists(self) -> bool:
        return self.path.is_dir()

    def metrics(self) -> MetricsLog:
        return read_metrics(self.metrics_path)

    def events(self) -> list[dict]:
        """Event records only; step lines are neither split out nor JSON-parsed (a long run has
        many of them)."""
        try:
            data = self.metrics_path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return []
        out, key = [], b'"event"'
        at = data.find(key)
        while at != -1:  # only the lines that name an event are cut out and parsed
            start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
            end = len(data) if end == -1 else end
            rec = parse_jsonl_line(data[start:end])
            if rec is not None and "event" in rec:
                out.append(rec)
            at = data.find(key, end)
        return out

    def last_step_record(self) -> dict | None:
        """The last well-formed step record, reading the file from the end."""
        return self._last_record(is_step_record)

    def last_simtau_record(self) -> dict | None:
        """The last simulated-tau record (is_simtau_record), reading the file from the end. Lines
        without the word are not parsed: a run with no simulated tau costs a read, not a parse."""
        return self._last_record(is_simtau_record, SIMTAU.encode())

    def _last_record(self, wanted, marker: bytes = b"") -> dict | None:
        try:
            with open(self.metrics_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                block, pos, tail = 64 * 1024, size, b""
                while pos > 0:
                    start = max(0, pos - block)
                    f.seek(start)
                    tail = f.read(pos - start) + tail
                    pos = start
                    lines = tail.split(b"\n")
                    # the first piece may be cut in the middle unless we reached the file start
                    candidates = lines if pos == 0 else lines[1:]
                    for raw in reversed(candidates):
                        rec = parse_jsonl_line(raw) if raw.strip() and marker in raw else None
                        if rec is not None and wanted(rec):
                            return rec
                    tail = lines[0] if pos > 0 else b""
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            pass
        return None

    def stage_complete(self) -> dict | None:
        obj, why = read_json(self.path / STAGE_COMPLETE)
        if obj is not None:
            sha = obj.get("sha256")
            if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                obj, why = None, f"{self.path / STAGE_COMPLETE}: `sha256` missing or not a hex digest"
        self.stage_complete_error = why
        return obj

    def run_info(self) -> dict | None:
        obj, why = read_json(self.path / RUN_INFO)
        self.run_info_error = why
        return obj

    def weights_for(self, complete: dict | None) -> Path:
        """The final weights file stage_complete.json names (relative to the run folder), or the default."""
        name = (complete or {}).get("weights")
        if isinstance(name, str) and name:
            p = Path(name)
            return p if p.is_absolute() else self.path / p
        return self.final_weights

    def finished_draft(self) -> Path | None:
        """The final draft of a finished stage: stage_complete.json names it and its sha256 (cached)
        still matches; None otherwise."""
        complete = self.stage_complete()
        if complete is None:
            return None
        weights = self.weights_for(complete)
        try:
            return weights if weights.is_file() and cached_sha256(weights) == complete["sha256"] else None
        except OSError:
            return None

    def best(self) -> dict | None:
        """best.json of the stage's best draft (highest simulated tau) when best/'s weights still
        match its sha256; None otherwise. `weights` is made an absolute path."""
        info, _ = read_json(self.path / BEST_INFO)
        if info is None or not isinstance(info.get("weights"), str) or not isinstance(info.get("sha256"), str):
            return None
        weights = self.path / info["weights"]
        try:
            if not weights.is_file() or cached_sha256(weights) != info["sha256"]:
                return None
        except OSError:
            return None
        return {**info, "weights": str(weights)}

    def best_draft(self) -> Path | None:
        """The best draft of the stage (best/, highest simulated tau), verified; None when there is none."""
        info = self.best()
        return Path(info["weights"]) if info else None

    def checkpoints(self) -> list[Checkpoint]:
        """Complete checkpoints (checkpoint.json present and a JSON object), sorted by step."""
        out = []
        try:
            entries = list(os.scandir(self.path))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return out
        for e in entries:
            m = _CKPT_RE.match(e.name)
            if not m or not e.is_dir():
                continue
            info, _ = read_json(Path(e.path) / CHECKPOINT_INFO)
            if info is not None:
                out.append(Checkpoint(step=int(m.group(1)), path=Path(e.path), info=info))
        return sorted(out, key=lambda c: c.step)


# ---------------------------------------------------------------------------------------------
# hashing with a cache (status must not re-hash multi-GB drafts on every call)


def cached_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, remembered by (device, inode, size, mtime_ns, ctime_ns) so an unchanged
    file is hashed once. Any change to the file (even with mtime restored) changes ctime."""
    from longspec.files.atomic import cache_get, cache_put, sha256_file

    p = Path(path).absolute()
    st = p.stat()
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    hit = cache_get(SHA256_CACHE, str(p))
    if isinstance(hit, dict) and hit.get("key") == key and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = sha256_file(p)
    cache_put(SHA256_CACHE, str(p), {"key": key, "sha256": digest}, keep=512)
    return digest
