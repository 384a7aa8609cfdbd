"""The front end and the trainer compose every stage the same way.

A corpus of stage-file shapes people write (header placement, absolute/relative defaults, package
overrides, `override`, optional and null defaults, `_self_` first/last/missing, includes that set
the draft key, interpolations of every OmegaConf kind, YAML 1.1 scalars, `???` merges, overrides on
the command line). For each one:

  the trainer   longspec.train's own @hydra.main entry (in this process, with the same argv as
                `python -m longspec.train --config-dir DIR/conf +exp=s output_dir=... [overrides]`),
                its config check (read_config) and its DeepSpeed block (build_ds_config)
  the CLI       `longspec config DIR s [overrides] --json` and `longspec validate` with the overrides

`config` must equal the trainer's resolved config, and validate must pass exactly when the trainer
can start. Nothing is mocked: both sides run Hydra on the same files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project.validate import validate_paths
from longspec.training import entry   # Hydra's main of the trainer (no torch at import)

runner = CliRunner()

DS = """\
train_micro_batch_size_per_gpu: ${per_gpu_train_batch_size}
gradient_accumulation_steps: ${gradient_accumulation_steps}
gradient_clipping: ${max_grad_norm}
optimizer:
  type: AdamW
  params:
    lr: ${learning_rate}
    betas: ${adam_betas}
    eps: ${adam_epsilon}
    weight_decay: ${weight_decay}
scheduler:
  type: WarmupCosineLR
  params:
    warmup_type: linear
zero_optimization:
  stage: 1
"""

HEAD = "# @package _global_\n"
DEFAULTS = "defaults:\n  - /deepspeed@ds_cfg: zero1\n  - _self_\n"
BODY = """
stage: s
model_name_or_path: {root}/target
draft_model_name_or_path: null
train_file: {root}/data/s.jsonl
precision: bf16
data:
  collator: short_text
  max_seq_length: 512
learning_rate: 5.0e-4
per_gpu_train_batch_size: 2
"""
CLEAN = HEAD + DEFAULTS + BODY
INCLUDE_DRAFT = "# @package _global_\ndraft_model_name_or_path: {root}/drafts/other.pth\n"
INCLUDE_DATA = "# @package _global_\ntrain_file: {root}/data/s.jsonl\n"


def d(*entries: str) -> str:
    return "defaults:\n" + "".join(f"  - {e}\n" for e in entries)


def swap(old: str, new: str, text: str = CLEAN) -> str:
    assert old in text, old
    return text.replace(old, new)


# (id, stage file, extra files {relative path: text}, overrides, expected trainer start or None = either)
SHAPES = [
    ("clean", CLEAN, {}, [], True),
    ("header-second", "# a title\n" + CLEAN, {}, [], False),
    ("header-missing", DEFAULTS + BODY, {}, [], False),
    ("header-after-blank-line", "\n" + CLEAN, {}, [], True),
    ("header-extra-spaces", "#   @package   _global_\n" + DEFAULTS + BODY, {}, [], True),
    ("default-relative", HEAD + d("deepspeed@ds_cfg: zero1", "_self_") + BODY, {}, [], False),
    ("default-missing-name", HEAD + d("/deepspeed@ds_cfg: zero9", "_self_") + BODY, {}, [], False),
    ("override-with-nothing-to-override", HEAD + d("override /deepspeed@ds_cfg: zero1", "_self_") + BODY,
     {}, [], False),
    ("same-group-twice", HEAD + d("/deepspeed@ds_cfg: zero1", "/deepspeed@ds_cfg: zero1", "_self_") + BODY,
     {}, [], False),
    ("override-after-entry", HEAD + d("/deepspeed@ds_cfg: zero1", "override /deepspeed@ds_cfg: zero1", "_self_")
     + BODY, {}, [], None),
    ("optional-missing", HEAD + d("/deepspeed@ds_cfg: zero1", "optional /extra@ds_cfg: nothing", "_self_") + BODY,
     {}, [], True),
    ("null-default", HEAD + d("/deepspeed@ds_cfg: null", "_self_") + BODY, {}, [], None),
    ("self-first", HEAD + d("_self_", "/deepspeed@ds_cfg: zero1") + BODY, {}, [], True),
    ("self-missing", HEAD + d("/deepspeed@ds_cfg: zero1") + BODY, {}, [], True),
    ("package-header-in-included-file", HEAD + d("/deepspeed_pkg: zero1", "_self_") + BODY,
     {"conf/deepspeed_pkg/zero1.yaml": "# @package ds_cfg\n" + DS}, [], True),
    ("include-sets-draft-after-self", HEAD + d("/deepspeed@ds_cfg: zero1", "_self_", "/common: draft") + BODY,
     {"conf/common/draft.yaml": INCLUDE_DRAFT}, [], True),
    ("include-sets-draft-before-self", HEAD + d("/deepspeed@ds_cfg: zero1", "/common: draft", "_self_") + BODY,
     {"conf/common/draft.yaml": INCLUDE_DRAFT}, [], True),
    ("yaml11-yes", CLEAN + "logging:\n  tensorboard: yes\n", {}, [], True),
    ("yaml11-octal", CLEAN + "seed: 010\n", {}, [], True),
    ("yaml11-off", CLEAN + "logging:\n  wandb: off\n", {}, [], True),
    ("oc-select-default", CLEAN + "seed: ${oc.select:no_such_key,7}\n", {}, [], True),
    ("key-left-to-the-trainer-default", swap("learning_rate: 5.0e-4\n", ""), {}, [], True),
    ("missing-over-an-included-value", swap("train_file: {root}/data/s.jsonl", "train_file: ???",
                                            HEAD + d("/deepspeed@ds_cfg: zero1", "/common: data", "_self_") + BODY),
     {"conf/common/data.yaml": INCLUDE_DATA}, [], True),
    ("missing-alone", swap("train_file: {root}/data/s.jsonl", "train_file: ???"), {}, [], False),
    ("interpolation-to-a-missing-key", swap("learning_rate: 5.0e-4", "learning_rate: ${lr_base}"), {}, [], False),
    ("interpolation-cycle", CLEAN + "max_grad_norm: ${ds_cfg.gradient_clipping}\n", {}, [], False),
    ("oc-env-with-default", swap("stage: s", "stage: ${oc.env:LONGSPEC_SURELY_UNSET_VAR,s}"), {}, [], True),
    ("interpolation-absolute-nested", CLEAN + "positions:\n  threshold: ${data.max_seq_length}\n", {}, [], True),
    ("interpolation-relative", CLEAN + "positions:\n  anchors: 4\n  threshold: ${.anchors}\n", {}, [], True),
    ("interpolation-in-a-string", swap("stage: s", "stage: s_${seed}"), {}, [], True),
    ("oc-decode", CLEAN + "adam_betas: ${oc.decode:'[0.9, 0.95]'}\n", {}, [], None),
    ("override-value", CLEAN, {}, ["max_steps=5"], True),
    ("override-typo", CLEAN, {}, ["max_step=5"], False),
    ("override-out-of-range", CLEAN, {}, ["save_steps=0"], False),
    ("override-adds-an-unknown-key", CLEAN, {}, ["+new_key=1"], False),
    ("override-nested", CLEAN, {}, ["data.max_seq_length=256", "positions.anchors=2"], True),
    ("unknown-key-in-the-file", CLEAN + "learnig_rate: 1.0e-3\n", {}, [], False),
    ("upstream-key-in-a-longspec-file", CLEAN + "collator:\n  max_seq_length: 512\n", {}, [], False),
    ("wrong-type", swap("per_gpu_train_batch_size: 2", "per_gpu_train_batch_size: two"), {}, [], False),
    ("deepspeed-precision-block-disagrees", CLEAN + "ds_cfg:\n  bf16:\n    enabled: false\n", {}, [], False),
    ("deepspeed-literal-lr-disagrees", CLEAN + "ds_cfg:\n  optimizer:\n    params:\n      lr: 0.001\n", {}, [], False),
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    (root / "data").mkdir()
    (root / "data" / "s.jsonl").write_text('{"text": "hello"}\n')
    (root / "drafts").mkdir()
    (root / "drafts" / "other.pth").write_bytes(b"not loaded here")
    return root


def project(tmp_path: Path, assets: Path, stage: str, extra: dict[str, str]) -> Path:
    """DIR/conf/exp/s.yaml + DIR/conf/deepspeed/zero1.yaml (+ extra files); no manifest, so that only
    what the trainer reads is judged (a project adds its own rules: the first stage starts fresh, ...)."""
    proj = tmp_path / "proj"
    (proj / "conf" / "exp").mkdir(parents=True)
    (proj / "conf" / "deepspeed").mkdir()
    (proj / "conf" / "deepspeed" / "zero1.yaml").write_text(DS)
    (proj / "conf" / "exp" / "s.yaml").write_text(stage.replace("{root}", str(assets)))
    for rel, text in extra.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text.replace("{root}", str(assets)))
    return proj


def out_dir(proj: Path) -> str:
    return f"output_dir={(proj / 'runs' / 's').resolve()}"


def trainer_side(proj: Path, overrides: list[str], monkeypatch) -> dict:
    """What the trainer does with this argv up to the point where it loads the target."""
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from longspec.training import dsconfig

    got: dict = {"composed": False}

    def task(cfg) -> int:
        got["composed"] = True
        try:
            got["config"] = OmegaConf.to_container(cfg, resolve=True)
        except Exception:
            pass
        try:
            conf = entry.read_config(cfg)
            dsconfig.build_ds_config(conf, world_size=1, total_steps=100, warmup_steps=10, on_cpu=False)
        except dsconfig.ConfigError as e:
            got["refused"] = e.problems
        return 0

    argv = ["train", "--config-dir", str(proj / "conf"), "+exp=s", out_dir(proj), *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(proj)
    GlobalHydra.instance().clear()
    try:
        entry.make_hydra_entry(task)()
    except SystemExit as e:
        got["exit"] = e.code
    finally:
        GlobalHydra.instance().clear()
    got["starts"] = got["composed"] and "refused" not in got and not got.get("exit")
    return got


@pytest.mark.parametrize("name, stage, extra, overrides, expected", SHAPES, ids=[s[0] for s in SHAPES])
def test_config_and_validate_agree_with_the_trainer(tmp_path, assets, monkeypatch, name, stage, extra, overrides,
                                                    expected):
    proj = project(tmp_path, assets, stage, extra)
    trainer = trainer_side(proj, overrides, monkeypatch)
    if expected is not None:
        assert trainer["starts"] == expected, trainer  # the corpus says what it tests
    stage_file = proj / "conf" / "exp" / "s.yaml"
    res = runner.invoke(app, ["config", str(stage_file), out_dir(proj), *overrides, "--json"])
    assert "Traceback" not in res.output and res.exit_code in (0, 1), res.output
    shown = json.loads(res.stdout)
    if "config" in trainer:  # what `--cfg job --resolve` shows
        assert shown["config"] == trainer["config"]
    assert res.exit_code == 0 or shown["problems"]
    if trainer["starts"]:
        assert res.exit_code == 0, shown["problems"]
    rep = validate_paths([stage_file], overrides=[out_dir(proj), *overrides])
    errors = [p for p in rep.problems if p.severity == "error"]
    assert (not errors) == trainer["starts"], (errors, trainer)
    assert all(p.hint for p in errors), errors  # every error says the fix


def test_the_corpus_is_large_and_covers_both_outcomes():
    assert len(SHAPES) >= 30
    assert {s[4] for s in SHAPES} >= {True, False}


def test_cfg_job_resolve_of_the_real_trainer_equals_config_and_warns_nothing(tmp_path, assets):
    """`python -m longspec.train ... --cfg job --resolve` (a real process, no training) prints what
    `longspec config` shows; no Hydra warning on the way, and from the project folder `--config-dir
    conf` is implied."""
    import os
    import subprocess

    import yaml

    stage = HEAD + d("/deepspeed@ds_cfg: zero1", "_self_", "/common: draft") + BODY + "seed: 010\n"
    proj = project(tmp_path, assets, stage, {"conf/common/draft.yaml": INCLUDE_DRAFT})
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for cwd, args in ((outside, ["--config-dir", str(proj / "conf")]), (proj, [])):
        proc = subprocess.run([sys.executable, "-m", "longspec.train", *args, "+exp=s", out_dir(proj), "max_steps=3",
                               "--cfg", "job", "--resolve"], capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "Warning" not in proc.stderr, proc.stderr
        printed = yaml.safe_load(proc.stdout)
        res = runner.invoke(app, ["config", str(proj / "conf" / "exp" / "s.yaml"), out_dir(proj), "max_steps=3",
                                  "--json"])
        assert json.loads(res.stdout)["config"] == printed
        assert printed["seed"] == 8 and printed["draft_model_name_or_path"].endswith("other.pth")


# ---------------------------------------------------------------- the composition cache

@pytest.fixture
def compose_count(tmp_path, monkeypatch):
    """An empty cache root, no composition remembered in this process, and a count of real compositions."""
    from longspec.project import hydracompose as H

    monkeypatch.setenv("LONGSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(H, "_COMPOSED", {})
    calls: list[Path] = []
    real = H._compose_stage

    def counted(path, overrides):
        calls.append(Path(path))
        return real(path, overrides)

    monkeypatch.setattr(H, "_compose_stage", counted)
    return calls


@pytest.mark.parametrize("name,stage,extra,overrides,_", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_cached_composition_is_exactly_the_fresh_one(name, stage, extra, overrides, _, tmp_path, assets,
                                                       compose_count, monkeypatch):
    from longspec.project import composecache
    from longspec.project import hydracompose as H

    proj = project(tmp_path, assets, stage, extra)
    path, args = proj / "conf" / "exp" / "s.yaml", [out_dir(proj), *overrides]
    fresh = H.compose_stage(path, args)
    monkeypatch.setattr(H, "_COMPOSED", {})  # as a new command would: only the cache folder remembers
    again = H.compose_stage(path, args)
    resolver = any(composecache._RESOLVER.search(t) for t in [stage, *extra.values(), *args])
    assert len(compose_count) == (2 if resolver else 1)  # a resolver's value is not the files' alone
    assert again == fresh
    assert again.to_json() == fresh.to_json()


def test_an_edited_stage_file_recomposes_that_stage_only(tmp_path, assets, compose_count, monkeypatch):
    from longspec.project import hydracompose as H

    proj = project(tmp_path, assets, CLEAN, {"conf/exp/t.yaml": CLEAN.replace("stage: s", "stage: t")})
    s, t = proj / "conf" / "exp" / "s.yaml", proj / "conf" / "exp" / "t.yaml"
    for p in (s, t):
        H.compose_stage(p, [out_dir(proj)])
    s.write_text(s.read_text().replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-4"))
    monkeypatch.setattr(H, "_COMPOSED", {})
    assert H.compose_stage(s, [out_dir(proj)]).get("learning_rate") == 1.0e-4
    assert H.compose_stage(t, [out_dir(proj)]).get("learning_rate") == 5.0e-4
    assert compose_count == [s, t, s]  # t came from the cache
    (proj / "conf" / "deepspeed" / "zero2.yaml").write_text(DS)  # a new file may change what Hydra finds
    monkeypatch.setattr(H, "_COMPOSED", {})
    H.compose_stage(t, [out_dir(proj)])
    assert compose_count == [s, t, s, t]
