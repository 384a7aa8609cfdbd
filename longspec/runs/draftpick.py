"""Which draft of its upstream stage a stage starts from: the final one (default) or the best one
(best/, the highest simulated tau of the upstream's run), and the manifest line that records it.

`longspec next-stage --best` chains the best draft and writes `draft_pick: best` into the stage's
entry of longspec.yaml; a plain `next-stage` chains the final draft and sets it back to `final`
(or leaves the key out). `status`, `run`'s plan and its chaining read the choice from the manifest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from longspec.runs import runfolder
from longspec.files import yamlio
from longspec.project.manifest import Manifest, StageSpec
from longspec.errors import RefusedError

DRAFT_KEY = "draft_model_name_or_path"   # the stage key that names the draft a stage starts from

KEY = "draft_pick"


def upstream_draft(prev: StageSpec, pick: str) -> Path | None:
    """The finished upstream stage's final draft, or (pick "best") its verified best draft; None
    when the stage is not finished or has no best draft."""
    rd = runfolder.RunDir(prev.output_dir)
    final = rd.finished_draft()
    if final is None or pick != "best":
        return final
    return rd.best_draft()


def record_pick(manifest: Manifest, stage: str, pick: str) -> bool:
    """Write `draft_pick: <pick>` into `stage`'s block entry of longspec.yaml (one line, added after
    its last key or replaced); "final" with no such line is left as it is. True when the file changed."""
    from longspec.files.atomic import atomic_write_text, locked

    path = manifest.path
    with locked(path):
        text = yamlio.read_text(path)
        data = yamlio.parse(text, path)
        entry = next((e for e in data.get("stages") or [] if isinstance(e, dict) and e.get("name") == stage), None)
        if entry is None:
            raise RefusedError(f"{path}: no stage {stage!r}")
        current = entry.get(KEY, "final")
        if current == pick or (pick == "final" and KEY not in entry):
            return False
        lines = text.splitlines(keepends=True)
        if getattr(entry, "fa", None) is not None and entry.fa.flow_style():
            i = entry.lc.line                               # `- {name: ..., draft_from: ...}` on one line
            line = lines[i] if i < len(lines) else ""
            if KEY in entry:
                line = re.sub(rf"\b{KEY}\s*:\s*[A-Za-z]+", f"{KEY}: {pick}", line, count=1)
            elif line.count("}") == 1:
                line = line.replace("}", f", {KEY}: {pick}}}")
            lines[i:i + 1] = [line]
        elif KEY in entry:
            i = entry.lc.key(KEY)[0]
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            end = "\r\n" if lines[i].endswith("\r\n") else "\n"
            lines[i] = f"{indent}{KEY}: {pick}{end}"
        else:
            keys = list(entry)
            rows = [entry.lc.key(k)[0] for k in keys]
            last = max(rows)
            col = entry.lc.key(keys[0])[1]
            end = "\r\n" if lines[last].endswith("\r\n") else "\n"
            if not lines[last].endswith(("\n", "\r")):
                lines[last] += end
            lines.insert(last + 1, f"{' ' * col}{KEY}: {pick}{end}")
        new = "".join(lines)
        check = yamlio.parse(new, path)
        after = next(e for e in check["stages"] if isinstance(e, dict) and e.get("name") == stage)
        if after.get(KEY) != pick or yamlio.to_plain({k: v for k, v in after.items() if k != KEY}) != \
                yamlio.to_plain({k: v for k, v in entry.items() if k != KEY}):
            raise RefusedError(f"{path}: could not record `{KEY}: {pick}` for stage {stage} without changing "
                               "anything else", hint=f"write `{KEY}: {pick}` into the entry by hand")
        atomic_write_text(path, new)
    return True


def composed_draft(config: Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Any, str | None]:
    """(the draft path the trainer will read, None or why the stage does not compose)."""
    from longspec.project.hydracompose import compose_stage

    c = compose_stage(config, list(overrides))
    errors = [p for p in c.problems if p.severity == "error" and p.key in (None, "defaults")]
    if not c.ok or errors:
        first = (errors or [p for p in c.problems if p.severity == "error"] or [None])[0]
        return c.get(DRAFT_KEY), (f"{first.where()}: {first.message}" if first else "Hydra cannot compose it")
    return c.get(DRAFT_KEY), None
