"""Checks that need more than one file: the stage chain, upstream lineage forks, the manifest's
run folders and multi-node launch paths.

File checks (`check_x(composed, dialect, ctx)`) look at sibling files or the manifest's stages;
project checks take the manifest too. None raises for bad input.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from longspec.project import schema as S
from longspec.project.checks.common import CHECKPOINT_RE, Context, abs_path, is_under, usable
from longspec.project.composed import Composed
from longspec.project.placeholders import strip_comment
from longspec.project.problem import Problem

WEIGHTS_NAMES = ("draft_model_weights.pth", "draft_model_weights.safetensors")
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")


# ---------------------------------------------------------------- chaining

_RANK_NAMES = {1: "stage 1 (base)", 2: "stage 2 (long context)", 3: "stage 3 (long CoT)"}


def _rank(collator: Any, msl: Any) -> int:
    name = str(collator or "").lower()
    if "cot" in name:
        return 3
    if "long" in name or (isinstance(msl, int) and msl > 4096):
        return 2
    return 1


_TOP = re.compile(r"^([A-Za-z_]\w*):[ \t]*(.*?)\s*$")
_REF = re.compile(r"\$\{([\w.]+)\}")


def _light_scan(path: Path) -> dict[str, Any] | None:
    """A sibling stage file's experiment name and stage rank, from its text (no YAML parse)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flat: dict[str, str] = {}
    for line in text.splitlines():
        m = _TOP.match(strip_comment(line))
        if m:
            flat[m.group(1)] = m.group(2).strip().strip("'\"")
    for _ in range(5):
        flat = {k: _REF.sub(lambda m: flat.get(m.group(1), m.group(0)), v) for k, v in flat.items()}
    col = re.search(r"_target_:\s*\S*collator\S*\.(\w+)|^\s+collator:\s*(\w+)", text, re.M)
    msl = re.search(r"max_seq_length:\s*(\d+)", text)
    name = (flat.get("output_dir") or flat.get("exp_name") or "").rstrip("/").rsplit("/", 1)[-1]
    return {"exp": name, "rank": _rank(col and (col.group(1) or col.group(2)), msl and int(msl.group(1)))}


def check_checkpoint_chain(c: Composed, d: str, ctx: Context) -> list[Problem]:
    """model_name_or_path must stay the target: a previous stage's checkpoint there is the
    upstream hand-typed chain (`model_name: <exp>/checkpoint-last`)."""
    model = c.get("model_name_or_path")
    if not isinstance(model, str):
        return []
    in_stage = next((n for o, n in _all_outputs(ctx).items() if usable(model) and is_under(abs_path(ctx, model), o)),
                    None)
    if not CHECKPOINT_RE.search(model) and "/experiments/" not in model and in_stage is None:
        return []
    carrier = _carrier(c)
    where = f"stage {in_stage}'s output" if in_stage else "a previous stage's checkpoint"
    return [c.problem("error", "model_name_or_path",
                      f"model_name_or_path points at {where} ({model}): the frozen target is replaced by a "
                      f"draft checkpoint (stage chaining typed by hand in `{carrier}`)",
                      "keep model_name_or_path = the target model and set draft_model_name_or_path to the "
                      "previous stage's draft_model_weights.pth (longspec next-stage does this)", at=carrier)]


def _carrier(c: Composed) -> str:
    """The key whose text put the checkpoint into model_name_or_path (upstream: `model_name`)."""
    return next((r for r in c.refs.get("model_name_or_path", [])
                 if isinstance(c.get(r), str) and CHECKPOINT_RE.search(c.get(r) + "/")), "model_name_or_path")


def _all_outputs(ctx: Context) -> dict[Path, str]:
    if ctx.manifest is None:
        return {}
    return {s.output_dir: s.name for s in ctx.manifest.stages}


def check_upstream_lineage(c: Composed, d: str, ctx: Context) -> list[Problem]:
    if d != S.UPSTREAM:
        return []
    out = []
    if "draft_model_name_or_path" not in c.data:
        out.append(c.problem("warning", "draft_model_name_or_path",
                             "draft_model_name_or_path is read by the trainer but this file does not set it",
                             "add draft_model_name_or_path: null (stage 1) or the previous stage's "
                             "draft_model_weights.pth", at="model_name_or_path"))
    model = c.get("model_name_or_path")
    m = re.search(r"([^/]+)/checkpoint-[^/]+/?$", model) if isinstance(model, str) else None
    if not m:
        return out
    parent_exp = m.group(1)
    me = _rank(c.get(S.KEYS[d]["collator"]), c.get(S.KEYS[d]["max_seq_length"]))
    for sib in sorted(c.path.parent.glob("*.yaml")):
        if sib == c.path:
            continue
        info = _light_scan(sib)
        if not info or info["exp"] != parent_exp:
            continue
        if info["rank"] == me - 1:
            return out
        variant = ""
        if ("sinkpi" in c.path.name) != ("sinkpi" in sib.name):
            variant = " (and from the other variant: sinkpi vs standard)"
        skipped = ", ".join(_RANK_NAMES[r] for r in range(info["rank"] + 1, me))
        why = f"skipping {skipped}" if skipped else "which is not the stage before it"
        out.append(c.problem("error", "model_name_or_path",
                             f"lineage fork: {c.path.name} is {_RANK_NAMES[me]} but chains from {sib.name}, "
                             f"{_RANK_NAMES[info['rank']]}, {why}{variant}",
                             f"start {_RANK_NAMES[me]} from the draft of {_RANK_NAMES[me - 1]}",
                             at=_carrier(c)))
        return out
    out.append(c.problem("info", "model_name_or_path",
                         f"chains from experiment {parent_exp}, which no file in {c.path.parent} produces"))
    return out


# ---------------------------------------------------------------- projects

def _chain(c: Composed, st: Any, m: Any, ctx: Context) -> list[Problem]:
    key = "draft_model_name_or_path"
    draft = c.get(key)
    if st.draft_from is None:
        if draft is None or not usable(draft):
            return []
        return [c.problem("error", key, f"stage {st.name} starts the lineage (draft_from: null) but "
                                        f"{key} is {draft}",
                          f"set {key}: null for a fresh draft, or set draft_from for {st.name} in longspec.yaml")]
    parent = next((s for s in m.stages if s.name == st.draft_from), None)
    if parent is None:
        return []
    best = getattr(st, "draft_pick", "final") == "best"          # `next-stage --best`: the parent's best/ draft
    home = parent.output_dir / "best" if best else parent.output_dir
    want = home / WEIGHTS_NAMES[0]
    if draft is None:
        return [c.problem("info", key, f"{key} is null: `longspec next-stage` sets it to {want} once stage "
                                       f"{parent.name} is done")]
    if not usable(draft):
        return []
    p = abs_path(ctx, draft)
    owner = next((s for s in m.stages if is_under(p, s.output_dir)), None)
    if owner is parent:
        if p.name in WEIGHTS_NAMES and p.parent == home:
            return []
        return [c.problem("warning", key, f"{key} {p} is not stage {parent.name}'s {'best' if best else 'final'} draft",
                          f"use {want}")]
    if owner is not None:
        return [c.problem("error", key, f"lineage fork: stage {st.name} has draft_from: {parent.name} but its draft "
                                        f"comes from stage {owner.name} ({p})",
                          f"set {key}: {want}, or change draft_from of {st.name} in longspec.yaml")]
    return [c.problem("warning", key, f"stage {st.name} has draft_from: {parent.name} but its draft {p} is not "
                                      f"that stage's output", f"set {key}: {want}")]


def manifest_problem(m: Any, line: int | None, key: str, severity: str, message: str,
                     hint: str | None = None) -> Problem:
    return Problem(severity, str(m.path), line, key, message, hint)


def _shared_paths(c: Composed, st: Any, ctx: Context) -> list[Problem]:
    out = []
    for key in ("train_file", "model_name_or_path", "draft_model_name_or_path", "output_dir"):
        v = c.get(key)
        if not usable(v):
            continue
        p = abs_path(ctx, v)
        if not Path(os.path.expanduser(v)).is_absolute():
            out.append(c.problem("warning", key, f"{key} {v!r} is relative: every node of a multi-node launch "
                                                 f"must see it at {p}", "use an absolute path on shared storage"))
        elif str(p).startswith(NODE_LOCAL):
            out.append(c.problem("warning", key, f"{key} {p} is node-local storage: other nodes cannot see it",
                                 "use a path on shared storage"))
    return out


def manifest_checks(m: Any) -> list[Problem]:
    """The manifest on its own: unknown keys, shared run folders, multi-node launch settings."""
    out = [manifest_problem(m, line, k, "warning", f"unknown key `{k}` in longspec.yaml")
           for k, line in getattr(m, "unknown_keys", [])]
    seen: dict[Path, str] = {}
    for st in m.stages:
        if st.output_dir in seen:
            out.append(manifest_problem(m, st.line, "output_dir", "error",
                                        f"stages {seen[st.output_dir]} and {st.name} both write to {st.output_dir}",
                                        "give every stage its own output_dir"))
        seen.setdefault(st.output_dir, st.name)
    if m.launch.nodes <= 1:
        return out
    if m.launch.hostfile is None:
        out.append(manifest_problem(m, None, "launch.hostfile", "warning",
                                    f"launch.nodes is {m.launch.nodes} but no hostfile is set",
                                    "set launch.hostfile (DeepSpeed's host list)"))
    elif not Path(m.launch.hostfile).is_file():
        out.append(manifest_problem(m, None, "launch.hostfile", "error", f"hostfile {m.launch.hostfile} does not exist"))
    places = [(s.output_dir, f"stage {s.name}'s output_dir") for s in m.stages] + [(m.root, "the project")]
    local = next(((p, what) for p, what in places if str(p).startswith(NODE_LOCAL)), None)
    if local:
        out.append(manifest_problem(m, None, "launch.nodes", "warning",
                                    f"{local[1]} {local[0]} is node-local storage on a {m.launch.nodes}-node launch",
                                    "use shared storage"))
    return out


def stage_in_project(c: Composed, st: Any, m: Any, ctx: Context) -> list[Problem]:
    """What only a project can tell: the manifest's run folder, the chain, the target, the nodes."""
    out: list[Problem] = []
    written = [o for o in c.origins.get("output_dir", []) if o.kind == "file"]  # `run` overrides it
    out_dir = written[-1].value if written else None
    if usable(out_dir) and abs_path(ctx, out_dir) != st.output_dir:
        out.append(c.problem("error", "output_dir", f"output_dir {abs_path(ctx, out_dir)} disagrees with longspec.yaml "
                                                    f"(stage {st.name}: {st.output_dir})",
                             "make them the same (or delete output_dir here: the manifest sets it)"))
    out += _chain(c, st, m, ctx)
    model = c.get("model_name_or_path")
    if m.target is not None and usable(model) and abs_path(ctx, model) != m.target:
        out.append(c.problem("warning", "model_name_or_path",
                             f"model_name_or_path {model} is not the project's target {m.target}"))
    if m.launch.nodes > 1:
        out += _shared_paths(c, st, ctx)
    return out
