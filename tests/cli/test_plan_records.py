"""`run`'s planner judges each stage by its own record: the command line's overrides apply to the
stages the command runs, a finished stage whose math keys are unchanged is done, an interrupted one
resumes unless its math keys changed (refused, keys named, checkpoints kept), and `status`
compares the composed math keys every time (an edit of an included file counts).

Run folders are written by hand to the run-folder contract (tests/cli/conftest.py); the planner
and `status` compose each stage with Hydra as the trainer would.
"""

from __future__ import annotations

import json
import socket

import pytest

from longspec.project.hydracompose import compose_stage, stage_overrides
from longspec.project.manifest import load_manifest
from longspec.project.mathkeys import math_config
from longspec.runs.runfolder import config_fingerprint
from longspec.errors import RefusedError
from longspec_cli.launch import plan
from tests.cli.conftest import finish_stage, write_checkpoint, write_metrics


def _plan(project, stage=None, *overrides, all_=False, world=None):
    req = plan.RunRequest(project=project.root, stage=stage, all=all_, overrides=list(overrides))
    return [(p.spec.name, p.action, p.reason) for p in plan.plan_stages(load_manifest(project.root), req, world)]


def _chain(project, stage):
    up = {"long": "base", "longcot": "long"}[stage]
    project.set_draft_key(stage, str(project.weights(up)))


def _interrupt(project, stage, step, overrides, layout=None):
    """An interrupted run of `stage` with `overrides`: a complete checkpoint that names its math keys
    (and the ranks it was saved on, `layout`)."""
    out = project.out(stage)
    write_metrics(out, step, 60, end=False)
    ck = write_checkpoint(out, step)
    c = compose_stage(project.config(stage), stage_overrides(out, overrides))
    assert c.ok, c.problems
    (ck / "checkpoint.json").write_text(json.dumps({
        "step": step, "config_sha256": config_fingerprint(project.config(stage), overrides),
        "math": math_config(c.data), **({"layout": layout} if layout else {})}))
    (out / "run.json").write_text(json.dumps({"kind": "local", "pid": 999_999_999, "pgid": 999_999_999,
                                              "host": socket.gethostname(), "proc_start": 1, "overrides": overrides,
                                              "returncode": 5}))


def test_a_finished_stage_is_judged_by_its_own_overrides_not_the_next_commands(project, drafts):
    # run DIR base max_steps=4 save_steps=2; next-stage; run DIR long max_steps=60 save_steps=1000
    finish_stage(project, "base", drafts["0"], overrides=["max_steps=4", "save_steps=2"], math=True)
    _chain(project, "long")
    finish_stage(project, "long", drafts["1"], overrides=["max_steps=60", "save_steps=1000"], math=True)
    # The very same long command again plans nothing: both stages are done, base is not in the plan.
    assert _plan(project, "long", "max_steps=60", "save_steps=1000") == [("long", "skip", "done, config unchanged")]
    # Another save_steps changes nothing that is trained: still done.
    assert _plan(project, "long", "max_steps=60", "save_steps=7")[0][1] == "skip"
    # A math key on the command line retrains the stage it names, with the key and values in the reason.
    [(name, action, why)] = _plan(project, "long", "max_steps=61")
    assert (name, action) == ("long", "rerun") and "max_steps 60 -> 61" in why
    # Without a stage, the next stage that its own record does not call done: longcot.
    _chain(project, "longcot")
    assert [p[:2] for p in _plan(project, None, "max_steps=5")] == [("longcot", "start")]


def test_an_interrupted_stage_resumes_with_other_overrides_and_is_refused_when_math_changed(project, drafts):
    finish_stage(project, "base", drafts["0"], overrides=["max_steps=4"], math=True)
    _chain(project, "long")
    _interrupt(project, "long", 10, ["max_steps=60"])
    from longspec.runs.status import project_status

    st = {s.name: s for s in project_status(load_manifest(project.root))}
    assert (st["long"].state, st["long"].next_action) == ("failed", "resume from step 10")
    # k=v of a non-math key: the plan resumes, as status says (it used to move runs/long aside).
    assert _plan(project, "long", "max_steps=60", "save_steps=1000") == [("long", "resume", "from step 10")]
    # A math key changed: refused before anything starts, the keys named, the checkpoints kept.
    with pytest.raises(RefusedError) as e:
        _plan(project, "long", "max_steps=60", "learning_rate=1e-5")
    assert "cannot resume checkpoint-10" in e.value.message and "learning_rate" in e.value.message
    assert (project.out("long") / "checkpoint-10" / "checkpoint.json").is_file()
    # The schedule's length: refused unless resume_schedule=stretch, which the hint names.
    with pytest.raises(RefusedError) as e:
        _plan(project, "long", "max_steps=80")
    assert "max_steps" in e.value.message and "resume_schedule=stretch" in e.value.hint
    assert _plan(project, "long", "max_steps=80", "resume_schedule=stretch")[0][1] == "resume"


def test_a_checkpoint_resumes_on_its_ranks_at_another_sp_only_with_the_same_sequences_per_step():
    from longspec.project.mathkeys import batch_keys_free, layout, layout_blocker, resume_blockers

    two_sp1 = layout(2, 1)
    assert two_sp1 == {"world_size": 2, "sequence_parallel_size": 1, "data_parallel": 2}
    math = {"per_gpu_train_batch_size": 1, "gradient_accumulation_steps": 2, "learning_rate": 1e-3}
    assert layout_blocker(two_sp1, 2, 1, math, math) is None
    assert layout_blocker(None, 8, 4, math, math) is None and layout_blocker(two_sp1, None, 2, math, math) is None
    # SP 1 -> 2 on the same 2 ranks: 1 data-parallel rank, so 2 sequences per step instead of 4
    why, hint = layout_blocker(two_sp1, 2, 2, math, math)
    assert ("sequence_parallel_size 1 -> 2 on the same 2 rank(s) makes 2 -> 1 data-parallel rank(s), so each "
            "step would train on 2 sequences instead of 4") in why
    assert hint.startswith("gradient_accumulation_steps=4 keeps 4 sequences per step") and "sequence_parallel_size=1" in hint
    # ... which gradient_accumulation_steps=4 keeps: DeepSpeed reloads, and the batch keys may differ
    ga4 = {**math, "gradient_accumulation_steps": 4}
    assert layout_blocker(two_sp1, 2, 2, math, ga4) is None and batch_keys_free(two_sp1, 2, 2)
    assert resume_blockers(math, ga4, None, batch_free=True) == ([], [])
    ds = {"ds_cfg.gradient_accumulation_steps": 2, "ds_cfg.train_micro_batch_size_per_gpu": 1}  # DeepSpeed's copies
    assert resume_blockers({**math, **ds}, {**ga4, **ds, "ds_cfg.gradient_accumulation_steps": 4}, None,
                           batch_free=True) == ([], [])
    assert resume_blockers(math, ga4, None) == (["gradient_accumulation_steps"], [])     # same SP: math
    assert resume_blockers(math, {**ga4, "learning_rate": 2e-3}, None, batch_free=True)[0] == ["learning_rate"]
    assert not batch_keys_free(two_sp1, 2, 1) and not batch_keys_free(two_sp1, 4, 2)
    # another world size: DeepSpeed cannot repartition ZeRO's state, whatever the SP
    why, hint = layout_blocker(layout(8, 4), 16, 4, math, math)
    assert "saved on 8 rank(s) and this run has 16" in why and "cannot repartition" in why
    assert "resume on 8 rank(s)" in hint and "force=true" in hint


def test_the_planner_refuses_a_resume_on_other_ranks_or_another_sp_before_launch(project, drafts):
    finish_stage(project, "base", drafts["0"], overrides=["max_steps=4"], math=True)
    _chain(project, "long")
    _interrupt(project, "long", 10, ["max_steps=60", "gradient_accumulation_steps=2"],
               layout={"world_size": 2, "sequence_parallel_size": 1, "data_parallel": 2})
    ok = [("long", "resume", "from step 10")]
    assert _plan(project, "long", "max_steps=60", "gradient_accumulation_steps=2", world=2) == ok
    assert _plan(project, "long", "max_steps=60", "gradient_accumulation_steps=2") == ok   # ranks unknown
    with pytest.raises(RefusedError) as e:
        _plan(project, "long", "max_steps=60", "gradient_accumulation_steps=2", "sequence_parallel_size=2", world=2)
    assert "cannot resume checkpoint-10: sequence_parallel_size 1 -> 2" in e.value.message
    assert "gradient_accumulation_steps=4 keeps" in e.value.hint
    # the same sequences per step at SP 2: it resumes
    assert _plan(project, "long", "max_steps=60", "gradient_accumulation_steps=4", "sequence_parallel_size=2",
                 world=2) == ok
    with pytest.raises(RefusedError) as e:
        _plan(project, "long", "max_steps=60", "gradient_accumulation_steps=2", world=4)
    assert "saved on 2 rank(s) and this run has 4" in e.value.message
    assert (project.out("long") / "checkpoint-10" / "checkpoint.json").is_file()


def test_a_stage_whose_upstream_is_not_done_and_not_in_scope_is_refused_with_the_reason(project, drafts):
    finish_stage(project, "base", drafts["0"], math=True)
    _chain(project, "long")
    cfg = project.config("base")
    cfg.write_text(cfg.read_text().replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-4"))
    with pytest.raises(RefusedError) as e:
        _plan(project, "long")
    assert "base is stale" in e.value.message and "learning_rate" in e.value.message
    # With base in scope, it reruns first and long follows.
    assert [p[:2] for p in _plan(project, "base", all_=True)] == [("base", "rerun"), ("long", "start"),
                                                                  ("longcot", "start")]


def test_status_compares_the_composed_math_keys_so_an_included_file_counts(project, drafts):
    from longspec.runs.status import project_status

    finish_stage(project, "base", drafts["0"], math=True)
    ds = project.root / "conf" / "deepspeed" / "zero1_offload_cosine.yaml"
    ds.write_text(ds.read_text() + "# a comment only\n")
    base = project_status(load_manifest(project.root))[0]
    assert base.state == "done", base.reasons
    ds.write_text(ds.read_text().replace("stage: 1", "stage: 3"))
    base = project_status(load_manifest(project.root))[0]
    assert base.state == "stale" and any("zero_optimization" in r for r in base.reasons), base.reasons
    assert _plan(project, "base")[0][1] == "rerun"
