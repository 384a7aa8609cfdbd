"""`longspec run`, step 2: the checks before anything starts.

    preflight overrides (exit 2), validation of the stages that will run (errors refuse unless
              --force), the placement, the memory and disk estimates (warnings; a full disk refuses)
    project_disk_problems  `validate`'s disk check of a project's stages that are not done
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longspec.project.manifest import Manifest, StageSpec
from longspec.errors import LongspecError, RefusedError, UsageError
from longspec_cli.launch import argv as A
from longspec.machine import memory as M
from longspec.project.stageview import StageView
from longspec_cli.launch.plan import Console, StagePlan, composed


def check_overrides(spec: StageSpec, overrides: list[str]) -> None:
    """Hydra's override parser, then the stage composed with the overrides, as the trainer will:
    an override Hydra refuses (a key that is not there, a typo) is a usage error (exit 2) here,
    before anything starts. Values that do not fit (save_steps=0) are validation errors."""
    from longspec.project.hydracompose import stage_overrides

    A.check_overrides(overrides)
    if not overrides or not spec.config.is_file():
        return
    c = composed(spec.config, tuple(stage_overrides(spec.output_dir, overrides)))
    bad = [p for p in c.problems if p.file is None]  # what Hydra refused about the command line
    if bad:
        raise UsageError("bad override(s): " + "; ".join(p.message + (f" ({p.hint})" if p.hint else "")
                                                         for p in bad),
                         hint="overrides are key=value with a key of the stage config (`longspec config "
                              "DIR STAGE` lists them); `+key=value` adds a key")


def validation_problems(manifest: Manifest, plans: list[StagePlan], world: int,
                        only: StagePlan | None = None, overrides: list[str] = (),
                        world_from: str = "--gpus x --num-nodes") -> list[Any]:
    """Errors and warnings for the stages that will run (the manifest's own included).

    Each stage is composed with the command line's overrides, as the trainer will compose it.
    """
    from longspec.project.validate import validate_paths

    targets = [only] if only else [p for p in plans if p.action != "skip"]
    configs = {str(p.spec.config) for p in targets}
    # Stages whose upstream runs first get their draft key from the chain: ignore it until then.
    chained_later = set() if only else {str(p.spec.config) for p in targets
                                        if p.spec.draft_from in {q.spec.name for q in targets}}
    rep = validate_paths([manifest.root], world_size=world, overrides=list(overrides), world_from=world_from)
    out = []
    for prob in rep.problems:
        if prob.file is not None and prob.file not in configs and prob.file != str(manifest.path):
            continue
        if prob.file in chained_later and prob.key == "draft_model_name_or_path":
            continue
        out.append(prob)
    return out


def report_problems(problems: list[Any], console: Console) -> int:
    errors = 0
    for prob in problems:
        where = f"{prob.file}:{prob.line}" if prob.line else str(prob.file)
        text = f"{where}: {prob.message}" + (f" (hint: {prob.hint})" if prob.hint else "")
        if prob.severity == "error":
            errors += 1
            console.err.write(f"error: {text}\n")
        else:
            console.warn(text)
    console.err.flush()
    return errors


def refuse_unless_forced(manifest: Manifest, errors: int, disk_warnings: list[str], *, force: bool,
                         nothing: str = "started", forced: str = "launches anyway", flags: str = "") -> None:
    """The preflight's verdict, one wording for `run` and `run --slurm`: too little disk space or
    validation errors refuse (exit 1) unless --force. `nothing`: what did not happen ("started",
    "submitted"); `forced`: what --force does; `flags`: the command's own flags before --force."""
    again = f"`longspec run {manifest.root}{' ' + flags if flags else ''} --force` {forced}"
    if disk_warnings and not force:
        raise RefusedError(f"not enough free disk space for {len(disk_warnings)} stage(s); nothing was {nothing}",
                           hint=f"free some space, lower save_total_limit or move output_dir; {again}")
    if errors and not force:
        raise RefusedError(f"{errors} validation error(s) in the stage(s) to run; nothing was {nothing}",
                           hint=f"fix them (`longspec validate` lists them), or {again}")


def world_label(res: A.Resources) -> str:
    """Where `run`'s world size comes from, in `run`'s own flags (validate's say --world-size)."""
    per = "CPU ranks" if res.cpu else "GPUs"
    return f"{res.ranks_per_node} {per} per node (--gpus) x {res.nodes} node(s) (--num-nodes)"


def stage_shape(manifest: Manifest, spec: StageSpec, overrides: list[str], res: A.Resources) -> M.StageShape | None:
    """The memory-estimate inputs of a stage, from its composed config + overrides; None if unknown."""
    from longspec.project import presets

    data = _stage_data(spec, overrides)
    if data is None:
        return None
    size = None
    target = data.get("model_name_or_path")
    if isinstance(target, str) and (Path(target) / "config.json").is_file():
        try:
            size = M.ModelSize.from_config_json(Path(target) / "config.json")
        except (ValueError, OSError):
            size = None
    if size is None and manifest.preset:
        try:
            table = presets.get_preset(manifest.preset).size
            size = M.ModelSize.from_mapping({**table, "family": presets.get_preset(manifest.preset).family})
        except (LongspecError, ValueError):
            size = None
    if size is None:
        return None
    ds = data.get("ds_cfg") if isinstance(data.get("ds_cfg"), dict) else {}
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    off = zero.get("offload_optimizer")
    offload = isinstance(off, dict) and str(off.get("device", "none")).lower() in ("cpu", "nvme")
    stage = zero.get("stage") if isinstance(zero.get("stage"), int) else 0
    view = StageView.of(data)
    # On CUDA the attention ladder's fused rungs (flash-attn, else torch's own) keep no mask; only
    # `kernels: reference` keeps the SDPA reference's there.
    flash = (not res.cpu) and view.kernels != "reference"
    return M.StageShape(
        size=size, precision=view.precision, zero_stage=stage, offload_optimizer=offload,
        seq_len=view.max_seq_length, micro_batch=view.per_gpu_train_batch_size,
        world_size=res.world_size, flash=flash, loss_chunk=view.loss_chunk_size,
        sliding_window=view.sliding_window,
        prefetch_params=_count(zero.get("stage3_prefetch_bucket_size"), 100_000_000), cuda=not res.cpu,
        sequence_parallel=view.sequence_parallel_size,
        # Liger's loss where `kernels: fused` requires it; under `auto` a node may run either
        loss_kernel="liger" if flash and view.kernels == "fused" else ("either" if flash else "chunked"),
        reduce_bucket=_count(zero.get("reduce_bucket_size"), 0) or None,
        overlap_comm=_flag(zero.get("overlap_comm"), stage >= 3),
        contiguous_gradients=_flag(zero.get("contiguous_gradients"), True),
        grad_accumulation=view.gradient_accumulation_steps,
    )


def _stage_data(spec: StageSpec, overrides: list[str]) -> dict | None:
    """The stage's config composed with the command-line overrides (None if it does not compose)."""
    from longspec.project.hydracompose import stage_overrides

    c = composed(spec.config, tuple(stage_overrides(spec.output_dir, overrides)))
    if not c.ok or not isinstance(c.data, dict):
        return None
    return c.data


def disk_reports(manifest: Manifest, todo: list[StagePlan], overrides: list[str],
                 res: A.Resources) -> list[tuple[StagePlan, str, str | None]]:
    """(plan, estimate line, warning or None) per stage; stages on one disk add up in order."""
    from longspec.runs.diskspace import existing_parent
    from longspec_cli.launch import disk as D

    out, used = [], {}  # device -> bytes the earlier stages of this run will have written there
    for p in todo:
        shape = stage_shape(manifest, p.spec, overrides, res)
        data = _stage_data(p.spec, overrides) or {}
        if shape is None:
            out.append((p, "disk estimate: unknown (no config.json for the target and no preset size)", None))
            continue
        num = lambda k: data.get(k) if isinstance(data.get(k), int) and not isinstance(data.get(k), bool) else None  # noqa: E731
        est = D.estimate(shape, p.spec.output_dir, save_total_limit=num("save_total_limit"),
                         max_steps=num("max_steps"), save_steps=num("save_steps"),
                         keeps_best=bool(num("eval_steps")) and bool(num("eval_tokens")))
        try:
            dev = existing_parent(p.spec.output_dir).stat().st_dev
        except OSError:
            dev = None
        before = used.get(dev, 0)
        used[dev] = before + est.total
        if before and est.free is not None:
            from dataclasses import replace

            est = replace(est, free=max(0, est.free - before))
        out.append((p, est.line() + (" (after the earlier stages)" if before else ""), est.warning()))
    return out


def project_disk_problems(path) -> list:
    """`validate`: one warning per stage of the project at `path` (a folder or its longspec.yaml)
    whose checkpoints and final weights would not fit on its output_dir's disk. Stages that are
    done are left out; a path that is not a project gives none (validate reports it otherwise)."""
    from longspec.project.manifest import load_manifest
    from longspec.project.problem import Problem
    from longspec.runs.status import project_status

    path = Path(path)
    if not (path / "longspec.yaml").is_file() and path.name != "longspec.yaml":
        return []
    try:
        manifest = load_manifest(path)
        states = {s.name: s.state for s in project_status(manifest)}
    except LongspecError:
        return []
    todo = [StagePlan(spec, "start") for spec in manifest.stages if states.get(spec.name) != "done"]
    res = A.Resources(cpu=True, ranks_per_node=max(1, manifest.launch.gpus), nodes=max(1, manifest.launch.nodes))
    out = []
    for p, _, warning in disk_reports(manifest, todo, [], res):
        if warning:
            out.append(Problem("warning", str(p.spec.config), None, "output_dir", f"stage {p.spec.name}: {warning}",
                               "`longspec run` refuses to start it; `longspec run --force` starts it anyway"))
    return out


def _flag(v: Any, default: bool) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return default


def _count(v: Any, default: int) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return default


def memory_report(manifest: Manifest, spec: StageSpec, overrides: list[str], res: A.Resources,
                  gpu_mem_gib: float | None) -> tuple[list[str], str | None]:
    """(estimate lines, warning or None)."""
    shape = stage_shape(manifest, spec, overrides, res)
    if shape is None:
        return [f"memory estimate: unknown (no config.json for the target and no preset size)"], None
    est = M.estimate(shape, res.ranks_per_node)
    lines = est.lines()
    if gpu_mem_gib:
        cap, where = gpu_mem_gib * M.GiB, f"--gpu-mem {gpu_mem_gib:g}"
    elif res.gpus:
        g = min(res.gpus, key=lambda x: x.memory_mib)
        cap, where = g.memory_mib * 1024 ** 2, f"GPU {g.index} ({g.name})"
    else:
        lines[0] += " [CPU run: informational]"
        return lines, None
    return lines, M.fit_warning(est, cap, where)


def resolve_placement(manifest: Manifest, p: A.Placement) -> A.Placement:
    """CLI flags win; the manifest's launch block fills hostfile and node count."""
    from dataclasses import replace

    if p.hostfile is None and manifest.launch.hostfile is not None:
        p = replace(p, hostfile=manifest.launch.hostfile,
                    num_nodes=p.num_nodes or (manifest.launch.nodes if manifest.launch.nodes > 1 else None))
    return p
