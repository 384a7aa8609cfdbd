"""Compose a stage YAML the way Hydra would, without Hydra: defaults list, merge, ${...}.

    compose_file(conf/exp/long.yaml)
      -> read + placeholder scan ([Your Directory], ???, <path>, /path/to/) at text level
      -> parse (yamlio: every bad-input case is a Problem with a line, never a traceback)
      -> defaults list: `- hydra: default`, `- deepspeed@ds_cfg: NAME`, `- /group@pkg: NAME`,
         `_self_` (appended last when absent); later entries override earlier ones
      -> deep merge, remembering for every dotted key each file:line that set it
      -> ${a.b} / ${.sibling} / "${x}/${y}/" / ${oc.env:VAR,default} / ${oc.select:key,default};
         unknown resolvers (${now:...}) stay as written; missing keys and cycles are Problems.

Pure: imports only the standard library and longspec_cli.core.yamlio.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from longspec_cli.core import yamlio

PLACEHOLDER = "__placeholder"  # `[Your Directory]` becomes `__placeholder0__` so the file still parses
_PLACEHOLDER_RE = re.compile(r"__placeholder(\d+)__")
_placeholder_texts: list[str] = []  # index -> the original text, for messages
MAX_DEFAULTS_DEPTH = 16
MAX_INTERP_DEPTH = 64


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" | "warning" | "info"
    file: str | None
    line: int | None
    key: str | None
    message: str
    hint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "file": self.file, "line": self.line, "key": self.key,
                "message": self.message, "hint": self.hint}


@dataclass(frozen=True)
class Origin:
    file: Path
    line: int | None
    value: Any = None  # the leaf value written there (None for a mapping)


@dataclass
class Composed:
    path: Path  # the stage file
    ok: bool  # False: the stage file itself could not be parsed (data is empty)
    data: dict[str, Any]  # resolved config
    origins: dict[str, list[Origin]]  # dotted key -> every place that set it, last one wins
    refs: dict[str, list[str]]  # dotted key -> the keys its ${...} referred to
    files: list[Path]  # every file read, stage file first
    problems: list[Problem] = field(default_factory=list)
    unset_refs: list[Problem] = field(default_factory=list)  # the ${...} to keys that are not set

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

    def problem(self, severity: str, key: str | None, message: str, hint: str | None = None,
                at: str | None = None) -> Problem:
        """A Problem located at the file:line of `at` (default: `key`)."""
        o = self.origin(at or key) if (at or key) else Origin(self.path, None)
        return Problem(severity, str(o.file), o.line, key, show_placeholders(message),
                       show_placeholders(hint) if hint else hint)


# ---------------------------------------------------------------- placeholders (text level)

_BRACKET = re.compile(r"\[(?:[A-Za-z][^\[\],\n]*\s[^\[\],\n]*|[A-Z][A-Z0-9_]*)\]")
_ANGLE = re.compile(r"<([A-Za-z][A-Za-z0-9 _\-]{2,})>")
_PATH_TO = re.compile(r"/path/to(?:/|\b)", re.IGNORECASE)
_MISSING = re.compile(r"""^(['"]?)\?\?\?\1$""")
_KEY = re.compile(r"""^(\s*(?:-\s+)?)([^\s#'"{}\[\]][^#:]*?|'[^']*'|"[^"]*")\s*:(\s+|$)""")
_TOKEN_WORDS = {"pad", "unk", "eos", "bos", "mask", "sep", "cls", "endoftext", "think", "answer"}


def _dummy(token: str) -> str:
    if token not in _placeholder_texts:
        _placeholder_texts.append(token)
    return f"{PLACEHOLDER}{_placeholder_texts.index(token)}__"


def show_placeholders(text: str) -> str:
    """Put the original `[Your Directory]` back into a message."""
    def back(m: re.Match) -> str:
        i = int(m.group(1))
        return _placeholder_texts[i] if i < len(_placeholder_texts) else m.group(0)

    return _PLACEHOLDER_RE.sub(back, text) if PLACEHOLDER in text else text


def has_placeholder(value: Any) -> bool:
    """True for a value that still holds a placeholder (its existence checks are pointless)."""
    if not isinstance(value, str):
        return False
    return (PLACEHOLDER in value or value.strip() == "???" or bool(_PATH_TO.search(value))
            or any(m.group(1).lower() not in _TOKEN_WORDS for m in _ANGLE.finditer(value)))


def strip_comment(line: str) -> str:
    """The line without its `# comment` (a # inside a quoted scalar is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"" and (i == 0 or line[i - 1] in " \t[{,:"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def scan_placeholders(text: str, path: Path) -> tuple[str, list[Problem]]:
    """Report every placeholder with its line; return the text with `[...]` ones made parseable."""
    problems: list[Problem] = []
    out_lines = []
    for n, line in enumerate(text.split("\n"), 1):
        body = strip_comment(line)
        if not body.strip():
            out_lines.append(line)
            continue
        m = _KEY.match(body)
        key = m.group(2).strip("'\"") if m else None
        start = m.end() if m else 0
        value = body[start:]
        found: list[str] = []
        for b in _BRACKET.finditer(value):
            found.append(b.group(0))
        if _MISSING.match(value.strip()):
            found.append("???")
        if not (key or "").endswith("token"):
            found += [a.group(0) for a in _ANGLE.finditer(value) if a.group(1).lower() not in _TOKEN_WORDS]
        found += [p.group(0) for p in _PATH_TO.finditer(value)]
        for token in dict.fromkeys(found):
            what = "a value that must be set (`???`)" if token == "???" else f"the placeholder `{token}`"
            problems.append(Problem("error", str(path), n, key, f"{key or 'this line'} holds {what}",
                                    "replace the placeholder with your path"))
        if any(b for b in _BRACKET.finditer(value)):
            line = line[:start] + _BRACKET.sub(lambda b: _dummy(b.group(0)), line[start:len(body)]) + line[len(body):]
        out_lines.append(line)
    return "\n".join(out_lines), problems


# ---------------------------------------------------------------- reading one file

@dataclass
class _Doc:
    path: Path
    node: Any  # ruamel CommentedMap, or None when unusable
    package: str | None  # `# @package X` header
    problems: list[Problem]


_HEADER = re.compile(r"^#\s*@package\s+(\S+)")


def _problem_from_yaml_error(e: yamlio.YamlError, path: Path, raw: bytes | None) -> Problem:
    line = e.line
    if line is None and raw is not None and b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
    return Problem("error", str(path), line or 1, None, e.reason, e.hint)


def read_doc(path: Path, cache: dict[Path, _Doc] | None = None) -> _Doc:
    """Read, scan and parse one YAML file; every failure is a Problem with a line."""
    if cache is not None and path in cache:
        return cache[path]
    raw = None
    try:
        text = yamlio.read_text(path)
    except yamlio.YamlError as e:
        try:
            raw = path.read_bytes()
        except OSError:
            pass
        doc = _Doc(path, None, None, [_problem_from_yaml_error(e, path, raw)])
    else:
        doc = _parse_doc(text, path)
    if cache is not None:
        cache[path] = doc
    return doc


# ---------------------------------------------------------------- fast path (libyaml)
# ruamel's round-trip parser is pure Python (~0.15 ms a line); a three-stage project would spend
# most of validate's time budget in it. When PyYAML's C parser is installed, clean files are
# composed by libyaml and built here with YAML 1.2 scalar rules (as ruamel reads them) and line
# numbers. Anything unusual (tabs, tags, anchors/aliases, duplicate or complex keys, any parse
# error) falls back to yamlio.parse, so every error message and bad-input rule stays yamlio's.

class LineMap(dict):
    """A mapping that knows the 1-based line of each key."""

    def __init__(self):
        super().__init__()
        self.lines: dict[Any, int] = {}


class LineList(list):
    """A list that knows the 1-based line of each item."""

    def __init__(self):
        super().__init__()
        self.lines: list[int] = []


class _Fallback(Exception):
    pass


_UNUSUAL = re.compile(r"(?:^|[\s\[{,])[&*!]\S|\t")
_INT = re.compile(r"[-+]?[0-9][0-9_]*")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?")
_SPECIAL = {"": None, "~": None, "null": None, "Null": None, "NULL": None, "true": True, "True": True,
            "TRUE": True, "false": False, "False": False, "FALSE": False, ".inf": math.inf, ".Inf": math.inf,
            ".INF": math.inf, "+.inf": math.inf, "-.inf": -math.inf, "-.Inf": -math.inf, ".nan": math.nan,
            ".NaN": math.nan, ".NAN": math.nan}


def _plain_scalar(v: str) -> Any:
    if v in _SPECIAL:
        return _SPECIAL[v]
    if _INT.fullmatch(v):
        return int(v.replace("_", ""))
    if re.fullmatch(r"0x[0-9a-fA-F_]+", v):
        return int(v[2:].replace("_", ""), 16)
    if re.fullmatch(r"0o[0-7_]+", v):
        return int(v[2:].replace("_", ""), 8)
    if _FLOAT.fullmatch(v) and any(ch.isdigit() for ch in v):
        return float(v.replace("_", ""))
    return v


def _build(node: Any, yaml: Any, seen: set[int]) -> Any:
    if id(node) in seen:
        raise _Fallback  # an alias: yamlio checks its size
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        out = LineMap()
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                raise _Fallback
            key = _build(k, yaml, seen)
            if key in out:
                raise _Fallback  # duplicate key: yamlio reports it with its line
            out[key] = _build(v, yaml, seen)
            out.lines[key] = k.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        seq = LineList()
        for item in node.value:
            seq.append(_build(item, yaml, seen))
            seq.lines.append(item.start_mark.line + 1)
        return seq
    if node.style:  # quoted or block scalar: text
        return node.value
    return _plain_scalar(node.value)


def fast_parse(text: str, path: Path | None = None) -> Any:
    """Parse YAML text: libyaml when available and the text is plain, else yamlio.parse."""
    if not _UNUSUAL.search(text):
        try:
            import yaml

            loader = yaml.CSafeLoader
        except (ImportError, AttributeError):
            loader = None
        if loader is not None:
            try:
                node = yaml.compose(text, Loader=loader)
                return None if node is None else _build(node, yaml, set())
            except (_Fallback, yaml.YAMLError, RecursionError, ValueError):
                pass
    return yamlio.parse(text, path)


def _parse_doc(text: str, path: Path) -> _Doc:
    text, problems = scan_placeholders(text, path)
    package = None
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        m = _HEADER.match(line.strip())
        if m:
            package = m.group(1)
    try:
        node = fast_parse(text, path)
    except yamlio.YamlError as e:
        return _Doc(path, None, package, problems + [_problem_from_yaml_error(e, path, None)])
    if node is None:
        problems.append(Problem("error", str(path), 1, None, "empty file: expected a mapping of config keys",
                                "a config file is `key: value` lines at the top level"))
        return _Doc(path, None, package, problems)
    if not isinstance(node, dict):
        kind = "a list" if isinstance(node, list) else f"a {type(node).__name__}"
        problems.append(Problem("error", str(path), 1, None,
                                f"the top level is {kind}; expected a mapping of keys to values",
                                "a config file is `key: value` lines at the top level"))
        return _Doc(path, None, package, problems)
    return _Doc(path, node, package, problems)


# ---------------------------------------------------------------- config root + defaults list

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


def _defaults_entries(doc: _Doc, problems: list[Problem]) -> list[_Entry]:
    raw = doc.node.get("defaults")
    if raw is None:
        return [_Entry(None, self_=True)]
    top_line = _key_line(doc.node, "defaults")
    if not isinstance(raw, list):
        problems.append(Problem("error", str(doc.path), top_line, "defaults",
                                "`defaults` must be a list", "e.g. defaults: [/deepspeed@ds_cfg: NAME, _self_]"))
        return [_Entry(None, self_=True)]
    out: list[_Entry] = []
    for i, item in enumerate(raw):
        line = _item_line(raw, i) or top_line
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


def _entry_package(entry: _Entry, child: _Doc, parent_pkg: str) -> str:
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


def _missing_default(entry: _Entry, name: str, tried: list[Path], doc: _Doc) -> Problem:
    import difflib

    folders = {p.parent for p in tried if p.parent.is_dir()}
    have = sorted({f.stem for d in folders for f in d.glob("*.yaml")})
    close = difflib.get_close_matches(name, have, n=1)
    hint = f"did you mean {close[0]!r}?" if close else (f"available: {', '.join(have)}" if have else
                                                         "create the file or fix the name")
    return Problem("error", str(doc.path), entry.line, "defaults",
                   f"default `{entry.text}` not found: looked for {', '.join(str(p) for p in tried)}", hint)


@dataclass
class _Layer:
    doc: _Doc
    package: str


def _layers(doc: _Doc, package: str, roots: list[Path], stack: tuple[Path, ...], cache: dict,
            problems: list[Problem], files: list[Path]) -> list[_Layer]:
    out: list[_Layer] = []
    for entry in _defaults_entries(doc, problems):
        if entry.self_:
            out.append(_Layer(doc, package))
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
            out += _layers(child, _entry_package(entry, child, package), roots,
                           stack + (found.resolve(),), cache, problems, files)
    return out


# ---------------------------------------------------------------- merge with provenance

def _key_line(node: Any, key: Any) -> int | None:
    if isinstance(node, LineMap):
        return node.lines.get(key)
    try:
        return node.lc.key(key)[0] + 1
    except (AttributeError, KeyError, TypeError, IndexError):
        return None


def _item_line(seq: Any, i: int) -> int | None:
    if isinstance(seq, LineList):
        return seq.lines[i] if i < len(seq.lines) else None
    try:
        return seq.lc.item(i)[0] + 1
    except (AttributeError, KeyError, TypeError, IndexError):
        return None


def _merge(dst: dict, src: Any, prefix: str, file: Path, origins: dict[str, list[Origin]],
           skip_defaults: bool) -> None:
    for k, v in src.items():
        key = str(k)
        if skip_defaults and key == "defaults":
            continue
        dotted = f"{prefix}.{key}" if prefix else key
        leaf = None if isinstance(v, dict) else yamlio.to_plain(v)
        origins.setdefault(dotted, []).append(Origin(file, _key_line(src, k), leaf))
        if isinstance(v, dict):
            if not isinstance(dst.get(key), dict):
                dst[key] = {}
            _merge(dst[key], v, dotted, file, origins, False)
        else:
            dst[key] = leaf


def _merge_layer(data: dict, layer: _Layer, origins: dict[str, list[Origin]]) -> None:
    target = data
    for part in [p for p in layer.package.split(".") if p]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    _merge(target, layer.doc.node, layer.package, layer.doc.path, origins, True)


# ---------------------------------------------------------------- interpolation

_MISSING_VAL = object()


class _Cycle(Exception):
    def __init__(self, chain: list[str]):
        self.chain = chain


def split_interpolations(s: str) -> list[tuple[str, bool]]:
    """'a${x}b' -> [('a', False), ('x', True), ('b', False)]; handles nesting and \\${ escapes."""
    parts: list[tuple[str, bool]] = []
    buf, i, n = [], 0, len(s)
    while i < n:
        if s.startswith("\\${", i):
            buf.append("${")
            i += 3
        elif s.startswith("${", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if s.startswith("${", j):
                    depth += 1
                    j += 2
                    continue
                if s[j] == "}":
                    depth -= 1
                j += 1
            if depth:  # unterminated: plain text
                buf.append(s[i:])
                break
            if buf:
                parts.append(("".join(buf), False))
                buf = []
            parts.append((s[i + 2: j - 1], True))
            i = j
        else:
            buf.append(s[i])
            i += 1
    if buf:
        parts.append(("".join(buf), False))
    return parts


def _split_args(text: str) -> list[str]:
    """Split resolver arguments on top-level commas."""
    args, depth, buf = [], 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            args.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
    args.append("".join(buf).strip())
    return args


def _unquote(s: str) -> Any:
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    return None if s in ("null", "None", "~") else s


def _path_parts(expr: str) -> list[str]:
    return [p for p in re.split(r"\.|\[(\d+)\]", expr) if p]


def _str(v: Any) -> str:
    if v is None:
        return "None"
    return str(v)


class _Resolver:
    def __init__(self, raw: dict, composed: Composed):
        self.raw = raw
        self.c = composed
        self.memo: dict[tuple, Any] = {}
        self.active: list[tuple] = []
        self.reported: set[tuple] = set()

    def report(self, path: tuple, message: str, hint: str | None = None, severity: str = "error",
               unset: bool = False) -> None:
        key = ".".join(map(str, path))
        ident = (key, message)
        if ident not in self.reported:
            self.reported.add(ident)
            p = self.c.problem(severity, key, message, hint)
            self.c.problems.append(p)
            if unset:
                self.c.unset_refs.append(p)

    def _raw_at(self, path: tuple) -> tuple[Any, bool]:
        """(node, already_resolved) at `path`, or (_MISSING_VAL, False)."""
        node: Any = self.raw
        resolved = False
        for i, part in enumerate(path):
            if not resolved and isinstance(node, str) and "${" in node and i > 0:
                node, resolved = self.value_at(path[:i]), True
            if isinstance(node, dict) and str(part) in node:
                node = node[str(part)]
            elif isinstance(node, list) and str(part).isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _MISSING_VAL, False
        return node, resolved

    def value_at(self, path: tuple) -> Any:
        if path in self.memo:
            return self.memo[path]
        if path in self.active:
            raise _Cycle([".".join(map(str, p)) for p in self.active[self.active.index(path):]] +
                         [".".join(map(str, path))])
        if len(self.active) >= MAX_INTERP_DEPTH:
            raise _Cycle([".".join(map(str, p)) for p in self.active[-3:]] + ["..."])
        raw, resolved = self._raw_at(path)
        if raw is _MISSING_VAL:
            raise KeyError(path)
        if resolved or (path and path[0] == "hydra"):
            self.memo[path] = raw  # Hydra resolves its own node at run time (${hydra.job...})
            return raw
        self.active.append(path)
        try:
            if isinstance(raw, dict):
                val: Any = {k: self.value_at(path + (k,)) for k in raw}
            elif isinstance(raw, list):
                val = [self.value_at(path + (str(i),)) for i in range(len(raw))]
            elif isinstance(raw, str) and "${" in raw:
                val = self.interpolate(raw, path)
            else:
                val = raw
        finally:
            self.active.pop()
        self.memo[path] = val
        return val

    def interpolate(self, text: str, path: tuple) -> Any:
        parts = split_interpolations(text)
        values = []
        for chunk, is_expr in parts:
            values.append(self.evaluate(chunk, path, text) if is_expr else chunk)
        if len(parts) == 1 and parts[0][1]:
            return values[0]
        return "".join(_str(v) for v in values)

    def evaluate(self, expr: str, path: tuple, text: str) -> Any:
        expr = expr.strip()
        here = ".".join(map(str, path))
        m = re.match(r"^([A-Za-z_][\w.]*):(.*)$", expr, re.S)
        if m:
            name, args = m.group(1), m.group(2)
            if name == "oc.env":
                a = _split_args(args)
                var = a[0]
                if var in os.environ:
                    return os.environ[var]
                if len(a) > 1:
                    default = _unquote(a[1])
                    return self.interpolate(default, path) if isinstance(default, str) and "${" in default else default
                self.report(path, f"{here}: environment variable {var} is not set (${{{expr}}})",
                            f"export {var}=... or give a default: ${{oc.env:{var},VALUE}}", "warning")
                return "${" + expr + "}"
            if name == "oc.select":
                a = _split_args(args)
                found = self.lookup(a[0], path, text, quiet=True)
                if found is _MISSING_VAL:
                    return _unquote(a[1]) if len(a) > 1 else None
                return found
            return "${" + expr + "}"  # now:, hydra:, oc.decode: ... resolved by Hydra at run time
        if "${" in expr:  # a key built from another interpolation
            expr = _str(self.interpolate(expr, path))
        found = self.lookup(expr, path, text)
        return "${" + expr + "}" if found is _MISSING_VAL else found

    def lookup(self, expr: str, path: tuple, text: str, quiet: bool = False) -> Any:
        here = ".".join(map(str, path))
        dots = len(expr) - len(expr.lstrip("."))
        if dots:
            base = path[: max(len(path) - dots, 0)]
            target = base + tuple(_path_parts(expr[dots:]))
        else:
            target = tuple(_path_parts(expr))
        dotted = ".".join(map(str, target))
        if dotted.startswith("hydra."):
            return _MISSING_VAL  # runtime keys (hydra.job.name, hydra.runtime.cwd, ...)
        self.c.refs.setdefault(here, [])
        if dotted not in self.c.refs[here]:
            self.c.refs[here].append(dotted)
        try:
            return self.value_at(target)
        except KeyError:
            if not quiet:
                self.report(path, f"{here}: `{text}` refers to `{dotted}`, which is not set",
                            _near_keys(dotted, self.raw), unset=True)
            return _MISSING_VAL
        except _Cycle as cyc:
            if not quiet:
                self.report(path, f"{here}: interpolation cycle {' -> '.join(cyc.chain)}",
                            "break the loop: one of these keys must hold a plain value")
            return _MISSING_VAL


def _flat_keys(node: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            dotted = f"{prefix}.{k}" if prefix else str(k)
            yield dotted
            yield from _flat_keys(v, dotted)


def _near_keys(dotted: str, raw: dict) -> str:
    import difflib

    close = difflib.get_close_matches(dotted, list(_flat_keys(raw)), n=1)
    return f"did you mean ${{{close[0]}}}?" if close else "set the key, or fix the name in ${...}"


def resolve(raw: dict, composed: Composed) -> dict:
    r = _Resolver(raw, composed)
    out = {}
    for k in raw:
        try:
            out[k] = r.value_at((k,))
        except _Cycle as cyc:  # a cycle through a container: reported once, value kept raw
            r.report((k,), f"{k}: interpolation cycle {' -> '.join(cyc.chain)}")
            out[k] = raw[k]
        except RecursionError:
            r.report((k,), f"{k}: interpolation nested too deeply")
            out[k] = raw[k]
    return out


# ---------------------------------------------------------------- entry point

def compose_file(path: str | os.PathLike, cache: dict[Path, _Doc] | None = None) -> Composed:
    """Compose the stage file at `path`. Never raises for bad input: see Composed.problems."""
    path = Path(path)
    cache = {} if cache is None else cache
    doc = read_doc(path, cache)
    c = Composed(path=path, ok=doc.node is not None, data={}, origins={}, refs={}, files=[path],
                 problems=list(doc.problems))
    if doc.node is None:
        return c
    roots = search_roots(path, doc.node)
    layers = _layers(doc, "", roots, (path.resolve(),), cache, c.problems, c.files)
    raw: dict[str, Any] = {}
    for layer in layers:
        _merge_layer(raw, layer, c.origins)
    c.data = resolve(raw, c)
    return c
