"""Prepared (tokenized) training data: where a stage's cache lives and what state it is in.

Pure: no torch, numpy or transformers (status composes the stage with Hydra, as validate does). `longspec prepare` (python -m longspec.prepare) builds a
cache; the trainer memory-maps it; `status`, `validate` and the monitor read its small manifest.

A cache is a folder <cache root>/prepared/<stem>-<key>/ (files.atomic.cache_root) named by the source path (a
file, a folder or a glob of shards: formats.datafiles), the tokenizer's files and the data options (collator,
max_seq_length, on_bad_record). Records with nothing to train within max_seq_length are skipped and
counted (`untrainable`, with the first few `FILE:row N`), up to the stage's data.max_untrainable_share
of the records read (untrainable_refusal: above it the data is refused). The manifest fingerprints every file of the source (size, stat, sha256):
a shard added, removed or changed makes the cache stale.

  manifest.json          written last (atomic): key, source fingerprint, counts, files, histogram
  <build>.tokens.bin     flat token ids (uint16 when the vocabulary fits, else uint32)
  <build>.mask.bin       uint8 per token: 1 = trained label
  <build>.idx            int64 offsets, records + 1 of them

A build writes its files under temporary names, fsyncs, renames them, then writes the manifest:
an interrupted build leaves no manifest naming half files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longspec.formats.datafiles import names_data

FORMAT = 1
MANIFEST = "manifest.json"
DATA_OPTIONS = ("collator", "max_seq_length", "on_bad_record")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
                   "spiece.model", "chat_template.jinja", "chat_template.json")
STATUS_HASH_LIMIT = 1 << 30   # status/validate hash a touched train_file only up to this size
STATES = ("ready", "missing", "stale", "corrupt", "refused", "unknown")
# data.max_untrainable_share: the share of a stage's well-formed records that may train nothing within
# max_seq_length (skipped); above it a wrong max_seq_length or collator is the likelier cause.
UNTRAINABLE_LIMIT = 0.05
KEEP_EXAMPLES = 3            # the `FILE:row N` of the first untrainable records shown in summaries


class CacheProblem(Exception):
    """The cache cannot be used as it is (missing, stale, corrupt): rebuild it."""


def cache_root() -> Path:
    """The prepared caches' folder: `prepared/` under longspec's one cache root (files.atomic)."""
    from longspec.files.atomic import cache_root as longspec_cache

    return longspec_cache() / "prepared"


def tokenizer_fingerprint(target: str | os.PathLike) -> str:
    """sha256 over the tokenizer files of a model folder (names and contents)."""
    from longspec.runs.runfolder import cached_sha256

    h = hashlib.sha256()
    folder = Path(target)
    for name in TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            h.update(f"{name}:{cached_sha256(p)}\n".encode())
    return h.hexdigest()


def data_options(data: Any) -> dict[str, Any]:
    """The `data:` block's options that change the tokens, the trainer's defaults filled in (as
    written: a value of the wrong type is the cache key's too; validation reports it)."""
    from longspec.project.stageview import default

    data = data if isinstance(data, dict) else {}
    return {k: data[k] if k in data else default(f"data.{k}") for k in DATA_OPTIONS}


def untrainable_limit(data: Any) -> float:
    """The stage's data.max_untrainable_share (0..1), the default when unset."""
    v = (data if isinstance(data, dict) else {}).get("max_untrainable_share", UNTRAINABLE_LIMIT)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else UNTRAINABLE_LIMIT


def untrainable_refusal(man: dict, limit: float) -> str | None:
    """Why a stage's prepared data is refused: more of its records train nothing within max_seq_length
    than data.max_untrainable_share allows (None: within it). `man`: a cache manifest's counts."""
    n, records = man.get("untrainable") or 0, man.get("records") or 0
    share = n / max(n + records, 1)
    if n == 0 or share <= limit:
        return None
    key = man.get("key") or {}
    first = "; ".join((man.get("untrainable_problems") or [])[:KEEP_EXAMPLES])
    return (f"{n:,} of {n + records:,} records ({share:.2%}) train no token within max_seq_length="
            f"{key.get('max_seq_length')} (collator {key.get('collator')}), more than "
            f"data.max_untrainable_share={limit:g} ({limit:.2%}) allows" + (f"; first: {first}" if first else "")
            + ". A wrong max_seq_length or collator? Fix it, or raise data.max_untrainable_share to train "
            "on the rest")


def key_fields(train_file: str | os.PathLike, target: str | os.PathLike, data: Any) -> dict[str, Any]:
    return {"format": FORMAT, "source": str(Path(train_file).resolve()),
            "tokenizer": tokenizer_fingerprint(target), **data_options(data)}


def cache_dir(fields: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]", "_", Path(fields["source"]).stem)[:40]      # a glob's * is no folder name
    return cache_root() / f"{stem}-{digest}"


def read_manifest(folder: Path) -> dict | None:
    """The cache folder's manifest when it is of this FORMAT, else None."""
    from longspec.files.atomic import read_stamped_json

    return read_stamped_json(Path(folder) / MANIFEST, FORMAT)


def stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def check(folder: Path, fields: dict[str, Any], collator_version: int | None = None,
          full: bool = True, hash_source_up_to: int | None = None) -> dict:
    """The manifest when the cache in `folder` may be trained on; CacheProblem(why) otherwise.

    Always: the key, every file of the source (the same list; each one's size, then its content
    sha256 when its stat changed, for files up to hash_source_up_to bytes if given), every data
    file's length. full=True adds the checksums (only re-hashed when a file's stat changed)."""
    from longspec.runs.runfolder import cached_sha256

    man = read_manifest(folder)
    if man is None:
        raise CacheProblem("not prepared")
    if man.get("key") != fields:
        raise CacheProblem("prepared with other options or another tokenizer")
    if collator_version is not None and man.get("collator_version") != collator_version:
        raise CacheProblem("stale: prepared by another version of the collators")
    _check_source(fields["source"], man.get("source") or {}, hash_source_up_to)
    for name, info in (man.get("files") or {}).items():
        p = folder / name
        try:
            size = p.stat().st_size
        except OSError:
            raise CacheProblem(f"corrupt: {name} is missing") from None
        if size != info.get("size"):
            raise CacheProblem(f"corrupt: {name} has {size} bytes, the manifest says {info.get('size')}")
        if full and stat_key(p) != info.get("stat") and cached_sha256(p) != info.get("sha256"):
            raise CacheProblem(f"corrupt: {name} does not match its checksum")
    if set(man.get("files") or {}) != {f"{man.get('build')}.{s}" for s in ("tokens.bin", "mask.bin", "idx")}:
        raise CacheProblem("corrupt: the manifest does not list the three data files")
    return man


def source_files(source: str | os.PathLike) -> list[Path]:
    """The files a train_file names (formats.datafiles), in reading order; CacheProblem when none."""
    from longspec.formats import datafiles

    try:
        return list(datafiles.resolve(source).files)
    except datafiles.SourceError as e:
        if not names_data(source):
            raise CacheProblem(f"stale: {source} is missing") from None
        raise CacheProblem(f"stale: {e.message}") from None


def _check_source(source: str, recorded: dict, hash_up_to: int | None) -> None:
    """Every file of the source as the manifest fingerprinted it (a manifest of one file, written
    before sets of shards were read, holds that file's size, stat and sha256 at its top)."""
    from longspec.runs.runfolder import cached_sha256

    files = recorded.get("files")
    if not isinstance(files, list):
        files = [{"path": source, **{k: recorded.get(k) for k in ("size", "stat", "sha256")}}]
    now = source_files(source)
    names = [str(p) for p in now]
    was = [str(f.get("path")) for f in files if isinstance(f, dict)]
    if names != was:
        added = [Path(n).name for n in names if n not in was]
        gone = [Path(n).name for n in was if n not in names]
        what = "; ".join(x for x in (f"added {', '.join(added[:3])}" if added else "",
                                     f"removed {', '.join(gone[:3])}" if gone else "") if x) or "reordered"
        raise CacheProblem(f"stale: the files of {Path(source).name} changed since it was prepared ({what})")
    for src, info in zip(now, files):
        try:
            size = src.stat().st_size
            if size != info.get("size"):
                raise CacheProblem(f"stale: {src.name} changed since it was prepared")
            if stat_key(src) != info.get("stat"):
                if hash_up_to is not None and size > hash_up_to:
                    raise CacheProblem(f"stale: {src.name} was modified since it was prepared "
                                       "(`longspec prepare` compares its content)")
                if cached_sha256(src) != info.get("sha256"):
                    raise CacheProblem(f"stale: {src.name} changed since it was prepared")
        except OSError:
            raise CacheProblem(f"stale: {src} is missing") from None


# ------------------------------------------------------------------------- schedule figures

def batches_per_epoch(records: int, micro: int, world: int) -> int:
    """Micro-batches one rank draws per epoch (the trainer's ShardedBatchSampler length)."""
    return math.ceil(math.ceil(records / max(world, 1)) / max(micro, 1))


def steps_per_epoch(records: int, micro: int, ga: int, world: int) -> int:
    return math.ceil(batches_per_epoch(records, micro, world) / max(ga, 1))


def planned_steps(conf: dict, records: int, world: int) -> int:
    """Optimizer steps the stage will run (longspec.training.dsconfig.plan_steps' rule)."""
    ga = _int(conf.get("gradient_accumulation_steps"), 1)
    if _int(conf.get("max_steps"), 0) > 0:
        return _int(conf.get("max_steps"), 0)
    epochs = conf.get("num_train_epochs", 1)
    epochs = epochs if isinstance(epochs, (int, float)) and not isinstance(epochs, bool) else 1
    per = batches_per_epoch(records, _int(conf.get("per_gpu_train_batch_size"), 1), world)
    return max(1, math.ceil(epochs * per / ga))


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


# ------------------------------------------------------------------------- a stage's state

@dataclass
class PreparedState:
    state: str                       # ready | missing | stale | corrupt | unknown
    reason: str = ""
    path: str | None = None
    records: int | None = None
    tokens: int | None = None
    trained_tokens: int | None = None
    skipped: int | None = None
    untrainable: int | None = None   # records with nothing to train within max_seq_length, skipped
    truncated: int | None = None
    steps_per_epoch: int | None = None
    planned_steps: int | None = None
    epochs: float | None = None      # how many epochs the planned steps cover
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    def line(self) -> str:
        """One short line for tables: `ready 1.2M tok, 2.5 ep` / `stale: data.jsonl changed`."""
        if self.state != "ready":
            return self.reason or self.state
        text = f"ready {human(self.tokens or 0)} tok"
        text += f", {self.epochs:.2g} ep" if self.epochs is not None else ""
        return text + (f", {self.untrainable:,} untrainable records skipped" if self.untrainable else "")


def collator_version() -> int | None:
    """longspec.data.encoding.COLLATOR_VERSION, read from the module's source (importing it loads torch)."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("longspec.data.encoding")
        text = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
    except (ImportError, OSError, ValueError):
        return None
    m = re.search(r"^COLLATOR_VERSION = (\d+)", text, re.M)
    return int(m.group(1)) if m else None


def stage_prepared(conf: dict, base_dir: Path, world: int = 1, full: bool = False) -> PreparedState:
    """The prepared state of a stage from its composed config (no tokenizer is loaded)."""
    train, target = conf.get("train_file"), conf.get("model_name_or_path")
    if not (isinstance(train, str) and isinstance(target, str)) or "${" in train + target or "???" in train + target:
        return PreparedState("unknown", "train_file or model_name_or_path not set")
    train_p, target_p = (_abs(base_dir, v) for v in (train, target))
    if not names_data(train_p):
        return PreparedState("unknown", f"train_file {train_p} not found")
    fields = key_fields(train_p, target_p, conf.get("data"))
    folder = cache_dir(fields)
    try:
        man = check(folder, fields, collator_version(), full=full,
                    hash_source_up_to=None if full else STATUS_HASH_LIMIT)
    except CacheProblem as e:
        state = str(e).split(":")[0] if str(e).startswith(("stale", "corrupt")) else "missing"
        return PreparedState(state, str(e), str(folder))
    except OSError as e:
        return PreparedState("unknown", f"cannot read the cache: {e.strerror or e}", str(folder))
    why = untrainable_refusal(man, untrainable_limit(conf.get("data")))
    if why is not None:                     # prepared under a higher limit than the stage's now
        return PreparedState("refused", f"refused: {why}", str(folder), untrainable=man.get("untrainable"))
    st = PreparedState("ready", path=str(folder), **{k: man.get(k) for k in (
        "records", "tokens", "trained_tokens", "skipped", "untrainable", "truncated")})
    st.extra["chat_check"] = man.get("chat_check")
    ga, micro = _int(conf.get("gradient_accumulation_steps"), 1), _int(conf.get("per_gpu_train_batch_size"), 1)
    st.steps_per_epoch = steps_per_epoch(st.records or 0, micro, ga, world)
    st.planned_steps = planned_steps(conf, st.records or 0, world)
    per = batches_per_epoch(st.records or 0, micro, world)
    st.epochs = round(st.planned_steps * ga / per, 3) if per else None
    return st


def _abs(base: Path, value: str) -> Path:
    p = Path(os.path.expanduser(value))
    return Path(os.path.normpath(p if p.is_absolute() else base / p))


# ------------------------------------------------------------------------- text

def human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def histogram_lines(hist: list[list[int]], width: int = 40) -> list[str]:
    """[[low, high, count], ...] as terminal bars: `   65-128   ████████▌ 1,234`."""
    if not hist:
        return []
    top = max(c for _, _, c in hist) or 1
    label_w = max(len(f"{lo}-{hi}") for lo, hi, _ in hist)
    out = []
    for lo, hi, count in hist:
        cells = count / top * width
        bar = "█" * int(cells) + ("▌" if cells - int(cells) >= 0.5 else "")
        out.append(f"  {f'{lo}-{hi}':>{label_w}} {bar:<{width + 1}} {count:,}")
    return out


def result_of(man: dict, conf: dict, world: int, folder: Path, built: bool, seconds: float) -> dict:
    """`longspec prepare`'s result for one stage (its --json object): counts, histogram, schedule."""
    micro = _int(conf.get("per_gpu_train_batch_size"), 1)
    ga = _int(conf.get("gradient_accumulation_steps"), 1)
    records = man["records"]
    r = {"stage": conf.get("stage"), "built": built, "cache": str(folder), "seconds": round(seconds, 3),
         "build_seconds": man.get("seconds"),
         "world": world, "global_batch": micro * ga * world, "key": man["key"],
         "steps_per_epoch": steps_per_epoch(records, micro, ga, world),
         "planned_steps": planned_steps(conf, records, world)}
    r["epochs"] = round(r["planned_steps"] * ga / max(batches_per_epoch(records, micro, world), 1), 3)
    for k in ("records", "tokens", "trained_tokens", "skipped", "truncated", "histogram", "problems",
              "untrainable", "untrainable_problems"):
        r[k] = man.get(k)
    r["untrainable"] = r["untrainable"] or 0
    r["untrainable_share"] = round(r["untrainable"] / max(records + r["untrainable"], 1), 6)
    r["max_untrainable_share"] = untrainable_limit(conf.get("data"))
    r["truncated_fraction"] = round(man["truncated"] / max(records, 1), 6)
    return r


def result_text(r: dict) -> list[str]:
    """The human summary of one result (result_of)."""
    head = "tokenized" if r["built"] else "already prepared"
    lines = [f"[{r['stage']}] {head} in {r['seconds']:.1f} s: {r['cache']}"]
    lines += [f"  {line}" for line in summary_lines(r, r["steps_per_epoch"], r["global_batch"])]
    lines.append(f"  planned {r['planned_steps']:,} steps cover {r['epochs']:.3g} epochs")
    lines += [f"  untrainable, skipped: {p}" for p in (r.get("untrainable_problems") or [])[:KEEP_EXAMPLES]]
    return lines + [f"  skipped: {p}" for p in (r.get("problems") or [])[:3]]


def summary_lines(man: dict, steps: int | None = None, global_batch: int | None = None) -> list[str]:
    """The human summary of a prepared cache (manifest) for `longspec prepare`."""
    rec, tok, tr = man.get("records", 0), man.get("tokens", 0), man.get("trained_tokens", 0)
    lines = [f"records {rec:,}   tokens {tok:,}   trained tokens {tr:,} ({tr / max(tok, 1):.1%})",
             f"skipped bad records {man.get('skipped', 0):,}   untrainable records (nothing to train within "
             f"max_seq_length) {man.get('untrainable') or 0:,}   truncated "
             f"{man.get('truncated', 0) / max(rec, 1):.1%} of records at max_seq_length "
             f"{(man.get('key') or {}).get('max_seq_length')}"]
    if steps is not None:
        lines.append(f"one epoch = {steps:,} steps at global batch {global_batch}")
    lines.append("record length (tokens):")
    return lines + histogram_lines(man.get("histogram") or [])


# ------------------------------------------------------------------------- for status / validate / monitor

def project_prepared(manifest) -> dict[str, PreparedState]:
    """Each stage's prepared state (composed config, the manifest's world size; lengths checked,
    checksums only where a file's stat changed since it was written)."""
    from longspec.project.hydracompose import compose_stage, stage_overrides

    world = max(1, manifest.launch.gpus) * max(1, manifest.launch.nodes)
    out: dict[str, PreparedState] = {}
    for spec in manifest.stages:
        try:
            c = compose_stage(spec.config, stage_overrides(spec.output_dir, []))
        except OSError:
            c = None
        out[spec.name] = (stage_prepared(c.data, manifest.root, world) if c is not None and c.ok
                          else PreparedState("unknown", "config unreadable"))
    return out


def prepared_note(state: PreparedState) -> str:
    """One sentence for `validate`'s info lines."""
    if state.state == "ready":
        return (f"train_file prepared: {state.records:,} records, {state.tokens:,} tokens "
                f"({state.trained_tokens:,} trained); {state.planned_steps:,} planned steps cover "
                f"{state.epochs:.3g} epochs ({state.steps_per_epoch:,} steps per epoch)")
    if state.state in ("unknown", "refused"):
        return f"train_file not prepared: {state.reason}"
    return (f"train_file {state.reason}: `longspec prepare` (or `longspec run`, before it starts "
            "DeepSpeed) tokenizes it once")


def prepared_warnings(state: PreparedState) -> list[str]:
    """`validate`'s warnings from the cache's first-records check (written by the build, so that
    nothing is tokenized here): chats whose end of turn is not trained, trained system markup."""
    chk = state.extra.get("chat_check") if state.state == "ready" else None
    if not isinstance(chk, dict):
        return []
    out, n = [], chk.get("records", 0)
    if chk.get("no_end_of_turn"):
        token = f" {chk['end_of_turn']}" if chk.get("end_of_turn") else ""
        at = chk.get("first_no_end_of_turn")
        first = "" if at is None else f" (first: {'line ' if isinstance(at, int) else ''}{at})"
        out.append(f"{chk['no_end_of_turn']} of the first {n} records are chats whose end-of-turn "
                   f"token{token} is not trained after their last answer{first}; most often cut by "
                   "max_seq_length: the draft does not learn where an answer ends; "
                   "`longspec prepare DIR STAGE --show 3` shows them")
    if chk.get("system_trained"):
        out.append(f"{chk['system_trained']} of the first {n} records train a system turn's chat markup "
                   "(chat text in a plain document?); `longspec prepare DIR STAGE --show 3` shows them")
    return out
