"""Hydra composes the stage; what it does not say is added: file:line of every key and every
problem, all problems at once, hints that say the fix (project.hydracompose, `longspec config`)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.project.hydracompose import compose_stage
from longspec.project.hydraproblems import HEADER_HINT

runner = CliRunner()


def validate(project) -> tuple[int, dict]:
    res = runner.invoke(app, ["validate", str(project.root), "--json"])
    assert "Traceback" not in res.output
    return res.exit_code, json.loads(res.stdout)


def errors(rep: dict, file=None) -> list[dict]:
    return [p for p in rep["problems"] if p["severity"] == "error" and (file is None or p["file"] == str(file))]


def line_of(path, start: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(start))


def edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_header_after_another_comment_is_an_error_with_the_fix(project):
    cfg = project.config("long")
    lines = cfg.read_text().splitlines(keepends=True)
    cfg.write_text(lines[1] + lines[0] + "".join(lines[2:]))  # the command comment first, the header second
    code, rep = validate(project)
    assert code == 1
    (head,) = [p for p in errors(rep, cfg) if "merged under `exp.`" in p["message"]]
    assert head["line"] == 2 and head["hint"] == HEADER_HINT
    missing = {p["key"] for p in errors(rep, cfg) if "must be set" in p["message"]}
    assert {"model_name_or_path", "train_file"} <= missing  # what the trainer would see: `???`
    assert not [p for p in rep["problems"] if p["key"] == "exp"]  # said once, not as an unknown key


def test_relative_default_points_at_the_entry_and_says_the_slash(project):
    cfg = project.config("base")
    edit(cfg, "  - /deepspeed@ds_cfg:", "  - deepspeed@ds_cfg:")
    code, rep = validate(project)
    (p,) = [p for p in errors(rep, cfg) if p["key"] == "defaults"]
    assert code == 1 and p["key"] == "defaults" and p["line"] == line_of(cfg, "  - deepspeed@ds_cfg")
    assert "exp/deepspeed/zero1_offload_cosine" in p["message"] and "leading `/`" in p["hint"]


def test_override_with_nothing_to_override_and_a_group_listed_twice(project):
    cfg = project.config("base")
    edit(cfg, "  - /deepspeed@ds_cfg:", "  - override /deepspeed@ds_cfg:")
    _, rep = validate(project)
    (p,) = [p for p in errors(rep, cfg) if p["key"] == "defaults"]
    assert "has nothing to override" in p["message"] and "remove `override `" in p["hint"]
    assert p["line"] == line_of(cfg, "  - override")
    cfg2 = project.config("long")
    (project.root / "conf" / "deepspeed" / "other.yaml").write_text("zero_optimization:\n  stage: 2\n")
    edit(cfg2, "  - _self_", "  - /deepspeed@ds_cfg: other\n  - _self_")
    _, rep = validate(project)
    (p,) = [p for p in errors(rep, cfg2) if p["key"] == "defaults"]
    assert "listed twice" in p["message"] and "override" in p["hint"]


def test_every_problem_at_once_with_file_line_and_did_you_mean(project):
    ds = project.root / "conf" / "deepspeed" / "zero1_offload_cosine.yaml"
    ds.write_text("zero_optimization:\n  stage: 1\ngradient_clipping: ${max_grad_nrom}\n")
    cfg = project.config("base")
    edit(cfg, "learning_rate: 5.0e-4", "learning_rate: fast\nlearnig_rate: 1\ntrain_eos: true")
    edit(cfg, "train_file: ", "train_file: ???\n# was: ")
    code, rep = validate(project)
    got = {(p["key"], p["file"], p["line"]): p for p in errors(rep)}
    interp = got[("ds_cfg.gradient_clipping", str(ds), 3)]
    assert "`max_grad_nrom`, which is not set" in interp["message"] and interp["hint"] == "did you mean `${max_grad_norm}`?"
    assert ("learning_rate", str(cfg), line_of(cfg, "learning_rate:")) in got
    assert got[("learnig_rate", str(cfg), line_of(cfg, "learnig_rate"))]["hint"] == "did you mean `learning_rate`?"
    assert got[("train_eos", str(cfg), line_of(cfg, "train_eos"))]["hint"] == "did you mean `data.train_eos`?" \
        or ("train_eos", str(cfg), line_of(cfg, "train_eos")) in got
    assert got[("train_file", str(cfg), line_of(cfg, "train_file"))]["message"].startswith("`train_file` must be set")
    assert code == 1


def test_config_shows_where_each_key_was_set(project):
    res = runner.invoke(app, ["config", str(project.root), "long", "seed=7"])
    assert res.exit_code == 0, res.output
    lines = {line.split(":")[0].strip(): line for line in res.stdout.splitlines()}
    assert lines["seed"].endswith("# override") and "seed: 7" in lines["seed"]
    assert "trainer default (" in lines["adam_epsilon"] and "config.yaml:" in lines["adam_epsilon"]
    assert f"# {project.config('long')}:{line_of(project.config('long'), 'precision')}" in lines["precision"]
    assert f"conf/deepspeed/zero1_offload_cosine.yaml:2" in lines["stage"] or "stage: 1" in res.stdout
    assert f"output_dir: \"{project.out('long')}\"" in res.stdout  # as `longspec run` passes it
    js = json.loads(runner.invoke(app, ["config", str(project.root), "long", "--json"]).stdout)
    assert js["origins"]["ds_cfg.zero_optimization.stage"].endswith("zero1_offload_cosine.yaml:2")
    assert js["config"]["ds_cfg"]["zero_optimization"]["stage"] == 1 and js["problems"] == []


def test_config_refuses_a_stage_that_does_not_compose(project):
    res = runner.invoke(app, ["config", str(project.root), "base", "max_stepz=3"])
    assert res.exit_code == 1 and "did you mean `max_steps`" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["config", str(project.root), "nope"])
    assert res.exit_code == 2


def test_upstream_keys_in_a_longspec_file_name_the_longspec_key_and_are_checked(project):
    cfg = project.config("base")
    cfg.write_text(cfg.read_text() + "collator:\n  max_seq_length: 0\nmodel:\n  _target_: models.Glide\n")
    c = compose_stage(cfg)
    assert c.dialect == "longspec"  # still the trainer's composition
    _, rep = validate(project)
    by_key = {p["key"]: p for p in errors(rep, cfg)}
    assert "data.collator" in by_key["collator"]["hint"] and "data.max_seq_length" in by_key["collator"]["hint"]
    assert "out of range" in by_key["collator.max_seq_length"]["message"]
    assert by_key["model"]["hint"].startswith("remove it")


def test_yaml_1_1_scalars_read_as_omegaconf_reads_them(project):
    cfg = project.config("base")
    edit(cfg, "learning_rate: 5.0e-4", "learning_rate: 5.0e-4\nseed: 010\nlogging:\n  wandb: yes")
    c = compose_stage(cfg)
    assert c.get("seed") == 8 and c.get("logging.wandb") is True
    _, rep = validate(project)
    assert not [p for p in errors(rep, cfg) if p["key"] in ("seed", "logging.wandb", "logging")]


def test_every_check_runs_on_the_hydra_composition():
    from longspec.project import validate
    from longspec.project.composed import Composed

    assert validate.check_target_family in validate.FILE_CHECKS
    assert all(check.__annotations__.get("c") in ("Composed", Composed) for check in validate.FILE_CHECKS)


def _probe(code: str, *args: str) -> list[str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_a_second_status_reads_the_compositions_and_imports_no_hydra(project):
    code = ("import sys\nfrom longspec_cli.app import app\ntry:\n    app(['status', sys.argv[1]])\n"
            "except SystemExit:\n    pass\nprint('LOADED', 'hydra' in sys.modules, 'omegaconf' in sys.modules)\n")
    first = _probe(code, str(project.root))
    assert first[first.index("LOADED") + 1:] == ["True", "True"]
    second = _probe(code, str(project.root))
    assert second[second.index("LOADED") + 1:] == ["False", "False"]
    edit(project.config("long"), "learning_rate: 5.0e-4", "learning_rate: 1.0e-4")
    third = _probe(code, str(project.root))
    assert third[third.index("LOADED") + 1:] == ["True", "True"]  # the edited stage is composed again
