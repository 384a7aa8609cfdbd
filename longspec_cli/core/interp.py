"""`${...}` interpolation as OmegaConf does it, without OmegaConf.

    resolve(raw, composed) -> resolved dict (problems go to composed.problems)

${a.b}, ${.sibling}, "${x}/${y}/", ${oc.env:VAR,default}, ${oc.select:key,default};
unknown resolvers (${now:...}) and hydra.* keys stay as written; missing keys and cycles are
Problems, never hangs. Pure: standard library only.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from longspec_cli.core.compose import Composed

MAX_INTERP_DEPTH = 64

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
