"""next-stage's edit over many YAML shapes: byte for byte the same file except ONE line
(`draft_model_name_or_path`), changed in place or added; and over copies of the upstream
LongSpec experiment files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests import needs
from longspec_cli.app import app
from longspec.files.yamledit import render_scalar, set_root_scalar
from longspec.files.yamlio import parse, to_plain

from .conftest import no_traceback, panel_text

runner = CliRunner()
UPSTREAM = Path(__file__).resolve().parents[3] / "shared" / "upstream-longspec" / "conf" / "exp"
KEY = "draft_model_name_or_path"


def _run_edit(tmp_path: Path, text: bytes, draft: Path) -> bytes:
    cfg = tmp_path / "exp.yaml"
    cfg.write_bytes(text)
    res = runner.invoke(app, ["next-stage", "--config", str(cfg), "--draft", str(draft), "--no-deep"])
    assert res.exit_code == 0, res.output
    return cfg.read_bytes()


def _diff_one(before: bytes, after: bytes) -> tuple[int, bytes | None, bytes]:
    """(0-based line index, old line or None if inserted, new line); asserts nothing else changed."""
    a, b = before.split(b"\n"), after.split(b"\n")
    if len(a) == len(b):
        diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(diffs) == 1, f"lines {diffs} changed"
        return diffs[0], a[diffs[0]], b[diffs[0]]
    assert len(b) == len(a) + 1, "more than one line added"
    for i in range(len(b)):
        if b[:i] + b[i + 1:] == a:
            return i, None, b[i]
    raise AssertionError("an added line and other changes")


def _same_except_key(before: bytes, after: bytes, draft: Path) -> None:
    old = to_plain(parse(before.decode("utf-8-sig")))
    new = to_plain(parse(after.decode("utf-8-sig")))
    assert new[KEY] == str(draft)
    old.pop(KEY, None)
    new.pop(KEY)
    assert repr(new) == repr(old)


@pytest.fixture
def draft(tmp_path) -> Path:
    p = tmp_path / "runs" / "base" / "draft_model_weights.pth"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"weights")
    return p


# (id, file text, index of the line that changes/appears, expected new line with {p} = the path)
SHAPES = [
    ("null with trailing comment",
     "# @package _global_\n# header\nstage: long\ndraft_model_name_or_path: null  # set by next-stage\nlr: 1\n",
     3, "draft_model_name_or_path: {p}  # set by next-stage"),
    ("tilde", "a: 1\ndraft_model_name_or_path: ~\nb: 2\n", 1, "draft_model_name_or_path: {p}"),
    ("empty value with comment", "a: 1\ndraft_model_name_or_path:    # nothing yet\nb: 2\n",
     1, "draft_model_name_or_path: {p}    # nothing yet"),
    ("empty value last line no newline", "a: 1\ndraft_model_name_or_path:", 1, "draft_model_name_or_path: {p}"),
    ("explicit null tag", "draft_model_name_or_path: !!null\n", 0, "draft_model_name_or_path: {p}"),
    ("single quoted kept", "draft_model_name_or_path: 'old/it''s.pth'   # q\n", 0,
     "draft_model_name_or_path: '{p}'   # q"),
    ("double quoted kept", 'draft_model_name_or_path: "/old # not a comment"  # real\n', 0,
     'draft_model_name_or_path: "{p}"  # real'),
    ("empty quoted", "draft_model_name_or_path: ''\n", 0, "draft_model_name_or_path: '{p}'"),
    ("quoted key", '"draft_model_name_or_path": /old\n', 0, '"draft_model_name_or_path": {p}'),
    ("value on the next line", "draft_model_name_or_path:\n    /old/path.pth   # c\nx: 1\n", 1, "    {p}   # c"),
    ("crlf replace", "a: 1\r\ndraft_model_name_or_path: null\r\nb: [1, 2]\r\n", 1, "draft_model_name_or_path: {p}\r"),
    ("crlf insert after model",
     "# c\r\nmodel_name_or_path: /t  # target\r\n\r\n# next\r\nb: 1\r\n", 2, "draft_model_name_or_path: {p}\r"),
    ("insert after model, before comments and blank lines",
     "defaults:\n  - /deepspeed@ds_cfg: zero1_offload_cosine  # ds\n  - _self_\n\n"
     "model_name_or_path: /models/QwQ-32B-Preview   # a very long trailing comment that goes past eighty columns on purpose ok\n"
     "\n# the data\ntrain_file: /d.jsonl\n",
     5, "draft_model_name_or_path: {p}"),
    ("insert after a nested model value",
     "model_name_or_path:\n    - /a\n    - /b\n    # trailing comment inside\n\nnext: 1\n", 3, "draft_model_name_or_path: {p}"),
    ("insert at the end with document markers", "--- # doc\na: 1\nb:\n    c: 2\n# tail comment\n...\n",
     4, "draft_model_name_or_path: {p}"),
    ("insert at the end, no model key", "a: 1\nb: {x: 1, y: [1, 2]}\n", 2, "draft_model_name_or_path: {p}"),
    ("insert, file without final newline", "a: 1\nmodel_name_or_path: /t", 2, "draft_model_name_or_path: {p}"),
    ("insert into an indented root mapping", "  a: 1\n  model_name_or_path: /t\n  b: 2\n", 2,
     "  draft_model_name_or_path: {p}"),
    ("insert after a block scalar whose comment-looking lines are content",
     "model_name_or_path: |\n  /x\n  # not a comment\nnext: 1\n", 3, "draft_model_name_or_path: {p}"),
    ("insert after a keep-chomped block scalar with trailing blank lines",
     "model_name_or_path: |+\n  /x\n\n\nnext: 1\n", 4, "draft_model_name_or_path: {p}"),
]

OTHER_SHAPES = """\
# @package _global_
# python -m longspec.train --config-dir conf +exp=long
defaults:
    - /deepspeed@ds_cfg: zero3_offload_cosine   # four-space indents
    - _self_

base: &base {lr: 5.0e-6, betas: [0.9, 0.95]}
opt:
    <<: *base
    eps: 1e-6
flow_seq: [a, "b c", 'd']   # flow sequence
flow_map: {k: v, n: 1}
notes: |
    line one
    # not a comment, content of the block
folded: >-
    a very long folded text that is definitely past the eighty column mark in this file, on purpose
quoted: "x: y # z"
empty:
model_name_or_path: /models/target
draft_model_name_or_path: null   # chained
tail: *base
"""


@pytest.mark.parametrize("name,text,line,expected", SHAPES, ids=[s[0] for s in SHAPES])
def test_only_the_draft_line_changes(tmp_path, draft, name, text, line, expected):
    before = text.encode()
    after = _run_edit(tmp_path, before, draft)
    i, _, new = _diff_one(before, after)
    assert i == line, (i, after)
    assert new == expected.format(p=draft).encode()
    _same_except_key(before, after, draft)


def test_a_file_with_every_other_shape_keeps_them_all(tmp_path, draft):
    before = OTHER_SHAPES.encode()
    after = _run_edit(tmp_path, before, draft)
    i, old, new = _diff_one(before, after)
    assert old == b"draft_model_name_or_path: null   # chained"
    assert new == f"draft_model_name_or_path: {draft}   # chained".encode()
    _same_except_key(before, after, draft)
    crlf = before.replace(b"\n", b"\r\n")
    after = _run_edit(tmp_path, crlf, draft)
    assert after == crlf.replace(b"draft_model_name_or_path: null", f"draft_model_name_or_path: {draft}".encode())


def test_key_absent_from_the_rich_file_is_added_after_model_name_or_path(tmp_path, draft):
    before = OTHER_SHAPES.replace("draft_model_name_or_path: null   # chained\n", "").encode()
    after = _run_edit(tmp_path, before, draft)
    i, old, new = _diff_one(before, after)
    assert old is None and before.split(b"\n")[i - 1] == b"model_name_or_path: /models/target"
    assert new == f"draft_model_name_or_path: {draft}".encode()


def test_unicode_path_with_spaces_and_colons_is_quoted_and_reads_back(tmp_path):
    weird = tmp_path / "rüns ünd späces" / "base: v2 #1" / "draft_model_weights.pth"
    weird.parent.mkdir(parents=True)
    weird.write_bytes(b"w")
    before = "# über\nmodel_name_or_path: /t\ndraft_model_name_or_path: null  # ok\n".encode()
    after = _run_edit(tmp_path, before, weird)
    _, _, new = _diff_one(before, after)
    assert new.startswith(b'draft_model_name_or_path: "') and new.endswith(b'"  # ok')
    _same_except_key(before, after, weird)
    plain_unicode = tmp_path / "rüns" / "w.pth"
    plain_unicode.parent.mkdir()
    plain_unicode.write_bytes(b"w")
    after = _run_edit(tmp_path, before, plain_unicode)
    assert f"draft_model_name_or_path: {plain_unicode}  # ok".encode() in after


def test_crlf_file_without_a_final_newline_gets_a_crlf_before_the_new_last_line(tmp_path, draft):
    after = _run_edit(tmp_path, b"a: 1\r\nb: 2", draft)
    assert after == b"a: 1\r\nb: 2\r\ndraft_model_name_or_path: " + str(draft).encode()


def test_bom_is_kept(tmp_path, draft):
    before = b"\xef\xbb\xbfa: 1\ndraft_model_name_or_path: null\n"
    after = _run_edit(tmp_path, before, draft)
    assert after == b"\xef\xbb\xbfa: 1\ndraft_model_name_or_path: " + str(draft).encode() + b"\n"


@pytest.mark.parametrize("value", ["/plain/path.pth", "/with space/x.pth", "/a: b/c", "/x #y", "/q'uote\"s",
                                   "true", "123", "null", "~", "-lead", "/ü/ß/日本", "/tab\there", "/[x]/{y}",
                                   "*star", "&amp", "!bang", "%pct", "@at", "`tick", "/line\nbreak"])
def test_rendered_scalars_read_back_as_the_same_string(value):
    for style in (None, "'", '"'):
        edit = set_root_scalar("k: 1\ndraft_model_name_or_path: old\n", KEY, value)
        assert parse(edit.new_text)[KEY] == value
        assert parse(f"x: {render_scalar(value, style)}\n")["x"] == value


# ----------------------------------------------------------------------------- upstream files

UPSTREAM_FILES = sorted(UPSTREAM.glob("*.yaml")) if UPSTREAM.is_dir() else []
needs_upstream = pytest.mark.skipif(not UPSTREAM_FILES and not needs.REQUIRE,  # CI has shared/: a failure there
                                    reason="../shared/upstream-longspec not present")


@needs_upstream
@pytest.mark.parametrize("src", UPSTREAM_FILES, ids=[p.name for p in UPSTREAM_FILES])
def test_upstream_file_with_placeholders_is_unreadable_and_untouched(tmp_path, draft, src):
    cfg = tmp_path / src.name
    shutil.copyfile(src, cfg)
    raw = cfg.read_bytes()
    assert b"[Your Directory]" in raw
    res = runner.invoke(app, ["next-stage", "--config", str(cfg), "--draft", str(draft), "--no-deep"])
    assert res.exit_code == 3, res.output
    no_traceback(res)
    assert "YAML syntax error" in panel_text(res.output)
    assert cfg.read_bytes() == raw


@needs_upstream
@pytest.mark.parametrize("src", UPSTREAM_FILES, ids=[p.name for p in UPSTREAM_FILES])
def test_upstream_file_with_a_real_directory_gets_one_new_line(tmp_path, draft, src):
    before = src.read_bytes().replace(b"[Your Directory]", str(tmp_path / "work").encode())
    after = _run_edit(tmp_path, before, draft)
    i, old, new = _diff_one(before, after)
    assert old is None
    assert before.split(b"\n")[i - 1].startswith(b"model_name_or_path: ${model_path_prefix}")
    assert new == f"draft_model_name_or_path: {draft}".encode()
    _same_except_key(before, after, draft)
    # a second run finds the key and changes nothing
    assert _run_edit(tmp_path, after, draft) == after
