"""Compose a stage YAML the way Hydra would, without Hydra: defaults list, merge, ${...}.

    compose_file(conf/exp/long.yaml) -> Composed(data, origins, refs, files, problems)
      -> read + placeholder scan ([Your Directory], ???, <path>, /path/to/)   confdoc, placeholders
      -> parse (yamlio: every bad-input case is a Problem with a line)        yamlio
      -> defaults list, config root, `# @package` rules                        defaults
      -> deep merge, remembering for every dotted key each file:line that set it   (here)
      -> ${a.b} / ${.sibling} / ${oc.env:VAR,default} / ${oc.select:key,default}   interp

Pure: imports only the standard library and longspec_cli.core. The names other modules import
from here (Problem, read_doc, config_root, fast_parse, ...) are re-exported below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec_cli.core import yamlio
from longspec_cli.core.confdoc import ConfDoc, read_doc
from longspec_cli.core.defaults import (MAX_DEFAULTS_DEPTH, Layer, collect_layers, config_root,
                                        search_roots)
from longspec_cli.core.interp import MAX_INTERP_DEPTH, resolve, split_interpolations
from longspec_cli.core.placeholders import (PLACEHOLDER, has_placeholder, scan_placeholders,
                                            show_placeholders, strip_comment)
from longspec_cli.core.problem import Problem
from longspec_cli.core.yamlio import LineList, LineMap, key_line

__all__ = ["Composed", "Origin", "Problem", "compose_file", "read_doc", "config_root", "search_roots",
           "resolve", "split_interpolations", "scan_placeholders", "show_placeholders", "has_placeholder",
           "strip_comment", "fast_parse", "LineMap", "LineList", "PLACEHOLDER", "MAX_DEFAULTS_DEPTH",
           "MAX_INTERP_DEPTH"]


def fast_parse(text: str, path: Path | None = None) -> Any:
    """yamlio.parse(text, path, fast=True): kept for the modules that import it from here."""
    return yamlio.parse(text, path, fast=True)


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


# ---------------------------------------------------------------- merge with provenance

def _merge(dst: dict, src: Any, prefix: str, file: Path, origins: dict[str, list[Origin]],
           skip_defaults: bool) -> None:
    for k, v in src.items():
        key = str(k)
        if skip_defaults and key == "defaults":
            continue
        dotted = f"{prefix}.{key}" if prefix else key
        leaf = None if isinstance(v, dict) else yamlio.to_plain(v)
        origins.setdefault(dotted, []).append(Origin(file, key_line(src, k), leaf))
        if isinstance(v, dict):
            if not isinstance(dst.get(key), dict):
                dst[key] = {}
            _merge(dst[key], v, dotted, file, origins, False)
        else:
            dst[key] = leaf


def _merge_layer(data: dict, layer: Layer, origins: dict[str, list[Origin]]) -> None:
    target = data
    for part in [p for p in layer.package.split(".") if p]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    _merge(target, layer.doc.node, layer.package, layer.doc.path, origins, True)


# ---------------------------------------------------------------- entry point

def compose_file(path: str | os.PathLike, cache: dict[Path, ConfDoc] | None = None) -> Composed:
    """Compose the stage file at `path`. Never raises for bad input: see Composed.problems."""
    path = Path(path)
    cache = {} if cache is None else cache
    doc = read_doc(path, cache)
    c = Composed(path=path, ok=doc.node is not None, data={}, origins={}, refs={}, files=[path],
                 problems=list(doc.problems))
    if doc.node is None:
        return c
    roots = search_roots(path, doc.node)
    layers = collect_layers(doc, "", roots, (path.resolve(),), cache, c.problems, c.files)
    raw: dict[str, Any] = {}
    for layer in layers:
        _merge_layer(raw, layer, c.origins)
    c.data = resolve(raw, c)
    return c
