"""yamlio's fast path: plain YAML through PyYAML's C parser, with ruamel's values and lines.

    parse_plain(text) -> LineMap | LineList | scalar | None, or NOT_PLAIN

ruamel's round-trip parser is pure Python (~0.15 ms a line); a three-stage project would spend
most of validate's time in it. libyaml only builds the node tree here: values follow YAML 1.2
as ruamel reads them, and every key and item keeps its 1-based line. Anything this module is
not sure of gives NOT_PLAIN, and yamlio.parse then takes the ruamel path, so all error
messages and bad-input rules (tabs, aliases, duplicate keys, syntax) stay yamlio's:

  - text: tabs, anchors/aliases/tags, `%` directives, control or Unicode line-break characters
  - structure: duplicate keys, complex or merge (`<<`) keys, a node met twice
  - scalars that look like a number, date or special tag but are not a plain int or float
    (`0x1F`, `+0o7`, `0b101`, `.5e3`, `2001-12-14`, `1:30`, `=`, `<<`): ruamel decides those
  - any parse error, or PyYAML missing or built without libyaml
"""

from __future__ import annotations

import math
import re
from typing import Any

from longspec_cli.core.yamlio import LineList, LineMap

NOT_PLAIN = object()  # "use the ruamel path"

_UNUSUAL = re.compile(r"(?:^|[\s\[{,])[&*!]\S|\t|(?:^|\n)%"
                      r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")
_SPECIAL = {"": None, "~": None, "null": None, "Null": None, "NULL": None, "true": True, "True": True,
            "TRUE": True, "false": False, "False": False, "FALSE": False, ".nan": math.nan,
            ".NaN": math.nan, ".NAN": math.nan}
_INF = re.compile(r"([-+]?)\.(?:inf|Inf|INF)")
_INT = re.compile(r"[-+]?[0-9][0-9_]*")
_FLOAT = re.compile(r"[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+)")
# Only these characters can make a number, date or tag; a value with any other (`/`) is text.
_RESOLVABLE = re.compile(r"[0-9A-Za-z_.:+\- ]+|=|<<")
_AMBIGUOUS = re.compile(r"[-+]?[._]*[0-9]|[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)$|=$|<<$")


class _NotPlain(Exception):
    pass


def _plain_scalar(v: str) -> Any:
    """A plain (unquoted) scalar as ruamel reads it (checked against ruamel over ~35k strings)."""
    if v in _SPECIAL:
        return _SPECIAL[v]
    m = _INF.fullmatch(v)
    if m:
        return -math.inf if m.group(1) == "-" else math.inf
    if _INT.fullmatch(v):
        return int(v.replace("_", ""))
    if _FLOAT.fullmatch(v):
        return float(v.replace("_", ""))
    if _RESOLVABLE.fullmatch(v) and _AMBIGUOUS.match(v):
        raise _NotPlain  # hex, octal, binary, sexagesimal, dates, `=`: ruamel's rules decide
    return v


def _build(node: Any, yaml: Any, seen: set[int]) -> Any:
    if id(node) in seen:
        raise _NotPlain  # an alias: yamlio checks its size
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        out = LineMap()
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                raise _NotPlain
            key = _build(k, yaml, seen)
            if key in out:
                raise _NotPlain  # duplicate key: yamlio reports it with its line
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


def parse_plain(text: str) -> Any:
    """The document built from libyaml's node tree, or NOT_PLAIN."""
    if _UNUSUAL.search(text):
        return NOT_PLAIN
    try:
        import yaml

        loader = yaml.CSafeLoader
    except (ImportError, AttributeError):
        return NOT_PLAIN
    try:
        node = yaml.compose(text, Loader=loader)
        return None if node is None else _build(node, yaml, set())
    except Exception:  # noqa: BLE001 - any failure: the ruamel path reports it properly
        return NOT_PLAIN
