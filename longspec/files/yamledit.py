"""Round-trip edit of ONE root-level `key: value` line of a YAML file: text in, text out.

Positions come from ruamel's composer (start/end marks of the root key and of its value), so
comments, quoting, indentation, line endings and document markers elsewhere stay byte for byte.
The result is parsed again and must read the new value with every other key unchanged; anything
the edit cannot handle for sure (a multi-line, flow, block or anchored value) is refused.
"""

from __future__ import annotations

import bisect
import difflib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec.files import yamlio
from longspec.errors import RefusedError

_PLAIN_OK = re.compile(r"[^\s'\"#:,\[\]{}&*!|>%@`?]+")  # chars that never need quotes in a plain path
_COMMENT_OR_BLANK = re.compile(r"[ \t]*(#.*)?\r?")


@dataclass
class Edit:
    old_text: str
    new_text: str
    old_value: Any  # the key's previous value (plain), None when absent or null
    present: bool  # the key existed before
    line: int  # 1-based line of the changed or added line

    @property
    def changed(self) -> bool:
        return self.new_text != self.old_text

    def diff(self, label: str) -> str:
        out = difflib.unified_diff(self.old_text.split("\n"), self.new_text.split("\n"),
                                   fromfile=f"{label} (before)", tofile=f"{label} (after)", lineterm="")
        return "\n".join(line.rstrip("\r") for line in out)


def set_root_scalar(text: str, key: str, value: str, path: Path | None = None, after: str | None = None) -> Edit:
    """Set the root-level `key` to the string `value`, changing or adding exactly one line (a new
    line goes right after the value of the key `after`, else at the end of the root mapping)."""
    data = yamlio.parse(text, path)
    if data is None:
        raise yamlio.YamlError(path, "empty file: expected a mapping of config keys")
    if not isinstance(data, dict):
        raise yamlio.YamlError(path, "the top level is not a mapping; expected `key: value` lines", line=1)
    root = _compose_root(text)
    if root.flow_style:
        raise RefusedError(f"{_where(path)}: the whole file is one {{flow mapping}}; refusing to edit it",
                           hint=f"write it as block `key: value` lines, or set {key} by hand")
    pairs = root.value
    idx = next((i for i, (k, _) in enumerate(pairs) if _is_key(k, key)), None)
    old_value = yamlio.to_plain(data.get(key)) if key in data else None
    if idx is not None:
        new_text, line = _replace_value(text, pairs[idx], key, value, path)
        candidates = [(new_text, line)]
    else:
        candidates = _insert_candidates(text, pairs, key, value, after)
    last_err: str | None = None
    for new_text, line in candidates:
        last_err = _check_result(text, new_text, data, key, value, path)
        if last_err is None:
            return Edit(text, new_text, old_value, idx is not None, line)
    raise RefusedError(f"{_where(path)}: could not set {key} without changing anything else ({last_err})",
                       hint=f"set `{key}: {value}` by hand")


def _compose_root(text: str):
    from ruamel.yaml import YAML

    return YAML(typ="rt").compose(io.StringIO(text))


def _is_key(node, key: str) -> bool:
    from ruamel.yaml.nodes import ScalarNode

    return isinstance(node, ScalarNode) and node.value == key


def _where(path: Path | None) -> str:
    return str(path) if path is not None else "<text>"


def _line_starts(text: str) -> list[int]:
    return [0] + [m.end() for m in re.finditer("\n", text)]


def _line_end(text: str, i: int) -> int:
    """Index of the line break (\\r\\n or \\n) that ends the line holding index i, or len(text)."""
    j = text.find("\n", i)
    if j < 0:
        return len(text)
    return j - 1 if j > 0 and text[j - 1] == "\r" and j - 1 >= i else j


def _replace_value(text: str, pair, key: str, value: str, path: Path | None) -> tuple[str, int]:
    from ruamel.yaml.nodes import ScalarNode

    knode, vnode = pair
    starts = _line_starts(text)
    key_line = bisect.bisect_right(starts, knode.start_mark.index)
    where = f"{_where(path)}:{key_line}"
    if not isinstance(vnode, ScalarNode):
        kind = "flow" if vnode.flow_style else "block"
        shape = "mapping" if vnode.id == "mapping" else "list"
        raise RefusedError(f"{where}: {key} holds a {kind} {shape}, not a path; refusing to guess",
                           hint=f"replace it by hand with `{key}: <path>`")
    if getattr(vnode, "anchor", None) is not None:
        raise RefusedError(f"{where}: {key} has an anchor (&) or is an alias (*); refusing to guess",
                           hint="other keys may share that value; set it by hand")
    if vnode.style in ("|", ">"):
        raise RefusedError(f"{where}: {key} is a block scalar ({vnode.style}); refusing to guess",
                           hint=f"write it on one line: `{key}: <path>`")
    s, e = vnode.start_mark.index, vnode.end_mark.index
    if s == e and vnode.value == "" and vnode.style is None:  # `key:` with nothing after it (null)
        colon = text.find(":", knode.end_mark.index)
        eol = _line_end(text, knode.end_mark.index)
        if colon < 0 or colon >= eol or text[knode.end_mark.index:colon].strip():
            raise RefusedError(f"{where}: cannot find the ':' after {key}", hint="set it by hand")
        rest = text[colon + 1:eol]
        if not re.fullmatch(r"[ \t]*(#.*)?", rest) or (rest.startswith("#")):
            raise RefusedError(f"{where}: unexpected text after `{key}:`", hint="set it by hand")
        return text[: colon + 1] + " " + render_scalar(value) + text[colon + 1:], key_line
    span = text[s:e]
    if "\n" in span or "\r" in span:
        raise RefusedError(f"{where}: the value of {key} spans several lines; refusing to guess",
                           hint=f"write it on one line: `{key}: <path>`")
    style = vnode.style if vnode.style in ("'", '"') else None
    return text[:s] + render_scalar(value, style) + text[e:], bisect.bisect_right(starts, s)


def _insert_candidates(text: str, pairs, key: str, value: str, after: str | None) -> list[tuple[str, int]]:
    """Texts with a new `key: value` line, best placement first (verified by the caller).

    Placement: right after the value of `after` when that key exists, else at
    the end of the root mapping; "after the value" = after its last line that is not blank or a
    comment. The fallback is right before the next root key (or the end of the mapping).
    """
    lines = text.split("\n")  # lines[i] keeps a trailing "\r" in CRLF files; "" after a final newline
    starts = _line_starts(text)

    def line_of(index: int) -> int:
        return bisect.bisect_right(starts, index) - 1

    col = pairs[0][0].start_mark.column if pairs else 0
    doc_end = _doc_end_line(lines, line_of(pairs[-1][1].end_mark.index) if pairs else 0)
    anchor_i = next((i for i, (k, _) in enumerate(pairs) if _is_key(k, after)), None)
    if anchor_i is not None:
        first = line_of(pairs[anchor_i][0].start_mark.index)
        stop = line_of(pairs[anchor_i + 1][0].start_mark.index) if anchor_i + 1 < len(pairs) else doc_end
    else:
        first = line_of(pairs[-1][0].start_mark.index) if pairs else 0
        stop = doc_end
    last = stop - 1
    while last > first and _COMMENT_OR_BLANK.fullmatch(lines[last]):
        last -= 1
    positions = [last + 1] if pairs else [stop]
    if stop not in positions:
        positions.append(stop)
    crlf_file = "\r\n" in text
    out = []
    for at in positions:
        # the new line takes the ending of the line above it (the file's dominant one at the very end)
        above_crlf = lines[at - 1].endswith("\r") if 0 < at < len(lines) else crlf_file
        new_line = " " * col + f"{key}: {render_scalar(value)}" + ("\r" if above_crlf else "")
        if at >= len(lines):  # after a last line that has no line break
            new_lines = lines[:-1] + [lines[-1] + ("\r" if crlf_file else ""), new_line.rstrip("\r")]
        else:
            new_lines = lines[:at] + [new_line] + lines[at:]
        out.append(("\n".join(new_lines), at + 1))
    return out


def _doc_end_line(lines: list[str], from_line: int) -> int:
    """Index of the line the root mapping ends before: a `...` marker, the empty piece after a final
    newline, or len(lines) when the last line has no line break."""
    for i in range(max(from_line, 0), len(lines)):
        if re.match(r"\.\.\.(\s|#|$)", lines[i]):
            return i
    return len(lines) - 1 if lines[-1] == "" else len(lines)


def render_scalar(value: str, style: str | None = None) -> str:
    """YAML for a path: plain when that reads back as the same string, else quoted."""
    if style == "'" and value.isprintable():
        return "'" + value.replace("'", "''") + "'"
    if style is None and value and _PLAIN_OK.fullmatch(value) and value[0] not in "-~=" and _reads_back(value):
        return value
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid YAML double-quoted scalar


def _reads_back(value: str) -> bool:
    try:
        data = yamlio.parse(f"k: {value}\n")
    except yamlio.YamlError:
        return False
    got = data.get("k") if isinstance(data, dict) else None
    return isinstance(got, str) and got == value


def _check_result(old_text: str, new_text: str, old_data, key: str, value: str, path: Path | None) -> str | None:
    """None when new_text differs from old_text by one line and reads the same except `key`."""
    if new_text == old_text:  # the key already holds this value
        return None if old_data.get(key) == value else f"{key} would not read back as the new path"
    a, b = old_text.split("\n"), new_text.split("\n")
    if not old_text.endswith("\n") and "\r\n" in old_text and len(b) == len(a) + 1:
        a[-1] += "\r"  # a line appended after a last line without a break gives that line its CRLF
    if len(a) == len(b):
        if sum(x != y for x, y in zip(a, b)) != 1:
            return "more than one line would change"
    elif len(b) == len(a) + 1:
        if not any(b[:i] + b[i + 1:] == a for i in range(len(b))):
            return "the new line would disturb other lines"
    else:
        return "line count would change by more than one"
    try:
        new_data = yamlio.parse(new_text, path)
    except yamlio.YamlError as e:
        return f"result does not parse: {e.reason}"
    if not isinstance(new_data, dict) or new_data.get(key) != value:
        return f"{key} would not read back as the new path"

    def rest(d):
        return repr([(k, yamlio.to_plain(v)) for k, v in d.items() if k != key])

    if rest(old_data) != rest(new_data):
        return "another key would change"
    return None
