"""Checks of one composed stage config: keys, types, required keys, paths, precision,
duplicated hyper-parameters, ZeRO settings, batch arithmetic, sequence length.

Each check is `check_x(composed, dialect, ctx) -> [Problem, ...]` and never raises for bad input.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from longspec.project import schema as S
from longspec.project.checks.common import (CHECKPOINT_RE, Context, abs_path, fmt_value, is_under, usable,
                                             where_origin, where_set)
from longspec.project.composed import Composed, Origin
from longspec.project.placeholders import has_placeholder
from longspec.project.problem import Problem

LONG_CONTEXT = 8192  # a stage above this many tokens is a long-context stage
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_unknown_keys(c: Composed, d: str, ctx: Context, specs: dict[str, S.Spec] | None = None) -> list[Problem]:
    out: list[Problem] = []

    def walk(node: dict, specs: dict[str, S.Spec], prefix: str, in_ds: bool) -> None:
        for k, v in node.items():
            dotted = f"{prefix}{k}"
            if not prefix and k == "exp" and c.under_exp:
                continue  # the header problem says it
            if k in specs:
                spec = specs[k]
                if spec.children is not None and isinstance(v, dict):
                    walk(v, spec.children, dotted + ".", in_ds or dotted == "ds_cfg")
                continue
            close = S.did_you_mean(str(k), specs)
            if not prefix and d == S.LONGSPEC and str(k) in S.UPSTREAM_TO_LONGSPEC:
                out.append(c.problem("error", dotted, f"unknown key `{dotted}`: an upstream LongSpec key",
                                     S.UPSTREAM_TO_LONGSPEC[str(k)]))
                continue
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
            out.append(c.problem(bad[0], dotted, bad[1], bad[2] or f"change `{dotted}` where it is set "
                                                                   f"({where_set(c, dotted)})"))
        elif spec.children is not None and isinstance(value, dict):
            for k, v in value.items():
                if k in spec.children:
                    one(spec.children[k], v, f"{dotted}.{k}")

    for k, v in c.data.items():
        if k in S.SPECS[d]:
            one(S.SPECS[d][k], v, k)
    if d == S.LONGSPEC:  # an upstream key's value, checked as the longspec key it stands for
        for up, ours in S.UPSTREAM_VALUE_OF.items():
            spec = S.SPECS[d]
            for part in ours.split("."):
                spec = spec[part] if isinstance(spec, dict) else (spec.children or {}).get(part)
            if c.has(up) and spec is not None:
                bad = S.check_value(spec, c.get(up), up, d)
                if bad:
                    out.append(c.problem(bad[0], up, bad[1], f"write it as `{ours}`"))
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
    if usable(train):
        out += _train_file(c, d, abs_path(ctx, train))
    model = c.get("model_name_or_path")
    if usable(model) and not CHECKPOINT_RE.search(model):
        p = abs_path(ctx, model)
        if p.is_dir():
            if not (p / "config.json").is_file():
                out.append(c.problem("error", "model_name_or_path",
                                     f"model_name_or_path {p} has no config.json (not a Hugging Face model folder)"))
        elif p.exists():
            out.append(c.problem("error", "model_name_or_path", f"model_name_or_path {p} is a file, not a folder"))
        elif HUB_ID.match(model.strip("/")) and not model.startswith((".", "/", "~")):
            out.append(c.problem("warning", "model_name_or_path",
                                 f"model_name_or_path {model!r} is not a local folder (a hub id?); nothing is downloaded",
                                 f"download it (huggingface-cli download {model.strip('/')} --local-dir DIR) "
                                 "and point model_name_or_path at DIR"))
        else:
            out.append(c.problem("error", "model_name_or_path", f"model_name_or_path {p} does not exist"))
    draft = c.get("draft_model_name_or_path")
    if usable(draft):
        p = abs_path(ctx, draft)
        owner = next((name for out_dir, name in ctx.earlier.items() if is_under(p, out_dir)), None)
        if p.exists():
            pass
        elif owner is not None:
            out.append(c.problem("info", "draft_model_name_or_path",
                                 f"draft {p} does not exist yet: stage {owner} will write it"))
        else:
            out.append(c.problem("error", "draft_model_name_or_path", f"draft_model_name_or_path {p} does not exist",
                                 "point at a draft_model_weights.pth, or null for a fresh draft"))
    return out


def _train_file(c: Composed, d: str, p) -> list[Problem]:
    """The data exists and can be read: JSON text, or parquet/arrow whose first file's columns fit
    the stage's collator (its schema alone is read; pyarrow only for such files)."""
    from longspec.formats import datafiles

    if not datafiles.names_data(p):
        return [c.problem("error", "train_file", f"train_file {p} does not exist", "fix the path, or create the data file")]
    try:
        src = datafiles.resolve(p)
        if not src.table:
            return []
        names = datafiles.columns(src)
    except datafiles.SourceError as e:
        if e.hint == datafiles.PYARROW_HINT:
            return [c.problem("warning", "train_file", f"train_file {p}: columns not checked ({e.message})", e.hint)]
        return [c.problem("error", "train_file", f"train_file {e.message}", e.hint)]
    collator = c.get(S.KEYS[d]["collator"])
    if collator not in datafiles.COLLATOR_COLUMNS or datafiles.fitting(collator, names):
        return []
    return [c.problem("error", "train_file",
                      f"train_file {src.files[0]}: its columns ({', '.join(names) or 'none'}) fit no "
                      f"{collator} record, which needs {datafiles.wanted(collator)}",
                      "rename the columns, or give this data to the stage whose collator reads them")]


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
                                     f"ds_cfg.{block}.enabled: {str(on).lower()} ({where_set(c, f'ds_cfg.{block}.enabled')}) "
                                     f"disagrees with precision: {want} ({where_set(c, 'precision')})",
                                     f"delete the ds_cfg.{block} block: the trainer derives it from `precision`"))
        return out
    places: list[tuple[str, str]] = []  # (where, precision)
    dtype = c.get("torch_dtype.dtype")
    if isinstance(dtype, str):
        places.append((f"torch_dtype.dtype: {dtype} ({where_set(c, 'torch_dtype.dtype')})",
                       {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)))
    if c.get("fp16") is True:
        amp = "bf16" if c.get("fp16_bfloat16") is True else "fp16"
        extra = f" + fp16_bfloat16: True ({where_set(c, 'fp16_bfloat16')})" if amp == "bf16" else ""
        places.append((f"fp16: True ({where_set(c, 'fp16')}){extra}", amp))
    for block, on in (("fp16", fp16), ("bf16", bf16)):
        if on:
            places.append((f"ds_cfg.{block}.enabled: True ({where_set(c, f'ds_cfg.{block}.enabled')})", block))
    kinds = {p for _, p in places}
    if len(kinds) < 2 and not (fp16 and bf16):
        return []
    lines = [f"{w} -> {p}" for w, p in places]
    for o in _earlier_true(c, "ds_cfg.bf16.enabled") + _earlier_true(c, "ds_cfg.fp16.enabled"):
        lines.append(f"overridden default: {where_origin(c, o)} enabled: True")
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
            "error", b, f"the same hyper-parameter twice with different values: {a} = {fmt_value(va)} "
                        f"({where_set(c, a)}) but {b} = {fmt_value(vb)} ({where_set(c, b)})",
            f"keep one: write `{b.split('.', 1)[1]}: ${{{a}}}` in the DeepSpeed block"))
    return out


def zero_stage(c: Composed) -> int | None:
    if not isinstance(c.get("ds_cfg"), dict):
        return None
    stage = c.get("ds_cfg.zero_optimization.stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def _offloads(block: Any) -> bool:
    return isinstance(block, dict) and block.get("device") not in (None, "none")


def check_zero(c: Composed, d: str, ctx: Context) -> list[Problem]:
    stage = zero_stage(c)
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


def _data_parallel(c: Composed, ctx: Context) -> tuple[int, str]:
    """(data-parallel ranks, how they are counted): the SP ranks of a group share each sequence."""
    sp = _int_or_none(c.get("sequence_parallel_size")) or 1
    if sp > 1 and ctx.world % sp == 0:
        return ctx.world // sp, f"{ctx.world // sp} data-parallel ({ctx.world} GPUs ({ctx.world_from}) / SP {sp})"
    return ctx.world, f"{ctx.world} GPUs ({ctx.world_from})"


def global_batch(c: Composed, ctx: Context) -> int | None:
    pg, ga = _int_or_none(c.get("per_gpu_train_batch_size")), _int_or_none(c.get("gradient_accumulation_steps"))
    return pg * ga * _data_parallel(c, ctx)[0] if pg and ga else None


def check_batch(c: Composed, d: str, ctx: Context) -> list[Problem]:
    total = global_batch(c, ctx)
    if total is None:
        return []
    pg, ga = c.get("per_gpu_train_batch_size"), c.get("gradient_accumulation_steps")
    dp, counted = _data_parallel(c, ctx)
    formula = f"{pg} per GPU x {ga} accumulation x {counted}"
    at = "global_batch_size" if c.has("global_batch_size") else "per_gpu_train_batch_size"
    out = [c.problem("info", "global_batch_size", f"global batch = {formula} = {total}", at=at)]
    want = _int_or_none(c.get("global_batch_size"))
    if want is not None and want != total:
        hint = (f"set global_batch_size: {total}, or change gradient_accumulation_steps to "
                f"{want // (pg * dp)}" if want % (pg * dp) == 0 else f"set global_batch_size: {total}")
        out.append(c.problem("error", "global_batch_size",
                             f"global_batch_size is {want} but {formula} = {total}", hint))
    return out


def _target_limit(c: Composed, d: str, ctx: Context) -> tuple[int, str] | None:
    model = c.get("model_name_or_path")
    if usable(model):
        cfg = abs_path(ctx, model) / "config.json"
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
    if "QwQ-32B-Preview" in names and not CHECKPOINT_RE.search(str(c.get("model_name_or_path", ""))):
        return 32768, "QwQ-32B-Preview"
    return None


def _preset_context(name: str) -> int | None:
    """The preset's position limit (project.presets owns the table)."""
    from longspec.project import presets
    from longspec.errors import LongspecError

    try:
        context = presets.get_preset(name).context
    except (LongspecError, OSError, TypeError):
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
