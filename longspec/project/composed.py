"""A composed stage and the reading it rests on: one YAML file with positions, its `# @package` header.

    Composed   the resolved config, where each key was set (Origin), the files read, the problems
    read_positions(path)   ruamel mapping + problems + parseable text of one file (cached by stat)
    header_line(path)      where a `# @package` header is, and whether Hydra reads it

project.hydracompose fills a Composed with Hydra; project.hydraproblems words what went wrong in it;
project.composecache keeps it between commands (to_json / from_json round-trip exactly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.project import schema as S
from longspec.files import yamlio
from longspec.project.placeholders import scan_placeholders, show_placeholders
from longspec.project.problem import Problem

MISSING = "???"


@dataclass(frozen=True)
class Origin:
    file: Path | None  # None: a command-line override
    line: int | None
    value: Any = None  # the leaf value written there (None for a mapping)
    kind: str = "file"  # file | default (the trainer's primary config) | override

    def describe(self, stage_file: Path | None = None) -> str:
        if self.kind == "override":
            return "override"
        where = f"{self.file}:{self.line}" if self.line else str(self.file)
        return f"trainer default ({where})" if self.kind == "default" else where


@dataclass
class Composed:
    path: Path  # the stage file
    ok: bool  # False: Hydra could not compose it (data is what could be read)
    data: dict[str, Any]  # resolved config (unresolvable leaves keep their `${...}` text)
    origins: dict[str, list[Origin]]  # dotted key -> every place that set it, last one wins
    refs: dict[str, list[str]]  # dotted key -> the keys its ${...} refers to
    files: list[Path]  # every file of the defaults list, stage file first
    problems: list[Problem] = field(default_factory=list)
    dialect: str = S.LONGSPEC
    missing: list[str] = field(default_factory=list)  # keys left `???`
    merge_order: list[Path] = field(default_factory=list)  # the defaults list's files, first merged first
    under_exp: bool = False  # the stage landed under `exp.` (its header was not read): reported once

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return default
        return node

    def has(self, dotted: str) -> bool:
        sentinel = object()
        return self.get(dotted, sentinel) is not sentinel

    def origin(self, dotted: str) -> Origin:
        """Where `dotted` was last set (or its nearest parent; else the stage file)."""
        parts = dotted.split(".")
        while parts:
            hits = self.origins.get(".".join(parts))
            if hits:
                return hits[-1]
            parts.pop()
        return Origin(self.path, None)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON of every field (from_json gives back an equal Composed, or the caller keeps none)."""
        origin = lambda o: [None if o.file is None else str(o.file), o.line, o.value, o.kind]  # noqa: E731
        return {"path": str(self.path), "ok": self.ok, "data": self.data,
                "origins": {k: [origin(o) for o in v] for k, v in self.origins.items()},
                "refs": self.refs, "files": [str(f) for f in self.files],
                "problems": [p.to_json() for p in self.problems], "dialect": self.dialect,
                "missing": self.missing, "merge_order": [str(f) for f in self.merge_order],
                "under_exp": self.under_exp}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Composed":
        origin = lambda f, line, value, kind: Origin(None if f is None else Path(f), line, value, kind)  # noqa: E731
        return cls(path=Path(d["path"]), ok=d["ok"], data=d["data"],
                   origins={k: [origin(*o) for o in v] for k, v in d["origins"].items()},
                   refs=d["refs"], files=[Path(f) for f in d["files"]],
                   problems=[Problem(**p) for p in d["problems"]], dialect=d["dialect"],
                   missing=d["missing"], merge_order=[Path(f) for f in d["merge_order"]],
                   under_exp=d["under_exp"])

    def problem(self, severity: str, key: str | None, message: str, hint: str | None = None,
                at: str | None = None) -> Problem:
        """A Problem at the file:line of `at` (default `key`); keys left to the trainer's defaults
        or set on the command line are reported against the stage file."""
        o = self.origin(at or key) if (at or key) else Origin(self.path, None)
        file, line = (o.file, o.line) if o.kind == "file" else (self.path, None)
        return Problem(severity, str(file), line, key, show_placeholders(message),
                       show_placeholders(hint) if hint else hint)


# ---------------------------------------------------------------- reading one file with positions

_DOCS: dict[tuple, tuple[Any, list[Problem], str]] = {}


def read_positions(path: Path) -> tuple[Any, list[Problem], str]:
    """(ruamel mapping or None, problems, parseable text) of one YAML file, cached by mtime."""
    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key is not None and key in _DOCS:
        return _DOCS[key]
    try:
        text = yamlio.read_text(path)
    except yamlio.YamlError as e:
        line = e.line
        try:
            raw = path.read_bytes()
            if line is None and b"\x00" in raw:
                line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        except OSError:
            pass
        out = (None, [Problem("error", str(path), line or 1, None, e.reason, e.hint)], "")
    else:
        text, problems = scan_placeholders(text, path)
        problems = [p for p in problems if "`???`" not in p.message]  # OmegaConf decides: see missing
        try:
            node = yamlio.parse(text, path)
        except yamlio.YamlError as e:
            problems.append(Problem("error", str(path), e.line or 1, None, e.reason, e.hint))
            node = None
        if node is None and not problems:
            problems.append(Problem("error", str(path), 1, None, "empty file: expected a mapping of config keys",
                                    "a config file is `key: value` lines at the top level"))
        elif node is not None and not isinstance(node, dict):
            kind = "a list" if isinstance(node, list) else f"a {type(node).__name__}"
            problems.append(Problem("error", str(path), 1, None,
                                    f"the top level is {kind}; expected a mapping of keys to values",
                                    "a config file is `key: value` lines at the top level"))
            node = None
        out = (node, problems, text)
    if key is not None:
        _DOCS[key] = out
    return out


def header_line(path: Path) -> tuple[int | None, bool]:
    """(line of a `# @package` header, whether Hydra reads it: only before any other comment)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None, False
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if re.match(r"#\s*@package\b", s):
            return n, n == 1 or all(not x.strip() for x in lines[:n - 1])
        if s and not s.startswith("#"):
            break
    return None, False
