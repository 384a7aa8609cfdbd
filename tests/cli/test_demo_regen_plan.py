"""`longspec demo --regenerate`'s plan: each stage regenerates the records its training draws
(max_steps x global batch, the demo's --max-steps override included) plus the held-out ones, with
a document context that fits the base stage; a stage already on a regeneration folder is left out.
(The whole demo with --regenerate runs in tests/cli/test_demo.py and bench/bench_regen_tau.py.)"""

from __future__ import annotations

import json

from longspec.runs import regenstate
from longspec.project.manifest import load_manifest
from longspec_cli.launch.regen import DEMO_HELD_OUT, DEMO_PREFIX_TOKENS, demo_plan


def test_demo_plan_limits_each_stage_to_what_it_trains_on(project):
    for stage, batch in (("base", 8), ("long", 2), ("longcot", 2)):
        cfg = project.config(stage)
        cfg.write_text(cfg.read_text() + f"max_steps: 200\nglobal_batch_size: {batch}\n")
    m = load_manifest(project.root)
    plan = {p.stage: p for p in demo_plan(m, [])}
    assert plan["base"].records == 200 * 8 + DEMO_HELD_OUT and plan["long"].records == 200 * 2 + DEMO_HELD_OUT
    assert plan["base"].flags == ["--prefix-tokens", str(DEMO_PREFIX_TOKENS), "--limit", str(1640)]
    plan = {p.stage: p for p in demo_plan(m, ["max_steps=3", "save_steps=3"])}
    assert [plan[s].records for s in ("base", "long", "longcot")] == [3 * 8 + 40, 3 * 2 + 40, 3 * 2 + 40]

    folder = regenstate.stage_folder(project.root, "long")          # long already trains on regenerated rows
    folder.mkdir(parents=True)
    (folder / regenstate.MANIFEST).write_text(json.dumps({"format": regenstate.FORMAT}))
    cfg = project.config("long")
    cfg.write_text(cfg.read_text().replace(f"train_file: {project.root}/data/long.jsonl", f"train_file: {folder}"))
    assert [p.stage for p in demo_plan(load_manifest(project.root), [])] == ["base", "longcot"]
