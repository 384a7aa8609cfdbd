"""compose.py: Hydra-style defaults lists, merge with provenance, ${...} interpolation, placeholders."""

from __future__ import annotations

import glob
import textwrap
from pathlib import Path

import pytest

from longspec_cli.core import yamlio
from longspec_cli.core.compose import (compose_file, config_root, fast_parse, scan_placeholders,
                                       split_interpolations)

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT.parent / "shared" / "upstream-longspec"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def conf(tmp_path: Path, stage: str, **ds: str) -> Path:
    for name, text in ds.items():
        write(tmp_path / "conf" / "deepspeed" / f"{name}.yaml", text)
    return write(tmp_path / "conf" / "exp" / "s.yaml", stage)


def messages(c) -> list[str]:
    return [p.message for p in c.problems]


# ---------------------------------------------------------------- defaults list

def test_self_last_overrides_the_default_and_records_where(tmp_path):
    stage = conf(tmp_path, """
        # @package _global_
        defaults:
          - /deepspeed@ds_cfg: z1
          - _self_
        lr: 0.1
        ds_cfg:
          zero_optimization:
            stage: 3
        """, z1="""
        zero_optimization:
          stage: 1
          offload_optimizer: {device: cpu}
        steps_per_print: 10
        """)
    c = compose_file(stage)
    assert c.problems == []
    assert c.get("ds_cfg.zero_optimization.stage") == 3  # _self_ came last: the stage file wins
    assert c.get("ds_cfg.zero_optimization.offload_optimizer.device") == "cpu"  # merged, not replaced
    assert c.get("ds_cfg.steps_per_print") == 10
    assert "defaults" not in c.data
    hist = c.origins["ds_cfg.zero_optimization.stage"]
    assert [(o.file.name, o.line, o.value) for o in hist] == [("z1.yaml", 2, 1), ("s.yaml", 8, 3)]
    assert c.origin("ds_cfg.steps_per_print").file.name == "z1.yaml"


def test_self_first_lets_the_default_win(tmp_path):
    stage = conf(tmp_path, """
        defaults:
          - _self_
          - deepspeed@ds_cfg: z1
        ds_cfg: {steps_per_print: 5}
        """, z1="steps_per_print: 10\n")
    assert compose_file(stage).get("ds_cfg.steps_per_print") == 10


def test_missing_self_means_self_last(tmp_path):
    stage = conf(tmp_path, """
        defaults:
          - deepspeed@ds_cfg: z1
        ds_cfg: {steps_per_print: 5}
        """, z1="steps_per_print: 10\n")
    assert compose_file(stage).get("ds_cfg.steps_per_print") == 5


def test_missing_default_names_every_file_searched_and_suggests(tmp_path):
    stage = conf(tmp_path, """
        defaults:
          - /deepspeed@ds_cfg: zero1_ofload
          - _self_
        a: 1
        """, zero1_offload="steps_per_print: 1\n")
    c = compose_file(stage)
    (p,) = c.problems
    assert p.severity == "error" and p.line == 2 and p.key == "defaults"
    assert str(tmp_path / "conf" / "deepspeed" / "zero1_ofload.yaml") in p.message
    assert "zero1_offload" in p.hint
    assert c.get("a") == 1  # the rest of the file is still composed


def test_hydra_group_and_searchpath(tmp_path):
    # upstream layout: train/conf/exp/x.yaml with `hydra.searchpath: [file://conf/]` relative to train/
    write(tmp_path / "train" / "conf" / "hydra" / "default.yaml", "run:\n  dir: logs/${hydra.job.name}/${now:%H}\n")
    write(tmp_path / "train" / "conf" / "deepspeed" / "z.yaml", "bf16: {enabled: true}\n")
    stage = write(tmp_path / "train" / "conf" / "exp" / "x.yaml", """
        defaults:
          - hydra: default
          - deepspeed@ds_cfg: z
          - _self_
        hydra:
          searchpath:
            - file://conf/
        x: 1
        """)
    assert config_root(stage) == tmp_path / "train" / "conf"
    c = compose_file(stage)
    assert c.problems == []  # ${hydra.job.name} and ${now:...} are Hydra's, not ours
    assert c.get("hydra.run.dir") == "logs/${hydra.job.name}/${now:%H}"
    assert c.get("ds_cfg.bf16.enabled") is True


def test_package_header_global_and_defaults_loop(tmp_path):
    write(tmp_path / "conf" / "deepspeed" / "a.yaml", "defaults:\n  - /deepspeed@x: b\nk: 1\n")
    write(tmp_path / "conf" / "deepspeed" / "b.yaml", "defaults:\n  - /deepspeed@y: a\nj: 2\n")
    stage = write(tmp_path / "conf" / "exp" / "s.yaml", "defaults:\n  - /deepspeed@ds: a\n  - _self_\n")
    c = compose_file(stage)
    assert c.get("ds.k") == 1 and c.get("ds.x.j") == 2
    assert any("loops back" in m for m in messages(c))  # no infinite recursion


def test_global_package_header_in_included_file(tmp_path):
    write(tmp_path / "conf" / "extra" / "g.yaml", "# @package _global_\nseed: 7\n")
    stage = write(tmp_path / "conf" / "exp" / "s.yaml", "defaults:\n  - /extra: g\n  - _self_\nx: 1\n")
    c = compose_file(stage)
    assert c.get("seed") == 7 and "extra" not in c.data


# ---------------------------------------------------------------- interpolation

def test_interpolation_absolute_nested_in_strings_and_typed(tmp_path):
    stage = write(tmp_path / "s.yaml", """
        prefix: /data
        name: run
        seed: 42
        out: ${prefix}/${name}/s${seed}
        bs: ${seed}
        block:
          inner: ${name}
          sib: ${.inner}-x
        copy: ${block}
        deep: ${copy.sib}
        lit: \\${not_a_ref}
        """)
    c = compose_file(stage)
    assert c.problems == []
    assert c.get("out") == "/data/run/s42"
    assert c.get("bs") == 42 and isinstance(c.get("bs"), int)
    assert c.get("block.sib") == "run-x"
    assert c.get("copy") == {"inner": "run", "sib": "run-x"}
    assert c.get("deep") == "run-x"
    assert c.get("lit") == "${not_a_ref}"
    assert c.refs["out"] == ["prefix", "name", "seed"]


def test_env_resolver_and_unknown_resolvers(tmp_path, monkeypatch):
    monkeypatch.setenv("LS_TEST_DIR", "/env/dir")
    monkeypatch.delenv("LS_UNSET_VAR", raising=False)
    stage = write(tmp_path / "s.yaml", """
        a: ${oc.env:LS_TEST_DIR}/x
        b: ${oc.env:LS_UNSET_VAR,/fallback}
        c: ${oc.env:LS_UNSET_VAR}
        d: ${now:%Y-%m-%d}
        e: ${oc.select:nope,7}
        """)
    c = compose_file(stage)
    assert c.get("a") == "/env/dir/x" and c.get("b") == "/fallback"
    assert c.get("d") == "${now:%Y-%m-%d}" and c.get("e") == "7"
    (p,) = c.problems
    assert p.severity == "warning" and "LS_UNSET_VAR" in p.message and p.line == 3


def test_missing_key_and_cycles_are_problems_not_hangs(tmp_path):
    stage = write(tmp_path / "s.yaml", """
        a: ${b}
        b: ${c}
        c: ${a}
        self: ${self}
        lr: ${learnig_rate}
        learning_rate: 0.1
        ok: 1
        """)
    c = compose_file(stage)
    msgs = messages(c)
    assert any("cycle" in m and "a" in m for m in msgs)
    assert any("cycle self -> self" in m for m in msgs)
    missing = [p for p in c.problems if "not set" in p.message]
    assert len(missing) == 1 and missing[0].line == 5 and "${learning_rate}" in missing[0].hint
    assert c.get("ok") == 1


def test_long_reference_chain_terminates(tmp_path):
    lines = [f"k{i}: ${{k{i + 1}}}" for i in range(300)] + ["k300: end"]
    stage = write(tmp_path / "s.yaml", "\n".join(lines) + "\n")
    c = compose_file(stage)  # must return; deep chains are cut off with a problem, not a crash
    assert c.get("k299") == "end"
    assert isinstance(c.get("k0"), str)


def test_split_interpolations():
    assert split_interpolations("a${x}b${oc.env:V,${y}}") == [("a", False), ("x", True), ("b", False),
                                                              ("oc.env:V,${y}", True)]
    assert split_interpolations("open ${ end") == [("open ${ end", False)]


# ---------------------------------------------------------------- placeholders

def test_placeholders_are_reported_with_lines_and_the_file_still_parses(tmp_path):
    text = textwrap.dedent("""
        model_path_prefix: [Your Directory]/models/
        train_file: /path/to/data.jsonl
        draft: <path>
        must: ???
        eos_token: "<|endoftext|>"
        pad_token: <pad>
        betas: [ 0.9, 0.95 ]
        out: x  # Fix <pad token id>
        """).lstrip()
    new, problems = scan_placeholders(text, Path("s.yaml"))
    assert [(p.line, p.key) for p in problems] == [(1, "model_path_prefix"), (2, "train_file"), (3, "draft"),
                                                   (4, "must")]
    assert all(p.hint == "replace the placeholder with your path" for p in problems)
    data = yamlio.to_plain(yamlio.parse(new))
    assert data["betas"] == [0.9, 0.95] and data["model_path_prefix"].endswith("/models/")
    c = compose_file(write(tmp_path / "s.yaml", text))
    assert "[Your Directory]" in c.problems[0].message and c.get("betas") == [0.9, 0.95]


# ---------------------------------------------------------------- fast parser == yamlio

def _lines(node, prefix=""):
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            line = node.lines[k] if hasattr(node, "lines") else node.lc.key(k)[0] + 1
            out[prefix + str(k)] = line
            out.update(_lines(v, f"{prefix}{k}."))
    return out


CORPUS = sorted(glob.glob(str(UPSTREAM / "conf" / "**" / "*.yaml"), recursive=True)) + \
    sorted(str(p) for p in (ROOT / "templates").glob("*.yaml") if "{{" not in p.read_text())


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: Path(p).name)
def test_fast_parse_matches_yamlio_values_and_lines(path):
    text, _ = scan_placeholders(yamlio.read_text(path), Path(path))
    fast, slow = fast_parse(text), yamlio.parse(text)
    assert yamlio.to_plain(fast) == yamlio.to_plain(slow)
    assert _lines(fast) == _lines(slow)


def test_fast_parse_scalars_follow_yaml_1_2():
    text = "a: 1e-6\nb: '5e-4'\nc: yes\nd: 1_000\ne: 0x10\nf: ~\ng: True\nh: .inf\ni: 1.\nj: -3\n"
    assert yamlio.to_plain(fast_parse(text)) == yamlio.to_plain(yamlio.parse(text))


@pytest.mark.parametrize("text", ["a: 1\na: 2\n", "a: &x 1\nb: *x\n", "a: 1\n\tb: 2\n", "a: !!str 1\n",
                                  "a: [1, 2\n"])
def test_fast_parse_falls_back_to_yamlio_for_anything_unusual(text):
    try:
        expected = repr(yamlio.to_plain(yamlio.parse(text)))
    except yamlio.YamlError as e:
        with pytest.raises(yamlio.YamlError) as got:
            fast_parse(text)
        assert (got.value.reason, got.value.line) == (e.reason, e.line)
    else:
        assert repr(yamlio.to_plain(fast_parse(text))) == expected


def test_names_moved_out_of_compose_and_validate_still_import_from_there():
    """launch/, tui/ and older code import these from compose/validate; the split must not break them."""
    from longspec_cli.core import compose, validate

    for name in ("Problem", "Origin", "Composed", "compose_file", "read_doc", "config_root", "search_roots",
                 "resolve", "split_interpolations", "scan_placeholders", "show_placeholders", "has_placeholder",
                 "strip_comment", "fast_parse", "LineMap", "LineList", "PLACEHOLDER", "MAX_DEFAULTS_DEPTH",
                 "MAX_INTERP_DEPTH"):
        assert getattr(compose, name) is not None, name
    for name in ("Problem", "Report", "Context", "validate_paths", "validate_file", "validate_project",
                 "FILE_CHECKS", "DEFAULT_WORLD", "LONG_CONTEXT", "WEIGHTS_NAMES", "REQUIRED", "DUPLICATES",
                 "global_batch", "check_unknown_keys", "check_types", "check_required", "check_paths",
                 "check_precision", "check_duplicates", "check_zero", "check_batch", "check_seq_len",
                 "check_checkpoint_chain", "check_upstream_lineage", "Composed", "Origin", "compose_file",
                 "has_placeholder", "read_doc", "strip_comment"):
        assert hasattr(validate, name), name
    assert validate.Problem is compose.Problem
    assert len(validate.FILE_CHECKS) == 12
    assert validate.check_target_family in validate.FILE_CHECKS
