"""Hydra's errors, and what its composition leaves wrong, as Problems that say the fix.

    hydra_problem(c, exception, ...)   a missing config or group (relative defaults: "add the `/`"),
                                       a no-match `override`, a group listed twice, an override of a
                                       key that is not there (did you mean), a bad override
    interp_problem(c, key, ...)        a ${...} to a missing key (did you mean), or unresolvable
    header_problem(c)                  the stage landed under `exp.`: its header is not first, or none
    missing_problems(c)                keys left `???` (where the `???` was written, else the stage file)

Each Problem carries the file and line (ruamel positions of the defaults list's files).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from longspec.project import schema as S
from longspec.files import yamlio
from longspec.project.composed import MISSING, Composed, header_line, read_positions
from longspec.project.problem import Problem

HEADER = "# @package _global_"
HEADER_HINT = "`# @package _global_` must be the first line; Hydra reads it only before any other comment"


def interp_problem(c: Composed, dotted: str, raw: Any, e: Exception, keys: list[str]) -> Problem:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    m = re.search(r"Interpolation key '([^']+)' not found", msg)
    if m:
        close = S.did_you_mean(m.group(1), keys)
        hint = f"did you mean `${{{close}}}`?" if close else f"set `{m.group(1)}`, or change the reference"
        return c.problem("error", dotted, f"{dotted}: {raw} refers to `{m.group(1)}`, which is not set", hint)
    return c.problem("error", dotted, f"{dotted}: {raw} cannot be resolved ({msg})",
                     "fix the ${...} expression (OmegaConf's syntax: ${key}, ${oc.env:VAR,default}, ...)")


def defaults_entry(path: Path, *needles: str) -> int | None:
    """Line of the first defaults entry of `path` whose text holds every needle (else of `defaults:`)."""
    node, _, _ = read_positions(path)
    items = node.get("defaults") if isinstance(node, dict) else None
    if not isinstance(items, list):
        return None
    for i, item in enumerate(items):
        text = repr(yamlio.to_plain(item))
        if all(n in text for n in needles):
            try:
                return items.lc.item(i)[0] + 1
            except (AttributeError, KeyError, TypeError):
                return yamlio.key_line(node, "defaults")
    return yamlio.key_line(node, "defaults")


def hydra_problem(c: Composed, e: Exception, files: dict[str, Path], dirs: list[Path]) -> Problem:
    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    stage = c.path
    m = re.search(r"In '([^']+)': Could not find '([^']+)'", text) or re.search(r"Could not find '([^']+)'", text)
    if m:
        parent = files.get(m.group(1), stage) if m.re.groups == 2 else stage
        missing = m.group(m.re.groups)
        group, _, name = missing.rpartition("/")
        opts = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", text)
        options = [o.strip() for o in opts.group(1).splitlines()] if opts else []
        line = defaults_entry(parent, name or missing)
        searched = [str(d / group) for d in dirs if (d / group).is_dir()] or [str(d / group) for d in dirs[-1:]]
        if group.startswith("exp/") and parent == stage:
            hint = (f"write `- /{group[4:]}@...: {name}`: without the leading `/` Hydra looks in "
                    f"{group}/, next to the stage file")
        elif S.did_you_mean(name, options):
            hint = f"did you mean `{S.did_you_mean(name, options)}`?"
        elif options:
            hint = "available: " + ", ".join(options[:12])
        else:
            hint = "create the file, or fix the name in `defaults`"
        where = f" (searched: {', '.join(searched)})" if searched else ""
        return Problem("error", str(parent), line, "defaults", f"defaults: no config `{missing}.yaml`{where}", hint)
    m = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if m:
        return Problem("error", str(stage), defaults_entry(stage, "override", m.group(1)), "defaults",
                       f"defaults: `override {m.group(1)}` has nothing to override",
                       f"remove `override `: no earlier defaults entry chooses {m.group(1)}")
    m = re.search(r"Multiple values for ([^\s.]+)", text)
    if m:
        return Problem("error", str(stage), defaults_entry(stage, m.group(1).split("@")[0]), "defaults",
                       f"defaults: {m.group(1)} is listed twice",
                       f"keep one entry, or write the second as `- override /{m.group(1)}: NAME`")
    m = re.search(r"Could not override '([^']+)'\.\s*\nTo append to your config use \+", text)
    if m:
        return Problem("error", None, None, m.group(1),
                       f"override `{m.group(1)}=...`: no such key in the config",
                       override_hint(m.group(1), c))
    if "Error parsing override" in text or "mismatched input" in text or "no viable alternative" in text:
        return Problem("error", None, None, None, f"bad override: {first}",
                       "write overrides as key=value (Hydra's override syntax)")
    return Problem("error", str(stage), 1, None, f"Hydra cannot compose this stage: {first}",
                   "fix the file Hydra names; `python -m longspec.train --config-dir CONF +exp=STAGE --cfg job` "
                   "shows the same error")


def override_hint(key: str, c: Composed) -> str:
    from longspec.project.schema import LONGSPEC_SPEC

    close = S.did_you_mean(key, [k for k in LONGSPEC_SPEC if k not in ("defaults", "hydra")])
    return f"did you mean `{close}`?" if close else f"use `+{key}=...` to add a new key (the trainer refuses unknown keys)"


def header_problem(c: Composed) -> None:
    line, read = header_line(c.path)
    if line is not None:
        msg = (f"the stage is merged under `exp.`: its `# @package` header is on line {line}, after another "
               "comment, so Hydra does not read it; the trainer sees `???` for the target and the data")
    else:
        msg = ("the stage is merged under `exp.`: it has no `# @package _global_` header; the trainer sees "
               "`???` for the target and the data")
    c.problems.append(Problem("error", str(c.path), line or 1, None, msg,
                              HEADER_HINT if line else f"add `{HEADER}` as the first line"))
    c.under_exp = True


def missing_problems(c: Composed) -> None:
    header = c.under_exp
    for key in c.missing:
        if key.startswith("exp."):
            continue
        hits = [o for o in c.origins.get(key, []) if o.kind == "file" and o.value == MISSING]
        o = hits[-1] if hits else None
        # output_dir alone may come from the command line (`longspec run` passes the manifest's)
        severity = "warning" if key == "output_dir" and not header and o is None else "error"
        hint = (HEADER_HINT if header else "replace the placeholder with your path" if o else
                f"set `{key}: ...` in {c.path.name}" + (" or pass output_dir=... (a project's `longspec run` "
                                                         "passes the manifest's)" if key == "output_dir" else ""))
        c.problems.append(Problem(severity, str(o.file if o else c.path), o.line if o else None, key,
                                  f"`{key}` must be set: it is `???`"
                                  + ("" if o else " (the trainer's default)"), hint))
