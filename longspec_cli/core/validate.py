"""`longspec validate`: every problem of a project or stage file, as a list of Problems.

    validate_paths([PATH, ...], world_size=None) -> Report(problems, info, files)

A PATH is a project folder (longspec.yaml + conf/), a longspec.yaml, a single stage YAML (ours
or upstream's), or a folder of stage YAMLs. Each check is a small function taking the composed
config; none raises for bad input. Pure: no torch, deepspeed, transformers, hydra, omegaconf.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from longspec_cli.core import schema as S
from longspec_cli.core.compose import (Composed, Origin, Problem, strip_comment, compose_file,
                                       has_placeholder, read_doc)
from longspec_cli.errors import LongspecError, UsageError

__all__ = ["Problem", "Report", "validate_paths", "validate_file", "validate_project"]

DEFAULT_WORLD = 8
LONG_CONTEXT = 8192  # a stage above this many tokens is a long-context stage
WEIGHTS_NAMES = ("draft_model_weights.pth", "draft_model_weights.safetensors")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CKPT = re.compile(r"(?:^|/)checkpoint-(?:last|best|\d+)(?:/|$)")
_NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass
class Context:
    base_dir: Path  # relative paths in a stage file resolve against this
    world: int
    world_from: str
    manifest: Any = None  # manifest.Manifest
    stage: Any = None  # manifest.StageSpec
    earlier: dict[Path, str] = field(default_factory=dict)  # output_dir -> name, stages before this one


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)  # errors and warnings
    info: list[Problem] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)

    def add(self, items: list[Problem]) -> None:
        """Append, once: a file shared by several stages (a DeepSpeed block) is reported once."""
        for p in items:
            target = self.info if p.severity == "info" else self.problems
            if p not in target:
                target.append(p)

    def count(self, severity: str) -> int:
        return sum(p.severity == severity for p in self.problems)

    def strict(self) -> "Report":
        """Warnings promoted to errors (--strict)."""
        promoted = [Problem("error", p.file, p.line, p.key, p.message, p.hint) if p.severity == "warning" else p
                    for p in self.problems]
        return Report(promoted, self.info, self.files)

    def to_json(self) -> dict[str, Any]:
        errors = self.count("error")
        return {"ok": errors == 0, "errors": errors, "warnings": self.count("warning"),
                "problems": [p.to_json() for p in self.problems],
                "info": [p.to_json() for p in self.info], "files": self.files}


# ---------------------------------------------------------------- helpers

def _abs(ctx: Context, value: str) -> Path:
    p = Path(os.path.expanduser(value))
    return Path(os.path.normpath(p if p.is_absolute() else ctx.base_dir / p))


def _usable(value: Any) -> bool:
    """A path-like text worth checking on disk (not a placeholder, not an unresolved ${...})."""
    return isinstance(value, str) and bool(value.strip()) and "${" not in value and not has_placeholder(value)


def _short(c: Composed, o: Origin) -> str:
    """`line 12` in the stage file itself, `deepspeed/zero1.yaml:18` elsewhere."""
    if o.file == c.path:
        return f"line {o.line}" if o.line else c.path.name
    name = f"{o.file.parent.name}/{o.file.name}" if o.file.parent.name else o.file.name
    return f"{name}:{o.line}" if o.line else name


def _at(c: Composed, key: str) -> str:
    return _short(c, c.origin(key))


def _under(p: Path, folder: Path) -> bool:
    return p == folder or folder in p.parents


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


# ---------------------------------------------------------------- per-file checks

def check_unknown_keys(c: Composed, d: str, ctx: Context, specs: dict[str, S.Spec] | None = None) -> list[Problem]:
    out: list[Problem] = []

    def walk(node: dict, specs: dict[str, S.Spec], prefix: str, in_ds: bool) -> None:
        for k, v in node.items():
            dotted = f"{prefix}{k}"
            if k in specs:
                spec = specs[k]
                if spec.children is not None and isinstance(v, dict):
                    walk(v, spec.children, dotted + ".", in_ds or dotted == "ds_cfg")
                continue
            close = S.did_you_mean(str(k), specs)
            if in_ds:
                sev = "warning"  # DeepSpeed grows keys faster than this list
            else:
                sev = "error" if d == S.LONGSPEC or close else "warning"
            hint = f"did you mean `{prefix}{close}`?" if close else (
                "remove it; known keys here: " + ", ".join(sorted(specs))[:200])
            out.append(c.problem(sev, dotted, f"unknown key `{dotted}` ({d} config)", hint))

    walk(c.data, specs if specs is not None else S.SPECS[d], "", False)
    return out


def check_types(c: Composed, d: str, ctx: Context) -> list[Problem]:
    out: list[Problem] = []

    def one(spec: S.Spec, value: Any, dotted: str) -> None:
        if isinstance(value, str) and ("${" in value or has_placeholder(value)):
            return  # reported by compose
        bad = S.check_value(spec, value, dotted, d)
        if bad:
            out.append(c.problem(bad[0], dotted, bad[1], bad[2]))
        elif spec.children is not None and isinstance(value, dict):
            for k, v in value.items():
                if k in spec.children:
                    one(spec.children[k], v, f"{dotted}.{k}")

    for k, v in c.data.items():
        if k in S.SPECS[d]:
            one(S.SPECS[d][k], v, k)
    extra = {**S.DS_VALUES, **(S.UPSTREAM_VALUES if d == S.UPSTREAM else {})}
    for dotted, spec in extra.items():
        if c.has(dotted):
            one(spec, c.get(dotted), dotted)
    return out


REQUIRED = {S.LONGSPEC: ("model_name_or_path", "train_file"),
            S.UPSTREAM: ("model_name_or_path", "train_file", "output_dir")}


def check_required(c: Composed, d: str, ctx: Context) -> list[Problem]:
    out = [c.problem("error", k, f"`{k}` is not set", f"add `{k}: ...` to {c.path.name}")
           for k in REQUIRED[d] if c.get(k) in (None, "")]
    if d == S.LONGSPEC and ctx.stage is None and c.get("output_dir") in (None, ""):
        out.append(c.problem("warning", "output_dir", "`output_dir` is not set",
                             "set it here, or run the stage from a project (longspec.yaml names it)"))
    return out


def check_paths(c: Composed, d: str, ctx: Context) -> list[Problem]:
    out: list[Problem] = []
    train = c.get("train_file")
    if _usable(train):
        p = _abs(ctx, train)
        if p.is_dir():
            out.append(c.problem("error", "train_file", f"train_file {p} is a folder", "point at a .json/.jsonl file"))
        elif not p.exists():
            out.append(c.problem("error", "train_file", f"train_file {p} does not exist",
                                 "fix the path, or create the data file"))
    model = c.get("model_name_or_path")
    if _usable(model) and not _CKPT.search(model):
        p = _abs(ctx, model)
        if p.is_dir():
            if not (p / "config.json").is_file():
                out.append(c.problem("error", "model_name_or_path",
                                     f"model_name_or_path {p} has no config.json (not a Hugging Face model folder)"))
        elif p.exists():
            out.append(c.problem("error", "model_name_or_path", f"model_name_or_path {p} is a file, not a folder"))
        elif _HUB_ID.match(model.strip("/")) and not model.startswith((".", "/", "~")):
            out.append(c.problem("warning", "model_name_or_path",
                                 f"model_name_or_path {model!r} is not a local folder (a hub id?); nothing is downloaded",
                                 f"download it (huggingface-cli download {model.strip('/')} --local-dir DIR) "
                                 "and point model_name_or_path at DIR"))
        else:
            out.append(c.problem("error", "model_name_or_path", f"model_name_or_path {p} does not exist"))
    draft = c.get("draft_model_name_or_path")
    if _usable(draft):
        p = _abs(ctx, draft)
        owner = next((name for out_dir, name in ctx.earlier.items() if _under(p, out_dir)), None)
        if p.exists():
            pass
        elif owner is not None:
            out.append(c.problem("info", "draft_model_name_or_path",
                                 f"draft {p} does not exist yet: stage {owner} will write it"))
        else:
            out.append(c.problem("error", "draft_model_name_or_path", f"draft_model_name_or_path {p} does not exist",
                                 "point at a draft_model_weights.pth, or null for a fresh draft"))
    return out


def _ds_on(c: Composed, block: str) -> bool | None:
    v = c.get(f"ds_cfg.{block}.enabled")
    return v if isinstance(v, bool) else None


def _earlier_true(c: Composed, dotted: str) -> list[Origin]:
    """Places that set `dotted` to true but were overridden later."""
    hits = c.origins.get(dotted, [])
    return [o for o in hits[:-1] if o.value is True and hits[-1].value is not True]


def check_precision(c: Composed, d: str, ctx: Context) -> list[Problem]:
    fp16, bf16 = _ds_on(c, "fp16"), _ds_on(c, "bf16")
    if d == S.LONGSPEC:
        want = c.get("precision", "bf16")
        if want not in S.PRECISIONS:
            return []
        out = []
        for block, on in (("fp16", fp16), ("bf16", bf16)):
            if on is None:
                continue
            if on != (want == block):
                out.append(c.problem("error", f"ds_cfg.{block}.enabled",
                                     f"ds_cfg.{block}.enabled: {str(on).lower()} ({_at(c, f'ds_cfg.{block}.enabled')}) "
                                     f"disagrees with precision: {want} ({_at(c, 'precision')})",
                                     f"delete the ds_cfg.{block} block: the trainer derives it from `precision`"))
        return out
    places: list[tuple[str, str]] = []  # (where, precision)
    dtype = c.get("torch_dtype.dtype")
    if isinstance(dtype, str):
        places.append((f"torch_dtype.dtype: {dtype} ({_at(c, 'torch_dtype.dtype')})",
                       {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)))
    if c.get("fp16") is True:
        amp = "bf16" if c.get("fp16_bfloat16") is True else "fp16"
        extra = f" + fp16_bfloat16: True ({_at(c, 'fp16_bfloat16')})" if amp == "bf16" else ""
        places.append((f"fp16: True ({_at(c, 'fp16')}){extra}", amp))
    for block, on in (("fp16", fp16), ("bf16", bf16)):
        if on:
            places.append((f"ds_cfg.{block}.enabled: True ({_at(c, f'ds_cfg.{block}.enabled')})", block))
    kinds = {p for _, p in places}
    if len(kinds) < 2 and not (fp16 and bf16):
        return []
    lines = [f"{w} -> {p}" for w, p in places]
    for o in _earlier_true(c, "ds_cfg.bf16.enabled") + _earlier_true(c, "ds_cfg.fp16.enabled"):
        lines.append(f"overridden default: {_short(c, o)} enabled: True")
    at = "ds_cfg.fp16.enabled" if fp16 else ("ds_cfg.bf16.enabled" if bf16 else "fp16")
    return [c.problem("error", at, "precision is set in several places and they disagree: " + "; ".join(lines),
                      "pick one precision (the target is bf16: torch_dtype bfloat16, ds_cfg.bf16.enabled: true, "
                      "ds_cfg.fp16.enabled: false)")]


DUPLICATES = (
    ("learning_rate", "ds_cfg.optimizer.params.lr"),
    ("learning_rate", "ds_cfg.scheduler.params.warmup_max_lr"),
    ("adam_betas", "ds_cfg.optimizer.params.betas"),
    ("adam_epsilon", "ds_cfg.optimizer.params.eps"),
    ("weight_decay", "ds_cfg.optimizer.params.weight_decay"),
    ("max_grad_norm", "ds_cfg.gradient_clipping"),
    ("per_gpu_train_batch_size", "ds_cfg.train_micro_batch_size_per_gpu"),
    ("gradient_accumulation_steps", "ds_cfg.gradient_accumulation_steps"),
    ("global_batch_size", "ds_cfg.train_batch_size"),
)


def _same(a: Any, b: Any) -> bool | None:
    """Equal after interpolation? None when either side is not comparable."""
    ba, bb = S.as_betas(a), S.as_betas(b)
    if ba is not None or bb is not None:
        if ba is None or bb is None:
            return None
        return all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(ba, bb))
    na, nb = S.as_number(a), S.as_number(b)
    if na is None or nb is None:
        return None
    return math.isclose(na, nb, rel_tol=1e-9)


def check_duplicates(c: Composed, d: str, ctx: Context) -> list[Problem]:
    out = []
    for a, b in DUPLICATES:
        va, vb = c.get(a), c.get(b)
        if va is None or vb is None or _same(va, vb) is not False:
            continue
        out.append(c.problem(
            "error", b, f"the same hyper-parameter twice with different values: {a} = {_fmt(va)} "
                        f"({_at(c, a)}) but {b} = {_fmt(vb)} ({_at(c, b)})",
            f"keep one: write `{b.split('.', 1)[1]}: ${{{a}}}` in the DeepSpeed block"))
    return out


def _zero_stage(c: Composed) -> int | None:
    if not isinstance(c.get("ds_cfg"), dict):
        return None
    stage = c.get("ds_cfg.zero_optimization.stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def _offloads(block: Any) -> bool:
    return isinstance(block, dict) and block.get("device") not in (None, "none")


def check_zero(c: Composed, d: str, ctx: Context) -> list[Problem]:
    stage = _zero_stage(c)
    if stage is None or not 0 <= stage <= 3:
        return []  # no DeepSpeed block, or a bad stage (reported by check_types)
    z = c.get("ds_cfg.zero_optimization") or {}
    z = z if isinstance(z, dict) else {}
    out = []
    pre = "ds_cfg.zero_optimization"
    if _offloads(z.get("offload_optimizer")) and stage == 0:
        out.append(c.problem("error", f"{pre}.offload_optimizer", "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)",
                             "set zero_optimization.stage >= 1, or remove offload_optimizer"))
    if _offloads(z.get("offload_param")) and stage != 3:
        out.append(c.problem("error", f"{pre}.offload_param", f"offload_param needs ZeRO stage 3 (stage is {stage})",
                             "set zero_optimization.stage: 3, or remove offload_param"))
    for name in ("offload_optimizer", "offload_param"):
        block = z.get(name)
        if _offloads(block) and block.get("device") == "nvme" and not block.get("nvme_path"):
            out.append(c.problem("error", f"{pre}.{name}.device", f"{name} to nvme needs nvme_path",
                                 f"add {name}.nvme_path: /local/nvme"))
        if isinstance(block, dict) and block.get("pin_memory") is True and not _offloads(block):
            out.append(c.problem("warning", f"{pre}.{name}.pin_memory",
                                 f"{name}.pin_memory is true but nothing is offloaded (device {block.get('device')})"))
    s3 = [k for k in z if str(k).startswith("stage3_")]
    if s3 and stage < 3:
        out.append(c.problem("warning", f"{pre}.{s3[0]}",
                             f"{', '.join(s3)} only apply to ZeRO stage 3 (stage is {stage}): ignored",
                             "remove them, or use stage 3"))
    msl = c.get(S.KEYS[d]["max_seq_length"])
    if isinstance(msl, int) and msl > LONG_CONTEXT and stage < 3:
        out.append(c.problem("warning", f"{pre}.stage",
                             f"a {msl}-token stage with ZeRO stage {stage}: long stages run with ZeRO-3",
                             "use the zero3_offload_cosine DeepSpeed config"))
    return out


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def global_batch(c: Composed, ctx: Context) -> int | None:
    pg, ga = _int_or_none(c.get("per_gpu_train_batch_size")), _int_or_none(c.get("gradient_accumulation_steps"))
    return pg * ga * ctx.world if pg and ga else None


def check_batch(c: Composed, d: str, ctx: Context) -> list[Problem]:
    total = global_batch(c, ctx)
    if total is None:
        return []
    pg, ga = c.get("per_gpu_train_batch_size"), c.get("gradient_accumulation_steps")
    formula = f"{pg} per GPU x {ga} accumulation x {ctx.world} GPUs ({ctx.world_from})"
    at = "global_batch_size" if c.has("global_batch_size") else "per_gpu_train_batch_size"
    out = [c.problem("info", "global_batch_size", f"global batch = {formula} = {total}", at=at)]
    want = _int_or_none(c.get("global_batch_size"))
    if want is not None and want != total:
        hint = (f"set global_batch_size: {total}, or change gradient_accumulation_steps to "
                f"{want // (pg * ctx.world)}" if want % (pg * ctx.world) == 0 else f"set global_batch_size: {total}")
        out.append(c.problem("error", "global_batch_size",
                             f"global_batch_size is {want} but {formula} = {total}", hint))
    return out


def _target_limit(c: Composed, d: str, ctx: Context) -> tuple[int, str] | None:
    model = c.get("model_name_or_path")
    if _usable(model):
        cfg = _abs(ctx, model) / "config.json"
        if cfg.is_file():
            try:
                n = json.loads(cfg.read_text(encoding="utf-8")).get("max_position_embeddings")
            except (OSError, ValueError, AttributeError):
                n = None
            if isinstance(n, int) and not isinstance(n, bool):
                return n, f"max_position_embeddings in {cfg}"
    preset = getattr(ctx.manifest, "preset", None)
    if preset:
        context = _preset_context(preset)
        if context:
            return context, f"preset {preset}"
    names = " ".join(str(c.get(k, "")) for k in ("model_name_or_path", "model_name"))
    if "QwQ-32B-Preview" in names and not _CKPT.search(str(c.get("model_name_or_path", ""))):
        return 32768, "QwQ-32B-Preview"
    return None


def _preset_context(name: str) -> int | None:
    """The preset's position limit, read from templates/presets.yaml (fast parse)."""
    from longspec_cli.core import presets

    try:
        table = read_doc(presets.templates_dir() / "presets.yaml").node
        context = table[name]["context"]
    except (FileNotFoundError, OSError, KeyError, TypeError):
        return None
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def check_seq_len(c: Composed, d: str, ctx: Context) -> list[Problem]:
    key = S.KEYS[d]["max_seq_length"]
    msl = _int_or_none(c.get(key))
    limit = _target_limit(c, d, ctx) if msl else None
    if not limit or msl <= limit[0]:
        return []
    return [c.problem("error", key, f"{key} = {msl} exceeds the target's position limit {limit[0]} ({limit[1]})",
                      f"use max_seq_length <= {limit[0]}")]


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
    in_stage = next((n for o, n in _all_outputs(ctx).items() if _usable(model) and _under(_abs(ctx, model), o)),
                    None)
    if not _CKPT.search(model) and "/experiments/" not in model and in_stage is None:
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
                 if isinstance(c.get(r), str) and _CKPT.search(c.get(r) + "/")), "model_name_or_path")


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


FILE_CHECKS: tuple[Callable[[Composed, str, Context], list[Problem]], ...] = (
    check_unknown_keys, check_types, check_required, check_paths, check_precision, check_duplicates,
    check_zero, check_batch, check_seq_len, check_checkpoint_chain, check_upstream_lineage,
)


def _check_file(c: Composed, ctx: Context) -> tuple[list[Problem], dict[str, Any]]:
    problems = list(c.problems)
    summary: dict[str, Any] = {"file": str(c.path), "stage": getattr(ctx.stage, "name", None)}
    if not c.ok:
        return problems, summary
    d = S.dialect_of(c.data)
    if d in (S.DEEPSPEED, S.HYDRA):
        return _check_fragment(c, d, ctx, problems), {**summary, "dialect": d}
    for check in FILE_CHECKS:
        problems += check(c, d, ctx)
    summary.update(dialect=d, world_size=ctx.world, global_batch=global_batch(c, ctx),
                   zero_stage=_zero_stage(c), max_seq_length=c.get(S.KEYS[d]["max_seq_length"]))
    return problems, summary


def _check_fragment(c: Composed, d: str, ctx: Context, problems: list[Problem]) -> list[Problem]:
    """A DeepSpeed or Hydra file given on its own: its ${...} point into the stage that includes it."""
    problems = [p for p in problems if p not in c.unset_refs]
    if d == S.HYDRA:
        return problems + [c.problem("info", None, "Hydra settings, not a stage config: checked for syntax only")]
    wrapped = Composed(c.path, True, {"ds_cfg": c.data}, {f"ds_cfg.{k}": v for k, v in c.origins.items()},
                       {}, c.files)
    problems += check_unknown_keys(wrapped, S.LONGSPEC, ctx, {"ds_cfg": S.DS_SPEC})
    problems += check_types(wrapped, S.LONGSPEC, ctx) + check_zero(wrapped, S.LONGSPEC, ctx)
    return problems + [c.problem("info", None, "DeepSpeed config on its own: its ${...} are filled in by the stage "
                                               "config that lists it in `defaults`")]


def validate_file(path: Path, world_size: int | None = None, cache: dict | None = None) -> Report:
    world, src = (world_size, "--world-size") if world_size else (DEFAULT_WORLD, "default")
    ctx = Context(base_dir=Path.cwd(), world=world, world_from=src)
    c = compose_file(path, cache)
    problems, summary = _check_file(c, ctx)
    rep = Report(files=[summary])
    rep.add(problems)
    return rep


# ---------------------------------------------------------------- projects

def _chain(c: Composed, st: Any, m: Any, ctx: Context) -> list[Problem]:
    key = "draft_model_name_or_path"
    draft = c.get(key)
    if st.draft_from is None:
        if draft is None or not _usable(draft):
            return []
        return [c.problem("error", key, f"stage {st.name} starts the lineage (draft_from: null) but "
                                        f"{key} is {draft}",
                          f"set {key}: null for a fresh draft, or set draft_from for {st.name} in longspec.yaml")]
    parent = next((s for s in m.stages if s.name == st.draft_from), None)
    if parent is None:
        return []
    want = parent.output_dir / WEIGHTS_NAMES[0]
    if draft is None:
        return [c.problem("info", key, f"{key} is null: `longspec next-stage` sets it to {want} once stage "
                                       f"{parent.name} is done")]
    if not _usable(draft):
        return []
    p = _abs(ctx, draft)
    owner = next((s for s in m.stages if _under(p, s.output_dir)), None)
    if owner is parent:
        if p.name in WEIGHTS_NAMES and p.parent == parent.output_dir:
            return []
        return [c.problem("warning", key, f"{key} {p} is not stage {parent.name}'s final draft",
                          f"use {want}")]
    if owner is not None:
        return [c.problem("error", key, f"lineage fork: stage {st.name} has draft_from: {parent.name} but its draft "
                                        f"comes from stage {owner.name} ({p})",
                          f"set {key}: {want}, or change draft_from of {st.name} in longspec.yaml")]
    return [c.problem("warning", key, f"stage {st.name} has draft_from: {parent.name} but its draft {p} is not "
                                      f"that stage's output", f"set {key}: {want}")]


def _manifest_problem(m: Any, line: int | None, key: str, severity: str, message: str,
                      hint: str | None = None) -> Problem:
    return Problem(severity, str(m.path), line, key, message, hint)


def _shared_paths(c: Composed, st: Any, ctx: Context) -> list[Problem]:
    out = []
    for key in ("train_file", "model_name_or_path", "draft_model_name_or_path", "output_dir"):
        v = c.get(key)
        if not _usable(v):
            continue
        p = _abs(ctx, v)
        if not Path(os.path.expanduser(v)).is_absolute():
            out.append(c.problem("warning", key, f"{key} {v!r} is relative: every node of a multi-node launch "
                                                 f"must see it at {p}", "use an absolute path on shared storage"))
        elif str(p).startswith(_NODE_LOCAL):
            out.append(c.problem("warning", key, f"{key} {p} is node-local storage: other nodes cannot see it",
                                 "use a path on shared storage"))
    return out


def _manifest_checks(m: Any) -> list[Problem]:
    """The manifest on its own: unknown keys, shared run folders, multi-node launch settings."""
    out = [_manifest_problem(m, line, k, "warning", f"unknown key `{k}` in longspec.yaml")
           for k, line in getattr(m, "unknown_keys", [])]
    seen: dict[Path, str] = {}
    for st in m.stages:
        if st.output_dir in seen:
            out.append(_manifest_problem(m, st.line, "output_dir", "error",
                                         f"stages {seen[st.output_dir]} and {st.name} both write to {st.output_dir}",
                                         "give every stage its own output_dir"))
        seen.setdefault(st.output_dir, st.name)
    if m.launch.nodes <= 1:
        return out
    if m.launch.hostfile is None:
        out.append(_manifest_problem(m, None, "launch.hostfile", "warning",
                                     f"launch.nodes is {m.launch.nodes} but no hostfile is set",
                                     "set launch.hostfile (DeepSpeed's host list)"))
    elif not Path(m.launch.hostfile).is_file():
        out.append(_manifest_problem(m, None, "launch.hostfile", "error", f"hostfile {m.launch.hostfile} does not exist"))
    places = [(s.output_dir, f"stage {s.name}'s output_dir") for s in m.stages] + [(m.root, "the project")]
    local = next(((p, what) for p, what in places if str(p).startswith(_NODE_LOCAL)), None)
    if local:
        out.append(_manifest_problem(m, None, "launch.nodes", "warning",
                                     f"{local[1]} {local[0]} is node-local storage on a {m.launch.nodes}-node launch",
                                     "use shared storage"))
    return out


def _stage_in_project(c: Composed, st: Any, m: Any, ctx: Context) -> list[Problem]:
    """What only a project can tell: the manifest's run folder, the chain, the target, the nodes."""
    out: list[Problem] = []
    out_dir = c.get("output_dir")
    if _usable(out_dir) and _abs(ctx, out_dir) != st.output_dir:
        out.append(c.problem("error", "output_dir", f"output_dir {_abs(ctx, out_dir)} disagrees with longspec.yaml "
                                                    f"(stage {st.name}: {st.output_dir})",
                             "make them the same (or delete output_dir here: the manifest sets it)"))
    out += _chain(c, st, m, ctx)
    model = c.get("model_name_or_path")
    if m.target is not None and _usable(model) and _abs(ctx, model) != m.target:
        out.append(c.problem("warning", "model_name_or_path",
                             f"model_name_or_path {model} is not the project's target {m.target}"))
    if m.launch.nodes > 1:
        out += _shared_paths(c, st, ctx)
    return out


def validate_project(root: Path, world_size: int | None = None, cache: dict | None = None,
                     only: Path | None = None) -> Report:
    """Every stage of the project at `root` (only the stage whose config is `only`, if given)."""
    from longspec_cli.core.manifest import load_manifest

    rep = Report()
    try:
        m = load_manifest(root)
    except LongspecError as e:  # YamlError carries path and line
        rep.add([Problem("error", str(getattr(e, "path", None) or root / "longspec.yaml"),
                         getattr(e, "line", None) or 1, None, getattr(e, "reason", e.message), e.hint)])
        return rep
    cache = {} if cache is None else cache
    if world_size:
        world, src = world_size, "--world-size"
    else:
        world, src = m.launch.gpus * m.launch.nodes, f"launch: {m.launch.gpus} GPUs x {m.launch.nodes} nodes"
    problems = _manifest_checks(m) if only is None else []
    for i, st in enumerate(m.stages):
        if only is not None and st.config.resolve() != only.resolve():
            continue
        if not st.config.is_file():
            problems.append(_manifest_problem(m, st.line, "config", "error",
                                              f"stage {st.name}: config {st.config} does not exist"))
            continue
        ctx = Context(base_dir=m.root, world=world, world_from=src, manifest=m, stage=st,
                      earlier={s.output_dir: s.name for s in m.stages[:i]})
        c = compose_file(st.config, cache)
        file_problems, summary = _check_file(c, ctx)
        problems += file_problems + (_stage_in_project(c, st, m, ctx) if c.ok else [])
        rep.files.append(summary)
    rep.add(problems)
    return rep


# ---------------------------------------------------------------- entry point

def _project_of(stage_file: Path) -> Path | None:
    for folder in list(stage_file.resolve().parents)[:4]:
        if (folder / "longspec.yaml").is_file():
            return folder
    return None


def _stage_files(folder: Path) -> list[Path]:
    for sub in (folder / "conf" / "exp", folder / "exp", folder):
        files = sorted(p for p in sub.glob("*.yaml") if p.is_file()) if sub.is_dir() else []
        if files:
            return files
    return []


def validate_paths(paths: list[str | os.PathLike], world_size: int | None = None) -> Report:
    """Validate every PATH; UsageError (exit 2) for a path that does not exist."""
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    items = [Path(p) for p in paths]
    missing = [p for p in items if not p.exists()]
    if missing:
        raise UsageError(f"{missing[0]}: no such file or folder",
                         hint="give a project folder (with longspec.yaml) or a stage YAML file")
    rep = Report()
    cache: dict = {}
    for p in items:
        if p.is_dir():
            if (p / "longspec.yaml").is_file():
                sub = validate_project(p, world_size, cache)
            else:
                files = _stage_files(p)
                if not files:
                    raise UsageError(f"{p} holds no longspec.yaml and no stage YAML files",
                                     hint="give a project folder made by `longspec init`, or a stage YAML")
                sub = Report()
                for f in files:
                    _merge_reports(sub, validate_file(f, world_size, cache))
        elif p.name == "longspec.yaml":
            sub = validate_project(p.parent, world_size, cache)
        else:
            sub = _validate_stage_file(p, world_size, cache)
        _merge_reports(rep, sub)
    return rep


def _validate_stage_file(p: Path, world_size: int | None, cache: dict) -> Report:
    project = _project_of(p)
    if project is not None:
        try:
            from longspec_cli.core.manifest import load_manifest

            listed = any(s.config.resolve() == p.resolve() for s in load_manifest(project).stages)
        except LongspecError:
            listed = False
        if listed:
            return validate_project(project, world_size, cache, only=p)
    return validate_file(p, world_size, cache)


def _merge_reports(into: Report, other: Report) -> None:
    into.add(other.problems + other.info)
    into.files += other.files
