"""`longspec next-stage`: picking the stage, verifying the upstream draft, refusing without touching
the file, explicit mode, and the subprocess deep check (weights_only=True, keys/shapes vs the target)."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.files.yamlio import load_mapping

from .conftest import (BAD_YAML, HAS_TORCH, TINY_TARGET_CONFIG, finish_chain, finish_stage, no_traceback,
                       panel_text)

runner = CliRunner()
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="the deep check runs only where torch is installed")


def _ns(*args: str):
    return runner.invoke(app, ["next-stage", *args])


def _snapshot(project) -> dict[str, bytes]:
    return {n: project.config(n).read_bytes() for n in ("base", "long", "longcot")}


def _only_line_changed(before: bytes, after: bytes) -> tuple[bytes | None, bytes]:
    """(old line or None when inserted, new line); fails when anything else differs."""
    a, b = before.split(b"\n"), after.split(b"\n")
    if len(a) == len(b):
        diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(diffs) == 1, diffs
        return a[diffs[0]], b[diffs[0]]
    assert len(b) == len(a) + 1
    for i in range(len(b)):
        if b[:i] + b[i + 1:] == a:
            return None, b[i]
    raise AssertionError("more than one line changed")


def test_default_chains_the_first_finished_upstream_and_only_that_line_changes(project, drafts):
    finish_stage(project, "base", drafts["0"])
    before = _snapshot(project)
    res = _ns(str(project.root), "--no-deep")
    assert res.exit_code == 0, res.output
    after = _snapshot(project)
    assert after["base"] == before["base"] and after["longcot"] == before["longcot"]
    old, new = _only_line_changed(before["long"], after["long"])
    assert old == b"draft_model_name_or_path: null"
    assert new == f"draft_model_name_or_path: {project.weights('base')}".encode()
    assert load_mapping(project.config("long")).data["draft_model_name_or_path"] == str(project.weights("base"))
    # run again: long already points at base's draft and long is not finished -> nothing to do
    res = _ns(str(project.root), "--no-deep")
    assert res.exit_code == 0 and "nothing to do" in res.output
    assert _snapshot(project) == after


def test_walks_the_chain_stage_by_stage(project, drafts):
    finish_chain(project, drafts, upto="long")  # long already points at base, and is finished
    res = _ns(str(project.root), "--no-deep", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["stage"] == "longcot" and out["from_stage"] == "long"
    assert out["key"] == "draft_model_name_or_path"
    assert out["old"] is None and out["new"] == str(project.weights("long"))
    assert out["changed"] is True and out["written"] is True
    assert out["draft_sha256"] == project.sha("long")
    assert out["config"] == str(project.config("longcot"))


def test_dry_run_prints_a_diff_and_changes_nothing(project, drafts):
    finish_stage(project, "base", drafts["0"])
    before = _snapshot(project)
    res = _ns(str(project.root), "--dry-run", "--no-deep")
    assert res.exit_code == 0, res.output
    assert "-draft_model_name_or_path: null" in res.output
    assert f"+draft_model_name_or_path: {project.weights('base')}" in res.output
    assert _snapshot(project) == before
    js = json.loads(_ns(str(project.root), "--dry-run", "--no-deep", "--json").output)
    assert js["changed"] is True and js["written"] is False and js["dry_run"] is True
    assert _snapshot(project) == before


def test_to_picks_the_stage_and_rechaining_the_same_path_is_a_no_op(project, drafts):
    finish_chain(project, drafts)
    res = _ns(str(project.root), "--to", "long", "--no-deep", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["changed"] is False and out["old"] == out["new"] == str(project.weights("base"))
    assert _ns(str(project.root), "--to", "base").exit_code == 2  # base has draft_from: null
    res = _ns(str(project.root), "--to", "lnog")
    assert res.exit_code == 2 and "did you mean 'long'" in panel_text(res.output)


@pytest.mark.parametrize("damage", ["no stage_complete", "sha mismatch", "truncated weights", "weights gone"])
def test_refusals_leave_every_config_byte_identical(project, drafts, damage):
    finish_stage(project, "base", drafts["0"])
    w = project.weights("base")
    if damage == "no stage_complete":
        (project.out("base") / "stage_complete.json").unlink()
    elif damage == "sha mismatch":
        w.write_bytes(drafts["1"])
    elif damage == "truncated weights":
        w.write_bytes(drafts["0"][: len(drafts["0"]) // 2])
    else:
        w.unlink()
    before = _snapshot(project)
    res = _ns(str(project.root), "--to", "long")
    assert res.exit_code == 1, res.output
    no_traceback(res)
    assert _snapshot(project) == before
    text = panel_text(res.output)
    assert {"no stage_complete": "not complete", "sha mismatch": "does not match stage_complete.json",
            "truncated weights": "does not match stage_complete.json", "weights gone": "is missing"}[damage] in text


def test_default_mode_with_nothing_finished_is_refused(project):
    before = _snapshot(project)
    res = _ns(str(project.root))
    assert res.exit_code == 1 and "no stage has a finished upstream" in panel_text(res.output)
    assert _snapshot(project) == before


def test_malformed_stage_complete_is_unreadable_input(project, drafts):
    finish_stage(project, "base", drafts["0"])
    (project.out("base") / "stage_complete.json").write_text("{half")
    before = _snapshot(project)
    res = _ns(str(project.root), "--to", "long")
    assert res.exit_code == 3 and "not valid JSON" in panel_text(res.output)
    assert _snapshot(project) == before


@pytest.mark.parametrize("name", list(BAD_YAML))
def test_bad_target_yaml_exits_3_untouched(project, drafts, name):
    finish_stage(project, "base", drafts["0"])
    raw, needle = BAD_YAML[name]
    project.config("long").write_bytes(raw)
    res = _ns(str(project.root), "--to", "long", "--no-deep")
    assert res.exit_code == 3, (name, res.output)
    no_traceback(res)
    assert needle in panel_text(res.output)
    assert project.config("long").read_bytes() == raw
    # explicit mode says the same
    res = _ns("--config", str(project.config("long")), "--draft", str(project.weights("base")), "--no-deep")
    assert res.exit_code == 3 and project.config("long").read_bytes() == raw


def test_explicit_mode_edits_the_given_config(tmp_path, drafts):
    cfg = tmp_path / "long.yaml"
    cfg.write_bytes(b"# exp\nmodel_name_or_path: /t\ndraft_model_name_or_path: ~  # fill me\nlr: 1\n")
    draft = tmp_path / "my draft" / "w.pth"
    draft.parent.mkdir()
    draft.write_bytes(drafts["0"])
    res = _ns("--config", str(cfg), "--draft", str(draft), "--no-deep", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["new"] == str(draft) and out["old"] is None and out["changed"]
    assert cfg.read_bytes() == (b"# exp\nmodel_name_or_path: /t\ndraft_model_name_or_path: \"%s\"  # fill me\nlr: 1\n"
                                % str(draft).encode())


def test_explicit_mode_usage_errors(project, tmp_path, drafts):
    finish_stage(project, "base", drafts["0"])
    cfg = project.config("long")
    before = cfg.read_bytes()
    cases = [
        ["--config", str(cfg), "--draft", str(tmp_path / "nope.pth")],
        ["--config", str(tmp_path / "nope.yaml"), "--draft", str(project.weights("base"))],
        ["--config", str(cfg)],
        [str(project.root), "--config", str(cfg), "--draft", str(project.weights("base"))],
        [],
        [str(tmp_path / "no-project")],
    ]
    for args in cases:
        res = _ns(*args)
        assert res.exit_code == 2, (args, res.output)
        no_traceback(res)
    assert cfg.read_bytes() == before


def test_a_flow_or_anchored_value_is_refused(tmp_path, drafts):
    draft = tmp_path / "w.pth"
    draft.write_bytes(drafts["0"])
    for text, needle in [
        (b"draft_model_name_or_path: [a, b]\n", "flow list"),
        (b"draft_model_name_or_path:\n  a: 1\n", "block mapping"),
        (b"x: &d /old\ndraft_model_name_or_path: *d\n", "anchor"),
        (b"draft_model_name_or_path: &d /old\ny: *d\n", "anchor"),
        (b"draft_model_name_or_path: |\n  /old\n", "block scalar"),
        (b"draft_model_name_or_path: /a\n  /b\n", "several lines"),
        (b"draft_model_name_or_path: \"/a\n  b\"\n", "several lines"),
        (b"{draft_model_name_or_path: /a, b: 1}\n", "flow mapping"),
    ]:
        cfg = tmp_path / "c.yaml"
        cfg.write_bytes(text)
        res = _ns("--config", str(cfg), "--draft", str(draft), "--no-deep")
        assert res.exit_code == 1, (text, res.output)
        assert needle in panel_text(res.output), res.output
        assert cfg.read_bytes() == text


def test_help_has_examples():
    res = runner.invoke(app, ["next-stage", "--help"])
    assert res.exit_code == 0 and "Examples" in res.output and "--dry-run" in res.output


# ----------------------------------------------------------------------------- deep check (torch)


@needs_torch
def test_deep_check_loads_the_draft_in_a_subprocess(project, drafts):
    finish_stage(project, "base", drafts["0"])
    res = _ns(str(project.root), "--json")
    assert res.exit_code == 0, res.output
    deep = json.loads(res.output)["deep_check"]
    assert deep["loadable"] is True and deep["tensors"] == 2 and deep["parameters"] == 20
    assert deep["target_checked"] is False and "no config.json" in deep["note"]


@needs_torch
def test_deep_check_refuses_a_pickle_that_is_not_just_tensors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"draft_model_name_or_path: null\n")
    evil = tmp_path / "evil.pth"
    evil.write_bytes(pickle.dumps(_Evil()))
    res = _ns("--config", str(cfg), "--draft", str(evil))
    assert res.exit_code == 3, res.output
    assert "weights_only=True" in panel_text(res.output)
    assert not (tmp_path / "pwned").exists()
    assert cfg.read_bytes() == b"draft_model_name_or_path: null\n"


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


@needs_torch
def test_deep_check_against_the_target_shapes(project, drafts):
    assert "glide" in drafts                     # with torch, the drafts fixture always builds one
    (project.target / "config.json").write_text(json.dumps(TINY_TARGET_CONFIG))
    # a draft of the right architecture fits ...
    finish_stage(project, "base", drafts["glide"])
    res = _ns(str(project.root), "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["deep_check"]["target_checked"] is True
    # ... a state dict of something else is refused, and the config is untouched
    finish_stage(project, "base", drafts["1"])
    before = _snapshot(project)
    res = _ns(str(project.root), "--to", "long")
    assert res.exit_code == 1, res.output
    assert "does not fit the target" in panel_text(res.output)
    assert _snapshot(project) == before


# ---------------------------------------------------------------- deciding by composing (Hydra)

def _include_after_self(project, value: str) -> "Path":
    """long.yaml lists conf/common/draft.yaml after _self_: that file decides the draft key."""
    inc = project.root / "conf" / "common" / "draft.yaml"
    inc.parent.mkdir(parents=True, exist_ok=True)
    inc.write_text(f"# @package _global_\n# the draft of stage long\ndraft_model_name_or_path: {value}\n")
    cfg = project.config("long")
    cfg.write_text(cfg.read_text().replace("  - _self_\n", "  - _self_\n  - /common: draft\n"))
    return inc


def test_an_edit_hydra_would_not_see_is_rolled_back_and_in_edits_the_file_that_wins(project, drafts):
    finish_stage(project, "base", drafts["0"])
    inc = _include_after_self(project, "null")
    before, inc_before = _snapshot(project), inc.read_bytes()
    res = _ns(str(project.root), "--no-deep")
    assert res.exit_code == 1 and "Traceback" not in res.output
    text = panel_text(res.output).replace(" ", "")
    assert f"{inc}:3" in text and "--in" in text and "nothingchanged" in text
    assert _snapshot(project) == before and inc.read_bytes() == inc_before  # rolled back
    # status reads the composed value: long is not chained yet
    st = json.loads(runner.invoke(app, ["status", str(project.root), "--json"]).stdout)
    long = {s["name"]: s for s in st["stages"]}["long"]
    assert long["draft_model_name_or_path"] is None
    res = _ns(str(project.root), "--no-deep", "--in", str(inc))
    assert res.exit_code == 0, res.output
    assert _snapshot(project) == before  # the stage file is untouched; the include changed
    assert load_mapping(inc).data["draft_model_name_or_path"] == str(project.weights("base"))
    shown = json.loads(runner.invoke(app, ["config", str(project.root), "long", "--json"]).stdout)
    assert shown["config"]["draft_model_name_or_path"] == str(project.weights("base"))
    assert shown["origins"]["draft_model_name_or_path"] == f"{inc}:3"
    assert "nothing to do" in _ns(str(project.root), "--no-deep").output  # picking reads the composed value


def test_in_must_be_a_file_of_the_stage(project, drafts, tmp_path):
    finish_stage(project, "base", drafts["0"])
    other = tmp_path / "other.yaml"
    other.write_text("a: 1\n")
    res = _ns(str(project.root), "--no-deep", "--in", str(other))
    assert res.exit_code == 2 and "not a file of long.yaml's defaults list" in panel_text(res.output)


def test_an_interpolated_draft_key_is_replaced_only_with_force(project, drafts):
    finish_stage(project, "base", drafts["0"])
    project.set_draft_key("long", "${output_dir}/../elsewhere/draft_model_weights.pth")
    before = _snapshot(project)
    res = _ns(str(project.root), "--no-deep")
    assert res.exit_code == 1 and "--force" in panel_text(res.output)
    assert _snapshot(project) == before
    res = _ns(str(project.root), "--no-deep", "--force")
    assert res.exit_code == 0, res.output
    assert "replaced the interpolation ${output_dir}/../elsewhere/draft_model_weights.pth (--force)" in res.output
    assert load_mapping(project.config("long")).data["draft_model_name_or_path"] == str(project.weights("base"))


def test_a_symlinked_config_is_edited_through_the_link(project, drafts, tmp_path):
    finish_stage(project, "base", drafts["0"])
    real = tmp_path / "shared-configs" / "long.yaml"
    real.parent.mkdir()
    project.config("long").rename(real)
    project.config("long").symlink_to(real)
    res = _ns(str(project.root), "--no-deep")
    assert res.exit_code == 0, res.output
    assert project.config("long").is_symlink()  # the link stays
    assert load_mapping(real).data["draft_model_name_or_path"] == str(project.weights("base"))


def test_an_edit_that_does_not_compose_to_the_new_draft_is_rolled_back(project, drafts):
    """--in a file whose `# @package` puts its keys elsewhere: the text edit works, but Hydra
    composes the draft key unchanged, so the file is restored and nothing changes."""
    finish_stage(project, "base", drafts["0"])
    inc = project.root / "conf" / "common" / "misc.yaml"
    inc.parent.mkdir(parents=True)
    inc.write_text("# @package extras\ndraft_model_name_or_path: null\n")
    cfg = project.config("long")
    cfg.write_text(cfg.read_text().replace("  - _self_\n", "  - _self_\n  - /common: misc\n"))
    before, inc_before = _snapshot(project), inc.read_bytes()
    res = _ns(str(project.root), "--no-deep", "--in", str(inc))
    assert res.exit_code == 1 and "nothingchanged" in panel_text(res.output).replace(" ", "")
    assert _snapshot(project) == before and inc.read_bytes() == inc_before


def _best(project, stage: str, weights: bytes, step: int = 20, tau: float = 2.5) -> Path:
    """best/ and best.json as the trainer writes them."""
    out = project.out(stage)
    (out / "best").mkdir(parents=True, exist_ok=True)
    (out / "best" / "draft_model_weights.pth").write_bytes(weights)
    (out / "best.json").write_text(json.dumps({
        "stage": stage, "step": step, "tau": tau, "alpha": [0.6, 0.5, 0.4, 0.3], "gamma": 4,
        "weights": "best/draft_model_weights.pth", "sha256": hashlib.sha256(weights).hexdigest()}))
    return out / "best" / "draft_model_weights.pth"


def test_best_chains_the_best_draft_records_the_choice_and_status_follows_it(project, drafts):
    from longspec.project.manifest import load_manifest
    from longspec.runs.status import project_status

    finish_stage(project, "base", drafts["0"])
    best = _best(project, "base", drafts["1"])
    res = _ns(str(project.root), "--best", "--no-deep", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["new"] == str(best) and out["draft_pick"] == "best" and out["manifest_changed"] is True
    assert load_mapping(project.config("long")).data["draft_model_name_or_path"] == str(best)
    manifest = load_manifest(project.root)
    assert manifest.stage("long").draft_pick == "best" and manifest.stage("longcot").draft_pick == "final"
    assert "draft_pick: best}" in (project.root / "longspec.yaml").read_text()   # the flow entry, one line
    # long trained from base's best draft: done, not stale; base shows its best draft
    finish_stage(project, "long", drafts["2"], draft_sha256=hashlib.sha256(drafts["1"]).hexdigest())
    st = {s.name: s for s in project_status(load_manifest(project.root))}
    assert st["base"].best_step == 20 and st["base"].best_weights == str(best)
    assert st["long"].state == "done", st["long"].reasons
    # plain next-stage goes back to the final draft: the manifest says so, and long is now stale
    res = _ns(str(project.root), "--to", "long", "--no-deep")
    assert res.exit_code == 0, res.output
    assert load_manifest(project.root).stage("long").draft_pick == "final"
    assert load_mapping(project.config("long")).data["draft_model_name_or_path"] == str(project.weights("base"))
    st = {s.name: s for s in project_status(load_manifest(project.root))}
    assert st["long"].state == "stale"


def test_best_without_a_best_draft_is_refused_and_changes_nothing(project, drafts):
    finish_stage(project, "base", drafts["0"])
    before = _snapshot(project), (project.root / "longspec.yaml").read_bytes()
    res = _ns(str(project.root), "--to", "long", "--best", "--no-deep")
    assert res.exit_code == 1 and "no best draft" in panel_text(res.output), res.output
    no_traceback(res)
    assert (_snapshot(project), (project.root / "longspec.yaml").read_bytes()) == before
    # a best draft whose file no longer matches best.json is not one either
    _best(project, "base", drafts["1"])
    (project.out("base") / "best" / "draft_model_weights.pth").write_bytes(drafts["2"])
    res = _ns(str(project.root), "--to", "long", "--best", "--no-deep")
    assert res.exit_code == 1 and "no best draft" in panel_text(res.output)
    assert _ns("--config", str(project.config("long")), "--draft", str(project.weights("base")),
               "--best").exit_code == 2
