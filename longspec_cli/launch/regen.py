"""Regeneration from the CLI: `longspec regenerate`'s work (its options checked, each stage's
`python -m longspec.regenerate` run, `--use`'s edit of the stage file), and the demo's plan (`longspec demo --regenerate`: each stage's data written again by
the tiny target before the stages train). Used by commands/regenerate.py and commands/demo.py.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from longspec.errors import INTERRUPTED, PREEMPTED, ROWS_FAILED, SERVERS_GONE, LongspecError

# The demo's regeneration: a document keeps this many tokens as context (the base stage's
# max_seq_length is 128, so the command's default of 128 would leave no room for an answer), and
# the records after the ones training draws (the held-out prompts eval decodes) are regenerated too.
DEMO_PREFIX_TOKENS = 32
DEMO_HELD_OUT = 40


def run_stage(spec, out: Path, flags: list[str], show_progress: bool, rerun: str) -> dict:
    """`python -m longspec.regenerate` for one stage; its JSON summary. `rerun`: the command its
    messages and manifest name to go on."""
    from longspec_cli.launch.trainer import regenerate_argv, run_trainer_json

    return run_trainer_json(regenerate_argv(spec, out, flags, rerun), show_progress=show_progress,
                            allow_codes=(PREEMPTED, INTERRUPTED, SERVERS_GONE, ROWS_FAILED))


@dataclass(frozen=True)
class RegenRequest:
    """`longspec regenerate`'s options (the module's defaults are the same)."""
    project_dir: Path
    stages: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    key_envs: tuple[str, ...] = ()                # variable names, never keys
    concurrency: int = 4
    server_wait: int = 60
    api: str = "completions"
    batch: int = 8
    prefix_tokens: int = 128
    max_new_tokens: int | None = None
    limit: int | None = None
    use: bool = False
    force: bool = False
    keep_truncated: bool = False
    idle_timeout: int = 120
    retries: int = 5
    served_model: str | None = None


def regen_flags(req: RegenRequest) -> list[str]:
    """The module's flags as given (defaults left out), so the rerun command reads as typed."""
    flags = [a for u in req.servers for a in ("--server", u)]
    flags += [a for n in req.key_envs for a in ("--api-key-env", n)]
    defaults = RegenRequest(req.project_dir)
    for name, attr in (("--concurrency", "concurrency"), ("--server-wait", "server_wait"),
                       ("--idle-timeout", "idle_timeout"), ("--retries", "retries"), ("--served-model", "served_model"),
                       ("--api", "api"),
                       ("--batch", "batch"), ("--prefix-tokens", "prefix_tokens"),
                       ("--max-new-tokens", "max_new_tokens"), ("--limit", "limit")):
        value = getattr(req, attr)
        flags += [name, str(value)] if value != getattr(defaults, attr) else []
    return flags + (["--force"] if req.force else []) + (["--keep-truncated"] if req.keep_truncated else [])


def check_request(req: RegenRequest) -> None:
    """UsageError (exit 2): an unknown --api, a server URL with credentials, a key variable unset."""
    from longspec.errors import UsageError
    from longspec.project import serverkeys

    if req.api not in ("completions", "chat"):
        raise UsageError(f"--api {req.api!r}: choose completions or chat")
    try:
        serverkeys.plan(list(req.servers), list(req.key_envs))
    except serverkeys.KeyProblem as e:
        raise UsageError(str(e), hint=f"export {serverkeys.DEFAULT_ENV}=... (or the variable --api-key-env "
                         "names) in the shell or the sbatch script that runs this") from None


def regenerate(req: RegenRequest, say=None) -> tuple[Path, list[dict], list[LongspecError]]:
    """(project root, each stage's summary, the errors of stages left unfinished): every chosen stage
    regenerated in turn (`say(stage)` before each, progress shown when given), --use applied to a
    complete folder; stops after a signal or when no server answers. RefusedError for --use on a
    folder it cannot use."""
    from longspec.errors import RefusedError
    from longspec.project.manifest import load_manifest
    from longspec.runs.regenstate import folder_state, stage_folder

    check_request(req)
    manifest = load_manifest(req.project_dir)
    chosen = [manifest.stage(s) for s in req.stages] if req.stages else list(manifest.stages)
    flags = regen_flags(req)
    results, errors = [], []
    for spec in chosen:
        out = stage_folder(manifest.root, spec.name)
        if say is not None:
            say(spec.name)
        rerun = rerun_command(manifest.root, spec.name, flags + (["--use"] if req.use else []))
        r = run_stage(spec, out, flags, show_progress=say is not None, rerun=rerun)
        state = folder_state(out)
        rows = r.get("kept", 0) + (r.get("truncated", 0) if req.keep_truncated else 0)
        if req.use and rows and not r.get("stopped_by") and state is not None and (req.force or not state.unfinished):
            r["used"] = use_folder(spec.config, out)
        results.append(r)
        if r.get("stopped_by") in ("SIGINT", "SIGTERM"):
            break
        if (err := unfinished_error(r, state)) is not None:
            err.message += "; train_file left as it is" if req.use and not r.get("used") else ""
            errors.append(err)
            if r.get("stopped_by"):
                break
            continue
        if req.use and not r.get("used"):
            why = ("left no state" if state is None else
                   f"is not complete ({state.refusal()})" if state.unfinished else "kept no row")
            raise RefusedError(f"{spec.name}: the regeneration {why}; train_file left as it is ({out})",
                               hint="see the counts above; --keep-truncated keeps answers cut at the limit; "
                                    "--force uses a folder with failed or missing rows")
    return manifest.root, results, errors


def stopped_code(results: list[dict]) -> int | None:
    """The exit code of a run a signal stopped (130 for Ctrl-C, 5 for SIGTERM), else None."""
    stopped = next((r["stopped_by"] for r in results if r.get("stopped_by") in ("SIGINT", "SIGTERM")), None)
    return None if stopped is None else INTERRUPTED if stopped == "SIGINT" else PREEMPTED


def rerun_command(root: Path, stage: str, flags: list[str]) -> str:
    """The `longspec regenerate` command that goes on where a run stopped (never --force: that
    would start a folder made otherwise over)."""
    return shlex.join(["longspec", "regenerate", str(root), stage, *(f for f in flags if f != "--force")])


def unfinished_error(r: dict, state) -> LongspecError | None:
    """The error a stage's regeneration ends with when it is not all there (its servers went away,
    rows failed): the counts and the command that finishes it; None when it is."""
    if r.get("stopped_by") == "servers":
        rows = f"; {state.short()} ({state.folder})" if state is not None else ""
        return LongspecError(f"{r['stage']}: {r['message']}{rows}",
                             hint=f"rerun: {r['rerun']}", exit_code=SERVERS_GONE)
    if state is not None and state.failed:
        first = next((p for p in r.get("problems", []) if ": failed: " in p), "")
        return LongspecError(f"{r['stage']}: {state.short()} ({state.folder})" + (f"; first: {first}" if first else ""),
                             hint=f"the same command asks the failed rows again: {r['rerun']}", exit_code=ROWS_FAILED)
    return None


def use_folder(config: Path, out: Path) -> str:
    """Set the stage file's train_file to `out`, changing that one line; what changed, in words."""
    from longspec.files.atomic import atomic_write_text
    from longspec.files.yamledit import set_root_scalar

    config = Path(config)
    text = config.read_text(encoding="utf-8")
    edit = set_root_scalar(text, "train_file", str(out), config)
    if not edit.changed:
        return f"{config.name}: train_file already {out}"
    atomic_write_text(config, edit.new_text)
    return f"{config.name}:{edit.line}: train_file {edit.old_value} -> {out}"


@dataclass
class DemoRegen:
    stage: str
    flags: list[str]        # python -m longspec.regenerate's flags
    records: int | None     # the --limit (None: every record)


def demo_plan(manifest, overrides: list[str]) -> list[DemoRegen]:
    """Per stage: regenerate the records its training draws (max_steps x global batch, with the
    demo's --max-steps override) plus the held-out ones eval decodes; a stage whose train_file is
    already a regeneration folder is left out (a rerun of the demo goes on from where it stopped)."""
    from longspec.project.hydracompose import compose_stage, stage_overrides
    from longspec.runs.regenstate import read_manifest

    plan = []
    for spec in manifest.stages:
        c = compose_stage(spec.config, stage_overrides(spec.output_dir, list(overrides)))
        data = c.data if c.ok else {}
        train = data.get("train_file")
        if isinstance(train, str) and read_manifest(Path(manifest.root) / train) is not None:
            continue                                   # (an absolute train_file stays itself under /)
        steps, batch = data.get("max_steps"), data.get("global_batch_size")
        limit = steps * batch + DEMO_HELD_OUT if isinstance(steps, int) and isinstance(batch, int) and steps > 0 \
            and batch > 0 else None
        flags = ["--prefix-tokens", str(DEMO_PREFIX_TOKENS)] + (["--limit", str(limit)] if limit else [])
        plan.append(DemoRegen(spec.name, flags, limit))
    return plan


def regenerate_for_demo(manifest, overrides: list[str], say) -> None:
    """Each stage's data regenerated by its target, then used (`longspec regenerate DIR STAGE --use`)."""
    from longspec.runs.regenstate import folder_state, stage_folder
    from longspec.errors import RefusedError

    for item in demo_plan(manifest, overrides):
        spec = manifest.stage(item.stage)
        out = stage_folder(manifest.root, spec.name)
        say(f"regenerating {spec.name}'s data with its target "
            f"({item.records if item.records else 'every'} records) -> {out}")
        r = run_stage(spec, out, item.flags, show_progress=True, rerun="the same `longspec demo` command")
        if r.get("stopped_by"):
            raise RefusedError(f"{spec.name}: regeneration stopped by {r['stopped_by']}; run the demo again to go on")
        state = folder_state(out)
        if state is None or state.unfinished:
            raise RefusedError(f"{spec.name}: the regeneration is not complete: "
                               f"{state.refusal() if state else 'no manifest'} ({out})",
                               hint="run the demo again: it asks the failed rows again and goes on")
        if not r.get("kept"):
            raise RefusedError(f"{spec.name}: the regeneration kept no row ({out})")
        say(f"  kept {r['kept']}, truncated {r['truncated']}, failed {r['failed']}, skipped {r['skipped']}, "
            f"untrainable {r.get('untrainable', 0)}; "
            + use_folder(spec.config, out))
