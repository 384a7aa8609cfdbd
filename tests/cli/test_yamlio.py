"""Safe YAML loading: each bad input is one YamlError with a position, fast, never a hang; the
libyaml fast path (fast=True) reads exactly what ruamel reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from longspec_cli.core.placeholders import scan_placeholders
from longspec_cli.core.presets import VARIANTS, preset_names
from longspec_cli.core.scaffold import InitAnswers, plan_project
from longspec_cli.core.yamlio import (LineMap, YamlError, item_line, key_line, load_mapping, parse, read_text,
                                      to_plain)

BOMB = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")
)

BAD = {
    "tab": (b"a: 1\n\tb: 2\n", "tab used for indentation", 2),
    "dup": (b"a: 1\nb: 2\na: 3\n", "duplicate key", 3),
    "syntax": (b"a: [1, 2\nb: 3\n", "YAML syntax error", 2),
    "list_root": (b"- 1\n- 2\n", "top level is a list", 1),
    "scalar_root": (b"just text\n", "top level is a str", 1),
    "empty": (b"", "empty file", None),
    "comments_only": (b"# nothing\n", "empty file", None),
    "binary": (b"PK\x03\x04\x00\x00binary", "binary file", None),
    "latin1": (b"a: 1\nname: caf\xe9\n", "not UTF-8", 2),
    "bomb": (BOMB.encode(), "alias bomb", None),
    "self_alias": (b"a: &a [1, *a]\n", "self-referencing alias", 1),
    "placeholder": (b"model_path_prefix: [Your Directory]/models/\n", "YAML syntax error", 1),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_yaml_is_one_positioned_error(tmp_path, name):
    raw, message, line = BAD[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(raw)
    t0 = time.perf_counter()
    with pytest.raises(YamlError) as err:
        load_mapping(path)
    assert time.perf_counter() - t0 < 2.0
    assert message in err.value.message
    assert err.value.path == path
    if line is not None:
        assert err.value.line == line
    assert path.read_bytes() == raw  # reading never changes the file


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(YamlError, match="file not found"):
        load_mapping(tmp_path / "nope.yaml")
    with pytest.raises(YamlError, match="is a folder"):
        load_mapping(tmp_path)


def test_line_of_points_at_nested_keys_and_bom_is_dropped(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_bytes(b"\xef\xbb\xbf# c\na: 1\nb:\n  c:\n    d: [1, 2]\n")
    doc = load_mapping(path)
    assert doc.data["a"] == 1
    assert doc.line_of("a") == 2 and doc.line_of("b.c.d") == 5
    assert doc.line_of("b.zz") == 3  # the nearest existing parent


def test_ordinary_aliases_are_fine():
    data = parse("base: &b {lr: 1}\nother:\n  <<: *b\n  wd: 2\n")
    assert data["other"]["lr"] == 1


# ---------------------------------------------------------------- fast=True (libyaml) == ruamel

def test_bad_yaml_is_the_same_error_on_the_fast_path(tmp_path):
    for name in sorted(BAD):
        raw, message, line = BAD[name]
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(raw)
        with pytest.raises(YamlError) as slow:
            load_mapping(path)
        with pytest.raises(YamlError) as fast:
            load_mapping(path, fast=True)
        got, want = fast.value, slow.value
        assert (got.message, got.line, got.column, got.hint) == (want.message, want.line, want.column, want.hint), name


def _ruamel_lines(node, prefix=""):
    """dotted key or list index -> line, read from ruamel's own position data."""
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out[f"{prefix}{k}"] = node.lc.key(k)[0] + 1
            out.update(_ruamel_lines(v, f"{prefix}{k}."))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out[f"{prefix}[{i}]"] = node.lc.item(i)[0] + 1
            out.update(_ruamel_lines(v, f"{prefix}[{i}]."))
    return out


def _fast_lines(node, prefix=""):
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out[f"{prefix}{k}"] = node.lines[k]
            out.update(_fast_lines(v, f"{prefix}{k}."))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out[f"{prefix}[{i}]"] = node.lines[i]
            out.update(_fast_lines(v, f"{prefix}[{i}]."))
    return out


def _typed(node):
    """Plain values with their types, so 1 vs 1.0 vs '1' vs True differ (nan compares equal)."""
    plain = to_plain(node)
    if isinstance(plain, dict):
        return {k: _typed(v) for k, v in plain.items()}
    if isinstance(plain, list):
        return [_typed(v) for v in plain]
    return (type(plain).__name__, repr(plain))


def assert_same_reading(text: str) -> None:
    fast, slow = parse(text, fast=True), parse(text)
    assert isinstance(fast, LineMap)  # the fast path really ran (no fallback to ruamel)
    assert _typed(fast) == _typed(slow)
    assert _fast_lines(fast) == _ruamel_lines(slow)


UPSTREAM_CONF = Path(__file__).resolve().parents[3] / "shared" / "upstream-longspec" / "conf"
UPSTREAM_FILES = sorted(UPSTREAM_CONF.rglob("*.yaml"))


@pytest.mark.skipif(not UPSTREAM_FILES, reason="upstream LongSpec checkout not present")
@pytest.mark.parametrize("path", UPSTREAM_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fast_path_reads_every_upstream_file_like_ruamel(path):
    text, _ = scan_placeholders(read_text(path), path)  # `[Your Directory]` made parseable first
    assert_same_reading(text)


INIT_ANSWERS = [dict(preset=p, variant=v, data={"base": "/data/base.jsonl"})
                for p in preset_names() for v in VARIANTS] + \
               [dict(target="/models/own", variant="standard", precision="fp32", nodes=2, hostfile="hosts",
                     stages=("base", "long"))]


@pytest.mark.parametrize("answers", INIT_ANSWERS,
                         ids=lambda a: f"{a.get('preset', 'target')}-{a['variant']}-{a.get('precision', '')}")
def test_fast_path_reads_every_file_init_renders_like_ruamel(tmp_path, answers):
    files = {p: t for p, t in plan_project(InitAnswers(tmp_path / "proj", **answers)).items() if p.suffix == ".yaml"}
    assert len(files) >= 4  # manifest, stages, DeepSpeed blocks
    for path, text in files.items():
        assert_same_reading(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        fast, slow = load_mapping(path, fast=True), load_mapping(path)
        for dotted in _ruamel_lines(slow.data):
            if "[" not in dotted:
                assert fast.line_of(dotted) == slow.line_of(dotted), (path.name, dotted)


# Scalars whose YAML 1.2 reading is easy to get wrong; the fast path must give ruamel's value
# (it defers the unusual ones to ruamel) and still take the fast path for the usual ones.
TRICKY = ["1e-6", "5e-4", "'5e-4'", "1.", "12.", ".5", "-.5", "+.5", "1_000", "1__0", "010", "-0", "~", "null",
          "NULL", "yes", "no", "on", "True", "FALSE", "tRue", ".inf", "-.inf", "+.INF", "-.Inf", ".NaN", "nan",
          "0x1F", "+0x10", "0o17", "-0o7", "0b101", ".5e3", "._5", "-_1", "1:30", "2001-12-14",
          "2001-12-14 21:59:43.10", "2001-12-14t21:59:43.10-05:00", "=", "<<", "0.1.0", "1b_model/ckpt",
          "./data/x.jsonl", "-foo", "a # comment", '"q # not a comment"', "|\n  block\n", ">-\n  folded\n  text\n"]


@pytest.mark.parametrize("value", TRICKY)
def test_fast_path_scalars_are_ruamels(value):
    text = f"k: {value}\nnext: 1\n"
    assert _typed(parse(text, fast=True)) == _typed(parse(text))


def test_fast_path_is_taken_for_ordinary_scalars_only():
    assert isinstance(parse("lr: 5e-4\npath: ./data/x.jsonl\nbetas: [0.9, 0.95]\nn: 1_000\n", fast=True), LineMap)
    for unusual in ("d: 2001-12-14\n", "h: 0x1F\n", "v: =\n", "a: &x 1\nb: *x\n", "%YAML 1.2\n---\na: 1\n",
                    "a: 1\u2028b: 2\n", "a: 1\na: 2\n"):
        try:
            got = parse(unusual, fast=True)
        except YamlError:
            continue  # ruamel's error, as without fast=True
        assert not isinstance(got, LineMap), unusual


def test_fast_load_keeps_line_of_and_empty_files(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_bytes(b"\xef\xbb\xbf# c\na: 1\nb:\n  c:\n    d: [1, 2]\n")
    doc = load_mapping(path, fast=True)
    assert isinstance(doc.data, LineMap)
    assert doc.line_of("a") == 2 and doc.line_of("b.c.d") == 5 and doc.line_of("b.zz") == 3
    assert key_line(doc.data["b"], "c") == 4 and item_line(doc.data["b"]["c"]["d"], 1) == 5
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_mapping(empty, allow_empty=True, fast=True).data == {}
    with pytest.raises(YamlError, match="empty file"):
        load_mapping(empty, fast=True)
