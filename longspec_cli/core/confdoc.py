"""One config file as compose reads it: text, placeholder scan, parse, `# @package` header.

    read_doc(path, cache) -> ConfDoc(path, node, package, problems)

Every failure is a Problem with a line, never an exception. Clean files take yamlio's fast
path (libyaml); anything unusual is parsed by ruamel with yamlio's bad-input rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec_cli.core import yamlio
from longspec_cli.core.placeholders import scan_placeholders
from longspec_cli.core.problem import Problem


@dataclass
class ConfDoc:
    path: Path
    node: Any  # a yamlio LineMap or ruamel CommentedMap, or None when unusable
    package: str | None  # `# @package X` header
    problems: list[Problem]


_HEADER = re.compile(r"^#\s*@package\s+(\S+)")


def _problem_from_yaml_error(e: yamlio.YamlError, path: Path, raw: bytes | None) -> Problem:
    line = e.line
    if line is None and raw is not None and b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
    return Problem("error", str(path), line or 1, None, e.reason, e.hint)


def read_doc(path: Path, cache: dict[Path, ConfDoc] | None = None) -> ConfDoc:
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
        doc = ConfDoc(path, None, None, [_problem_from_yaml_error(e, path, raw)])
    else:
        doc = _parse_doc(text, path)
    if cache is not None:
        cache[path] = doc
    return doc


def _parse_doc(text: str, path: Path) -> ConfDoc:
    text, problems = scan_placeholders(text, path)
    package = None
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        m = _HEADER.match(line.strip())
        if m:
            package = m.group(1)
    try:
        node = yamlio.parse(text, path, fast=True)
    except yamlio.YamlError as e:
        return ConfDoc(path, None, package, problems + [_problem_from_yaml_error(e, path, None)])
    if node is None:
        problems.append(Problem("error", str(path), 1, None, "empty file: expected a mapping of config keys",
                                "a config file is `key: value` lines at the top level"))
        return ConfDoc(path, None, package, problems)
    if not isinstance(node, dict):
        kind = "a list" if isinstance(node, list) else f"a {type(node).__name__}"
        problems.append(Problem("error", str(path), 1, None,
                                f"the top level is {kind}; expected a mapping of keys to values",
                                "a config file is `key: value` lines at the top level"))
        return ConfDoc(path, None, package, problems)
    return ConfDoc(path, node, package, problems)
