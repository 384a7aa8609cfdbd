"""Reading YAML safely: every bad-input case becomes a YamlError with a line, never a hang.

Checks done before or while parsing: missing file, folder, binary content, non-UTF-8 bytes,
empty file, tabs used for indentation, syntax errors, duplicate keys, alias bombs and
self-referencing aliases, a root that is not a mapping. The parsed document is ruamel's
round-trip form, so callers get line numbers for every key (`YamlDoc.line_of`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec.errors import InputError

# An alias may be expanded at most this many nodes in total (billion-laughs guard).
MAX_EXPANDED_NODES = 100_000
MAX_FILE_BYTES = 16 * 1024 * 1024


class YamlError(InputError):
    """A YAML file that cannot be used; carries the position for validation reports."""

    def __init__(self, path: Path | None, message: str, line: int | None = None,
                 column: int | None = None, hint: str | None = None):
        where = f"{path}" if path is not None else "<text>"
        if line is not None:
            where += f":{line}"
            if column is not None:
                where += f":{column}"
        super().__init__(f"{where}: {message}", hint=hint)
        self.path = path
        self.line = line
        self.column = column
        self.reason = message


@dataclass
class YamlDoc:
    """A parsed YAML mapping plus what is needed to point at its keys."""

    path: Path | None
    text: str
    data: Any  # ruamel CommentedMap (round-trip types)

    def line_of(self, dotted: str) -> int | None:
        """1-based line of the key `a.b.c`, or of its nearest existing parent."""
        node, line = self.data, None
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            line = key_line(node, part) or line
            node = node[part]
        return line


def key_line(mapping: Any, key: Any) -> int | None:
    """1-based line of `key` in a parsed mapping, or None."""
    try:
        return mapping.lc.key(key)[0] + 1
    except (AttributeError, KeyError, TypeError, IndexError):
        return None


def item_line(seq: Any, i: int) -> int | None:
    """1-based line of item `i` of a parsed list, or None."""
    try:
        return seq.lc.item(i)[0] + 1
    except (AttributeError, KeyError, TypeError, IndexError):
        return None


def read_text(path: str | Path) -> str:
    """The file's text, decoded as UTF-8 (a BOM is dropped), or an InputError that says why not."""
    path = Path(path)
    if not path.exists():
        raise YamlError(path, "file not found")
    if path.is_dir():
        raise YamlError(path, "is a folder, not a YAML file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise YamlError(path, f"file is {size} bytes; a config over {MAX_FILE_BYTES} bytes is refused")
    raw = path.read_bytes()
    return decode(raw, path)


def decode(raw: bytes, path: Path | None = None) -> str:
    if b"\x00" in raw:
        raise YamlError(path, "binary file (NUL bytes), not YAML text",
                        hint="point at the .yaml config, not a checkpoint or archive")
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise YamlError(path, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
                        line=line, hint="save the file as UTF-8") from None


def _check_tabs(text: str, path: Path | None) -> None:
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip(" ")
        if stripped.startswith("\t"):
            raise YamlError(path, "tab used for indentation", line=n, column=len(line) - len(stripped) + 1,
                            hint="YAML indents with spaces only; replace the tab with spaces")


def _rt_yaml():
    from ruamel.yaml import YAML

    y = YAML(typ="rt")
    y.allow_duplicate_keys = False
    return y


def _check_aliases(text: str, path: Path | None) -> None:
    """Refuse self-referencing aliases and aliases that expand past MAX_EXPANDED_NODES."""
    if "*" not in text:
        return
    from ruamel.yaml.nodes import MappingNode, SequenceNode

    try:
        root = _rt_yaml().compose(io.StringIO(text))
    except Exception:  # syntax errors are reported by the real parse, with positions
        return
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            line = node.start_mark.line + 1 if node.start_mark else None
            raise YamlError(path, "self-referencing alias (a node that contains itself)", line=line,
                            hint="remove the alias that points back to its own anchor")
        on_path.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            for child in node.value:
                total += size(child)
        elif isinstance(node, MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
        on_path.discard(key)
        sizes[key] = total
        if total > MAX_EXPANDED_NODES:
            line = node.start_mark.line + 1 if node.start_mark else None
            raise YamlError(path, f"aliases expand to over {MAX_EXPANDED_NODES} nodes (an alias bomb?)",
                            line=line, hint="write the values out instead of nesting aliases")
        return total

    if root is not None:
        size(root)


def parse(text: str, path: Path | None = None) -> Any:
    """Parse YAML text (round-trip types). Raises YamlError with a position."""
    from ruamel.yaml.constructor import DuplicateKeyError
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    _check_tabs(text, path)
    _check_aliases(text, path)
    try:
        return _rt_yaml().load(io.StringIO(text))
    except DuplicateKeyError as e:
        mark = e.problem_mark
        raise YamlError(path, f"duplicate key: {_first_line(e.problem)}",
                        line=mark.line + 1 if mark else None,
                        hint="a key may appear once per mapping; delete one of them") from None
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = " ".join(x for x in (e.context, e.problem) if x) or "invalid YAML"
        raise YamlError(path, f"YAML syntax error: {_first_line(msg)}",
                        line=mark.line + 1 if mark else None,
                        column=mark.column + 1 if mark else None) from None
    except YAMLError as e:
        raise YamlError(path, f"YAML error: {_first_line(str(e))}") from None
    except RecursionError:
        raise YamlError(path, "YAML nested too deeply") from None


def _first_line(s: str) -> str:
    return str(s).strip().splitlines()[0] if str(s).strip() else str(s)


def load_mapping(path: str | Path, *, allow_empty: bool = False) -> YamlDoc:
    """Read and parse a YAML file whose root must be a mapping."""
    path = Path(path)
    text = read_text(path)
    data = parse(text, path)
    if data is None:
        if allow_empty:
            from ruamel.yaml.comments import CommentedMap

            return YamlDoc(path, text, CommentedMap())
        raise YamlError(path, "empty file: expected a mapping of config keys")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise YamlError(path, f"the top level is {kind}; expected a mapping of keys to values", line=1,
                        hint="a config file is `key: value` lines at the top level")
    return YamlDoc(path, text, data)


def to_plain(node: Any) -> Any:
    """Round-trip types -> plain dict/list/scalars (safe: aliases were size-checked at parse)."""
    if isinstance(node, dict):
        return {str(k) if not isinstance(k, (int, float, bool)) else k: to_plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [to_plain(v) for v in node]
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node
