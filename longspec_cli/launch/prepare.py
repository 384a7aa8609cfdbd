"""Prepared data from the CLI: a stage's cache state (pure) and `python -m longspec.prepare` runs.

`longspec prepare` and `run`'s preflight use these; the tokenizing happens in the child process
(this process never imports torch or transformers), which echoes its progress on stderr.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from longspec.formats import prepared as P
from longspec.project.manifest import Manifest, StageSpec


def stage_conf(spec: StageSpec, overrides: list[str] = ()) -> dict[str, Any] | None:
    """The stage's composed config with the command-line overrides applied; None if unreadable."""
    from longspec.project.hydracompose import stage_overrides
    from longspec_cli.launch import plan

    c = plan.composed(spec.config, tuple(stage_overrides(spec.output_dir, list(overrides))))
    return copy.deepcopy(c.data) if c.ok else None


def world_of(manifest: Manifest) -> int:
    return max(1, manifest.launch.gpus) * max(1, manifest.launch.nodes)


def stage_state(manifest: Manifest, spec: StageSpec, overrides: list[str] = (), world: int | None = None,
                full: bool = False) -> P.PreparedState:
    conf = stage_conf(spec, list(overrides))
    if conf is None:
        return P.PreparedState("unknown", "config unreadable")
    return P.stage_prepared(conf, manifest.root, world or world_of(manifest), full=full)


def run_prepare(spec: StageSpec, overrides: list[str], world: int, workers: int | None = None,
                show_progress: bool = True) -> dict:
    """Tokenize (or find) the stage's cache in a child process; its JSON result."""
    from longspec_cli.launch.trainer import prepare_argv, run_trainer_json

    return run_trainer_json(prepare_argv(spec, list(overrides), world, workers), show_progress=show_progress)


def ready_result(manifest: Manifest, spec: StageSpec, overrides: list[str], world: int) -> dict | None:
    """The stage's result when its cache is ready (checksums included), without any subprocess."""
    import time

    t0 = time.monotonic()
    conf = stage_conf(spec, list(overrides))
    if conf is None:
        return None
    st = P.stage_prepared(conf, manifest.root, world, full=True)
    man = P.read_manifest(Path(st.path)) if st.state == "ready" and st.path else None
    if man is None:
        return None
    return P.result_of(man, conf, world, Path(st.path), False, time.monotonic() - t0)


def ensure_prepared(manifest: Manifest, spec: StageSpec, overrides: list[str], world: int, say) -> None:
    """`run`'s preflight: prepare the stage's data before DeepSpeed starts (no-op when ready)."""
    st = stage_state(manifest, spec, overrides, world)
    if st.state == "ready":
        say(f"{spec.name}: data prepared ({st.line()}, {st.path})")
        return
    if st.state == "unknown":
        return                                # validation reports it; the trainer refuses it
    say(f"{spec.name}: preparing data ({st.reason})")
    r = run_prepare(spec, overrides, world)
    say(f"{spec.name}: data prepared: {r['records']:,} records, {r['tokens']:,} tokens in {r['seconds']:.1f} s")


def run_show(spec: StageSpec, overrides: list[str], count: int) -> dict:
    """The stage's first `count` records as the trainer encodes them (`python -m longspec.show`)."""
    from longspec_cli.launch.trainer import run_trainer_json, show_argv

    return run_trainer_json(show_argv(spec, overrides, count), show_progress=False)
