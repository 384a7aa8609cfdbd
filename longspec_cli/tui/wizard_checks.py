"""Checks the init wizard runs as the user types (pure: no textual; each reads a few KB at most).

  detect_family(path)        target folder -> (family, detail) from config.json model_type/architectures
  check_data(path, collator) the data file exists and its first records have the fields the stage's
                             collator reads
  plan_and_validate(answers) the files `init` would write, and project.validate's problems for them
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from longspec.formats import datafiles
from longspec.project import targets
from longspec.formats.datafiles import COLLATOR_COLUMNS as COLLATOR_FIELDS
SAMPLE_RECORDS = 5
SAMPLE_BYTES = 1 << 20



@dataclass(frozen=True)
class Check:
    ok: bool
    message: str
    severity: str = "error"  # when not ok: "error" | "warning"


def detect_family(target: str | os.PathLike) -> Check:
    p = Path(os.path.expanduser(str(target)))
    if not p.exists():
        if "/" in str(target) and not str(target).startswith((".", "/", "~")):
            return Check(False, f"{target} is not a local folder (a hub id?): nothing is downloaded", "warning")
        return Check(False, f"{p} does not exist")
    cfg = p / "config.json"
    if not cfg.is_file():
        return Check(False, f"{p} has no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return Check(False, f"{cfg} is not valid JSON ({e})")
    if not isinstance(data, dict):
        return Check(False, f"{cfg} is not a JSON object")
    model_type = str(data.get("model_type") or "")
    archs = [str(a) for a in data.get("architectures") or [] if isinstance(a, str)]
    family = model_type.lower() if model_type.lower() in targets.SUPPORTED_FAMILIES else None
    if family is None and not model_type:
        for arch in archs:
            for key in targets.SUPPORTED_FAMILIES:
                if arch.lower().startswith(key):
                    family = key
    detail = model_type or (archs[0] if archs else "unknown")
    ctx = data.get("max_position_embeddings")
    extra = f", {ctx} positions" if isinstance(ctx, int) else ""
    problem = targets.refusal(family or detail, data.get("hidden_act"))
    if problem:
        return Check(False, problem)
    return Check(True, f"{family} family ({detail}{extra})")


def read_first_records(path: Path, n: int = SAMPLE_RECORDS, max_bytes: int = SAMPLE_BYTES) -> list[Any]:
    """The first `n` records of a JSON list or JSONL file, reading at most `max_bytes`."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes)
    text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON list: decode items one by one
        dec = json.JSONDecoder()
        i, out = text.index("[") + 1, []
        while len(out) < n:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            obj, i = dec.raw_decode(text, i)
            out.append(obj)
        return out
    out = []
    lines = text.split("\n")
    if len(raw) == max_bytes:
        lines = lines[:-1]  # the last line may be cut
    for line in lines:
        if line.strip():
            out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def check_data(path: str, collator: str) -> Check:
    if not path.strip():
        return Check(False, "not set: `train_file: ???` until you fill it in", "warning")
    p = Path(os.path.expanduser(path.strip()))
    if not datafiles.names_data(p):
        return Check(False, f"{p} does not exist")
    try:
        src = datafiles.resolve(p)
        if src.table:
            return _check_columns(src, collator)
        records = read_first_records(p)
    except datafiles.SourceError as e:
        return Check(False, e.message)
    except (ValueError, UnicodeDecodeError) as e:
        return Check(False, f"{p.name}: not JSON or JSONL ({str(e).splitlines()[0]})")
    except OSError as e:
        return Check(False, f"{p}: cannot read ({e.strerror or e})")
    if not records:
        return Check(False, f"{p.name} holds no records")
    alternatives = COLLATOR_FIELDS.get(collator, ())
    want = " | ".join("+".join(a) for a in alternatives)
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            return Check(False, f"record {i} is a {type(rec).__name__}, not an object with {want}")
        if not any(all(k in rec for k in alt) for alt in alternatives):
            have = ", ".join(sorted(map(str, rec))[:6]) or "no fields"
            return Check(False, f"record {i} has none of {want} (it has: {have})")
    used = next("+".join(a) for a in alternatives if all(k in records[0] for k in a))
    return Check(True, f"{len(records)} records checked: {used}")


def _check_columns(src: datafiles.Source, collator: str) -> Check:
    names = datafiles.columns(src)
    used = datafiles.fitting(collator, names)
    if used is None:
        return Check(False, f"{src.files[0].name}: columns {', '.join(names) or 'none'} hold none of "
                            f"{datafiles.wanted(collator)}")
    return Check(True, f"{len(src.files)} {src.kind} file(s): {'+'.join(used)}")


@dataclass(frozen=True)
class Plan:
    files: dict[Path, str]  # path -> text, as `init` would write them
    problems: tuple[Any, ...] = ()  # project.validate Problems (paths mapped back to the project)
    error: str | None = None  # the answers cannot be rendered at all (no target, bad number ...)


def plan_and_validate(answers: Any) -> Plan:
    """Render the answers (launch.scaffold.plan_project) and validate them with project.validate.

    Validation needs files on disk: the same answers are rendered for a private temporary folder
    that is deleted at once, and its paths are mapped back to the real project folder in the
    messages. The project folder itself is never touched.
    """
    from longspec.project import presets as P
    from longspec_cli.launch.scaffold import plan_project
    from longspec.project.validate import validate_paths
    from longspec.errors import LongspecError

    try:
        files = plan_project(answers)
    except LongspecError as e:
        return Plan({}, error=e.message + (f" ({e.hint})" if e.hint else ""))
    root = Path(answers.project_dir).resolve()
    preset = P.get_preset(answers.preset) if answers.preset else None
    with tempfile.TemporaryDirectory(prefix="longspec-wizard-") as tmp:
        shadow_root = Path(tmp) / root.name
        shadow = plan_project(replace(answers, project_dir=shadow_root))
        for path, text in shadow.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        try:
            report = validate_paths([shadow_root])
        except LongspecError as e:
            return Plan(files, error=e.message)
        problems = []
        for prob in report.problems:
            if preset is not None and preset.local and str(shadow_root / "assets") in prob.message:
                continue  # the tiny preset's target and data are built after the files are written
            problems.append(replace(prob, file=_unshadow(prob.file, shadow_root, root),
                                    message=_unshadow(prob.message, shadow_root, root),
                                    hint=_unshadow(prob.hint, shadow_root, root)))
    return Plan(files, tuple(problems))


def _unshadow(text: str | None, shadow: Path, real: Path) -> str | None:
    return None if text is None else text.replace(str(shadow), str(real))
