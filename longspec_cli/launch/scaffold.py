"""`longspec init`: render the templates into a project (manifest + conf/ tree).

Rendering is pure and happens in memory (`plan_project`); `write_project` then writes every
file atomically, refusing to overwrite anything unless forced. The wizard and the flag path
build the same `InitAnswers`, so the same answers give the same files.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.machine.memory import ModelSize
from longspec.project import presets as P
from longspec.project import sizing
from longspec.project import targets
from longspec.files.atomic import atomic_write_text
from longspec_cli.launch.trainer import deepspeed_line
from longspec.errors import RefusedError, UsageError

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_PLAIN = re.compile(r"^[A-Za-z0-9_./@+-][A-Za-z0-9_./@+=-]*$")
MISSING = "???"  # Hydra's "must be set" marker: `validate` reports it


@dataclass
class InitAnswers:
    project_dir: Path
    preset: str | None = None
    target: str | None = None
    variant: str = "sinkpi-slicing"
    data: dict[str, str] = field(default_factory=dict)
    stages: tuple[str, ...] = P.STAGE_ORDER
    output_root: str | None = None
    gpus: int | None = None
    nodes: int = 1
    hostfile: str | None = None
    precision: str | None = None
    name: str | None = None
    full_size: bool = False          # the recipe's sizes whatever the machine (--full-size)
    machine: Any = None              # longspec.project.sizing.Machine; None: this machine, detected


def yaml_scalar(value: Any) -> str:
    """One value as YAML text: null/true/numbers plain, strings plain when safe, else quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if text == MISSING:
        return "'???'"
    reserved = text.lower() in {"null", "true", "false", "yes", "no", "on", "off", "~", ""}
    if _PLAIN.match(text) and not reserved and not _looks_numeric(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _float(value: float) -> str:
    """Floats that YAML 1.1 (OmegaConf) and 1.2 (ruamel) both read as floats: 5.0e-06, not 5e-06."""
    text = repr(value)
    if "e" in text:
        mantissa, exp = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        text = f"{mantissa}e{exp}"
    return text


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def render(template: str, values: dict[str, Any]) -> str:
    """Fill `{{name}}` placeholders; every placeholder must have a value."""

    def sub(m: re.Match) -> str:
        key = m.group(1)
        if key not in values:
            raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
        value = values[key]
        if isinstance(value, _Raw) or key in _TEXT_KEYS:
            return str(value)
        return yaml_scalar(value)

    return _PLACEHOLDER.sub(sub, template)


class _Raw(str):
    """Text inserted as-is (already YAML)."""


# Placeholders inside comments: inserted as plain text, never quoted.
_TEXT_KEYS = {"title", "data_hint", "run_command", "run_command_cli", "project_dir", "world_size",
              "notes", "msl_note", "target_note", "reference", "variant", "sequence_parallel_line"}
# positions.threshold in templates/exp/stage.yaml: only sequences up to this long get an offset.
OFFSET_THRESHOLD = 1200
# Collators whose records include chats (rendered with the target's chat template).
CHAT_COLLATORS = ("long_data", "long_cot")


def local_target(target: str | None) -> targets.TargetInfo | None:
    """What a local target folder says about itself (config.json, tokenizer files), or None for
    a hub id / a path not on this machine. RefusedError for an unsupported family."""
    if not target:
        return None
    path = Path(target).expanduser()
    if not path.is_dir():
        return None
    return targets.read_target(path.resolve())


def target_notes(info: targets.TargetInfo | None, context: int, capped: dict[str, int]) -> list[str]:
    """One-line notes about what init took from the target (printed, and kept in the files)."""
    if info is None:
        return []
    notes = [f"target: {info.family} family, {info.position_limit or '?'} positions (max_position_embeddings), "
             f"precision {info.precision or 'not stated (torch_dtype absent)'}"]
    for stage, wanted in capped.items():
        notes.append(f"{stage}: max_seq_length capped at the target's {context} positions (stage default {wanted})")
    notes.append("chats render with the target's chat template (" + info.chat_template + ")" if info.chat_template
                 else "the target's tokenizer has no chat template: chat records render as plain 'role: content' lines")
    return notes


def _resolve_answers(a: InitAnswers) -> tuple[P.Preset | None, str, str, int, targets.TargetInfo | None]:
    preset = P.get_preset(a.preset) if a.preset else None
    if a.variant not in P.VARIANTS:
        raise UsageError(f"unknown variant {a.variant!r}", hint="variants: " + ", ".join(P.VARIANTS))
    unknown = [s for s in a.stages if s not in P.STAGE_ORDER]
    if unknown or not a.stages:
        raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none)'}",
                         hint="stages: " + ", ".join(P.STAGE_ORDER))
    bad_data = [s for s in a.data if s not in a.stages]
    if bad_data:
        raise UsageError(f"--data names stage(s) not in this project: {', '.join(bad_data)}",
                         hint="use STAGE=PATH with STAGE one of " + ", ".join(a.stages))
    target = a.target or (preset.target if preset else None)
    if preset is not None and preset.local and not a.target:
        target = str(local_target_dir(a.project_dir.resolve()))
    if not target:
        raise UsageError("no target model", hint="pass --preset NAME or --target PATH")
    info = local_target(a.target)
    precision = a.precision or (info.precision if info else None) or (preset.precision if preset else "bf16")
    if precision not in P.PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}", hint="one of " + ", ".join(P.PRECISIONS))
    gpus = a.gpus if a.gpus is not None else (preset.gpus if preset else 8)
    if gpus < 1 or a.nodes < 1:
        raise UsageError("--gpus and --nodes must be at least 1")
    return preset, target, precision, gpus, info


def _sizing(a: InitAnswers, preset: P.Preset | None, info: targets.TargetInfo | None, precision: str,
            context: int) -> sizing.Sizing | None:
    """How the stages are sized to the target and the machine (longspec.project.sizing); None for
    a preset built here (tiny), whose stages are already its own."""
    if preset is not None and preset.local:
        return None
    size = None
    try:
        if info is not None:
            size = ModelSize.from_config_json(info.path / "config.json")
        elif preset is not None and preset.size:
            size = ModelSize.from_mapping({**preset.size, "family": preset.family})
    except (ValueError, OSError, TypeError):
        size = None
    m = a.machine if a.machine is not None else sizing.machine(declared_gpus=a.gpus)
    stages = {s: P.stage_defaults(s, preset) for s in a.stages}
    return sizing.size_stages(stages, size, m, precision=precision, nodes=a.nodes, full=a.full_size,
                              context=context)


def plan_project(a: InitAnswers) -> dict[Path, str]:
    """Every file `init` would write, path -> text. Pure: touches nothing but reads a local
    target's config.json and tokenizer files (family, position limit, precision, chat template)."""
    return _plan(a)[0]


def plan_with_notes(a: InitAnswers) -> tuple[dict[Path, str], list[str]]:
    """plan_project plus the notes on what was taken from the target (for init to print)."""
    return _plan(a)


def _plan(a: InitAnswers) -> tuple[dict[Path, str], list[str]]:
    preset, target, precision, gpus, info = _resolve_answers(a)
    root = a.project_dir.resolve()
    conf = root / "conf"
    out_root = Path(a.output_root).expanduser() if a.output_root else root / "runs"
    if not out_root.is_absolute():
        out_root = (root / out_root).resolve()
    tdir = P.templates_dir()
    context = (info.position_limit if info else None) or (preset.context if preset else 32768)
    max_offset = preset.max_offset if preset and info is None else P.default_max_offset(context)
    capped: dict[str, int] = {}
    offload = "none" if precision == "fp32" and preset is not None and preset.local else "cpu"
    sized = _sizing(a, preset, info, precision, context)
    if sized is not None and a.gpus is None:
        gpus = sized.gpus
    world = gpus * a.nodes

    files: dict[Path, str] = {}
    stage_tpl = (tdir / "exp" / "stage.yaml").read_text()
    manifest_rows = []
    previous: str | None = None
    used_ds: set[str] = set()
    for stage in a.stages:
        sd = {**P.stage_defaults(stage, preset), **(sized.stages.get(stage, {}) if sized else {})}
        msl = sd["max_seq_length"]
        if msl > context:
            capped[stage] = msl
        msl = min(msl, context)
        out_dir = out_root / stage
        data = a.data.get(stage)
        if data is None and preset is not None and preset.local:
            data = str(local_data_file(root, stage))
        sp = int(sd.get("sequence_parallel_size") or 1)      # a preset's long stage past 32k
        dp = world // sp if world % sp == 0 else world       # validate names an SP that does not divide
        values = {
            **sd,
            **P.variant_values(a.variant, stage),
            "variant": a.variant,
            "stage": stage,
            "gpus": gpus,
            "world_size": f"{world} GPUs" if sp == 1 else f"{dp} data-parallel ({world} GPUs / SP {sp})",
            "sequence_parallel_line": "" if sp == 1 else (
                f"\nsequence_parallel_size: {sp}  # GPUs sharing each sequence (DeepSpeed Ulysses): "
                f"each holds {msl // sp} of its {msl} tokens"),
            "run_command": deepspeed_line(gpus, conf, stage, out_dir),
            "run_command_cli": shlex.join(["longspec", "run", str(root), stage]),
            "project_dir": str(root),
            "target": target,
            "draft_model_name_or_path": None,
            "train_file": data or MISSING,
            "output_dir": str(out_dir),
            "precision": precision,
            "max_seq_length": msl,
            "msl_note": f"  # capped at the target's {context} positions (stage default {capped[stage]})"
                        if stage in capped else "",
            # offsets keep the shifted positions of an offset sequence inside the target's limit
            "max_offset": max(0, min(max_offset, context - min(msl, OFFSET_THRESHOLD))),
            "notes": _stage_notes(info, sd["collator"]),
            "global_batch_size": sd["per_gpu_train_batch_size"] * sd["gradient_accumulation_steps"] * dp,
        }
        files[conf / "exp" / f"{stage}.yaml"] = render(stage_tpl, values)
        used_ds.add(sd["deepspeed"])
        rel_out = _rel(out_dir, root)
        manifest_rows.append(
            f"  - name: {stage}\n"
            f"    config: conf/exp/{stage}.yaml\n"
            f"    output_dir: {yaml_scalar(rel_out)}\n"
            f"    draft_from: {yaml_scalar(previous)}"
        )
        previous = stage
    for ds in sorted(used_ds):
        text = (tdir / "deepspeed" / f"{ds}.yaml").read_text()
        files[conf / "deepspeed" / f"{ds}.yaml"] = render(
            text, {"offload_device": offload, "pin_memory": offload == "cpu"}
        )
    files[root / "longspec.yaml"] = render(
        (tdir / "manifest.yaml").read_text(),
        {
            "project_dir": shlex.quote(str(root)),
            "name": a.name or root.name,
            "preset": a.preset,
            "variant": a.variant,
            "target": target,
            "target_note": f"  # {info.family} family, {info.position_limit or '?'} positions" if info else "",
            "gpus": gpus,
            "nodes": a.nodes,
            "hostfile": a.hostfile,
            "stages": _Raw("\n".join(manifest_rows)),
        },
    )
    notes = target_notes(info, context, capped)
    return files, notes[:1] + (sized.notes if sized else []) + notes[1:]


def _stage_notes(info: targets.TargetInfo | None, collator: str) -> str:
    """Comment lines under a stage file's run commands: the target's family and chat template."""
    if info is None:
        return ""
    lines = [f"# Target: {info.family} family, {info.position_limit or '?'} positions (its config.json)"]
    if collator in CHAT_COLLATORS:
        lines.append(f"# Chats render with the target's chat template ({info.chat_template})" if info.chat_template
                     else "# The target's tokenizer has no chat template: chats render as plain 'role: content' lines")
    return "\n" + "\n".join(lines)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def write_project(files: dict[Path, str], *, force: bool = False) -> list[Path]:
    """Write the planned files atomically. Refuses (writing nothing) if any exists, unless forced."""
    existing = [p for p in files if p.exists()]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:3]) + (" ..." if len(existing) > 3 else "")
        raise RefusedError(f"{len(existing)} file(s) already exist: {shown}",
                           hint="pass --force to overwrite them, or choose another folder")
    for path, text in files.items():
        atomic_write_text(path, text)
    return list(files)


# The tiny preset's assets, built into the project by `python -m longspec.tiny build`.
def local_target_dir(root: Path) -> Path:
    return root / "assets" / "target"


def local_data_file(root: Path, stage: str) -> Path:
    return root / "assets" / "data" / f"{stage}.jsonl"


def build_local_assets(root: Path) -> dict[str, Any]:
    """Build the tiny target and data into ROOT/assets in a subprocess (the CLI never imports torch)."""
    from longspec_cli.launch import trainer

    if not trainer.trainer_available():
        raise RefusedError("the tiny preset builds a model locally and needs the trainer's packages",
                           hint="pip install 'longspec[train]'")
    run = trainer.run_module(trainer.tiny_argv(root / "assets"))
    if run.code != 0 or run.result is None:
        tail = "\n".join([line for line in run.tail if line.strip()][-8:])
        raise RefusedError(f"building the tiny preset failed (exit {run.code}):\n{tail}")
    return run.result
