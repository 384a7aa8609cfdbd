"""Hydra defaults lists without Hydra: config root, search path, entries, packages, layers.

    collect_layers(doc, "", roots, stack, cache, problems, files) -> [Layer(doc, package), ...]

`- deepspeed@ds_cfg: NAME`, `- /group@pkg: NAME`, `- hydra: default`, bare `- name`,
`optional`/`override`, `group: null`; `_self_` is appended last when absent (Hydra >= 1.1).
Later layers override earlier ones; loops and missing files are Problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec_cli.core.confdoc import ConfDoc, read_doc
from longspec_cli.core.problem import Problem
from longspec_cli.core.yamlio import item_line, key_line

MAX_DEFAULTS_DEPTH = 16


def config_root(stage_file: Path) -> Path:
    """The folder holding exp/ and deepspeed/ (conf/ for conf/exp/x.yaml)."""
    folder = stage_file.parent
    if folder.name == "exp":
        return folder.parent
    for cand in (folder, *list(folder.parents)[:3]):
        if (cand / "exp").is_dir() or (cand / "deepspeed").is_dir():
            return cand
    return folder


def search_roots(stage_file: Path, node: Any) -> list[Path]:
    """config_root plus every `hydra.searchpath: file://DIR` that exists (relative DIRs are
    tried against the working folder and the stage file's ancestors, as Hydra's cwd varies)."""
    roots = [config_root(stage_file)]
    hydra = node.get("hydra") if isinstance(node, dict) else None
    entries = hydra.get("searchpath") if isinstance(hydra, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, str) or not entry.startswith("file://"):
            continue  # pkg:// paths live inside installed packages: nothing to check here
        rel = Path(entry[len("file://"):])
        bases = [Path()] if rel.is_absolute() else [Path.cwd(), *list(stage_file.parents)[:5]]
        for base in bases:
            cand = base / rel
            if cand.is_dir() and cand.resolve() not in {r.resolve() for r in roots}:
                roots.append(cand)
    return roots


@dataclass
class _Entry:
    line: int | None
    self_: bool = False
    group: str = ""  # "" = a config in the same folder
    package: str | None = None
    names: tuple[str, ...] = ()
    absolute: bool = False
    optional: bool = False
    text: str = ""


def _defaults_entries(doc: ConfDoc, problems: list[Problem]) -> list[_Entry]:
    raw = doc.node.get("defaults")
    if raw is None:
        return [_Entry(None, self_=True)]
    top_line = key_line(doc.node, "defaults")
    if not isinstance(raw, list):
        problems.append(Problem("error", str(doc.path), top_line, "defaults",
                                "`defaults` must be a list", "e.g. defaults: [/deepspeed@ds_cfg: NAME, _self_]"))
        return [_Entry(None, self_=True)]
    out: list[_Entry] = []
    for i, item in enumerate(raw):
        line = item_line(raw, i) or top_line
        if item == "_self_":
            out.append(_Entry(line, self_=True))
            continue
        if isinstance(item, str):
            key, val = "", item
        elif isinstance(item, dict) and len(item) == 1:
            key, val = next(iter(item.items()))
            key = str(key)
        else:
            problems.append(Problem("error", str(doc.path), line, "defaults",
                                    f"defaults entry {item!r} is neither `_self_`, a name nor `group: name`"))
            continue
        words = key.split()
        optional = "optional" in words[:-1]
        if "override" in words[:-1] or key.startswith("override"):
            words = [w for w in words if w != "override"]
        key = words[-1] if words else ""
        group, _, package = key.partition("@")
        absolute = group.startswith("/")
        if val is None:
            continue  # `group: null` removes a default
        names = tuple(str(v) for v in val) if isinstance(val, list) else (str(val),)
        if not key:  # bare `- name` (or `- group/name`)
            group, _, name = str(val).rpartition("/")
            absolute = group.startswith("/") or str(val).startswith("/")
            names = (name,)
        out.append(_Entry(line, group=group.strip("/"), package=package or None, names=names,
                          absolute=absolute, optional=optional, text=f"{key}: {val}" if key else str(val)))
    if not any(e.self_ for e in out):
        out.append(_Entry(None, self_=True))  # Hydra >= 1.1: the file's own keys come last
    return out


def _join_pkg(parent: str, child: str) -> str:
    return ".".join(p for p in (parent, child) if p)


def _entry_package(entry: _Entry, child: ConfDoc, parent_pkg: str) -> str:
    if entry.package:
        if entry.package.startswith("_global_"):
            return entry.package[len("_global_"):].lstrip(".")
        return _join_pkg(parent_pkg, entry.package.replace("_group_", entry.group.replace("/", ".")))
    if child.package == "_global_":
        return ""
    if child.package:
        return child.package.replace("_group_", entry.group.replace("/", "."))
    return _join_pkg(parent_pkg, entry.group.replace("/", "."))


def _candidates(entry: _Entry, name: str, here: Path, roots: list[Path]) -> list[Path]:
    rel = Path(entry.group) / f"{name}.yaml" if entry.group else Path(f"{name}.yaml")
    bases = ([] if entry.absolute else [here]) + roots
    seen: list[Path] = []
    for b in bases:
        p = b / rel
        if p not in seen:
            seen.append(p)
    return seen


def _missing_default(entry: _Entry, name: str, tried: list[Path], doc: ConfDoc) -> Problem:
    import difflib

    folders = {p.parent for p in tried if p.parent.is_dir()}
    have = sorted({f.stem for d in folders for f in d.glob("*.yaml")})
    close = difflib.get_close_matches(name, have, n=1)
    hint = f"did you mean {close[0]!r}?" if close else (f"available: {', '.join(have)}" if have else
                                                         "create the file or fix the name")
    return Problem("error", str(doc.path), entry.line, "defaults",
                   f"default `{entry.text}` not found: looked for {', '.join(str(p) for p in tried)}", hint)


@dataclass
class Layer:
    doc: ConfDoc
    package: str


def collect_layers(doc: ConfDoc, package: str, roots: list[Path], stack: tuple[Path, ...], cache: dict,
                   problems: list[Problem], files: list[Path]) -> list[Layer]:
    """The files to merge, in order, with the package each lands in; `problems` and `files` grow."""
    out: list[Layer] = []
    for entry in _defaults_entries(doc, problems):
        if entry.self_:
            out.append(Layer(doc, package))
            continue
        for name in entry.names:
            if name == "???":
                continue  # already reported by the placeholder scan
            tried = _candidates(entry, name, doc.path.parent, roots)
            found = next((p for p in tried if p.is_file()), None)
            if found is None:
                # hydra/job_logging, hydra/launcher, ...: Hydra ships these inside its package
                if not entry.optional and not entry.group.startswith("hydra/"):
                    problems.append(_missing_default(entry, name, tried, doc))
                continue
            if found.resolve() in stack or len(stack) >= MAX_DEFAULTS_DEPTH:
                problems.append(Problem("error", str(doc.path), entry.line, "defaults",
                                        f"defaults list loops back to {found}", "remove the circular default"))
                continue
            child = read_doc(found, cache)
            if found not in files:
                files.append(found)
                problems.extend(child.problems)
            if child.node is None:
                continue
            out += collect_layers(child, _entry_package(entry, child, package), roots,
                                  stack + (found.resolve(),), cache, problems, files)
    return out
