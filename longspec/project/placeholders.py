"""Placeholders found at text level: `[Your Directory]`, `???`, `<path>`, `/path/to/`.

    scan_placeholders(text, path) -> (parseable text, [Problem, ...])

A `[...]` placeholder becomes `__placeholder0__` so the file still parses; show_placeholders
puts the original text back into messages. Pure: standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from longspec.project.problem import Problem

PLACEHOLDER = "__placeholder"  # `[Your Directory]` becomes `__placeholder0__` so the file still parses
_PLACEHOLDER_RE = re.compile(r"__placeholder(\d+)__")
_placeholder_texts: list[str] = []  # index -> the original text, for messages

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
