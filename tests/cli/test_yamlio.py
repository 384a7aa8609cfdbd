"""Safe YAML loading: each bad input is one YamlError with a position, fast, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from longspec.files.yamlio import YamlError, item_line, key_line, load_mapping, parse, read_text

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


def test_load_keeps_line_of_and_empty_files(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_bytes(b"\xef\xbb\xbf# c\na: 1\nb:\n  c:\n    d: [1, 2]\n")
    doc = load_mapping(path)
    assert doc.line_of("a") == 2 and doc.line_of("b.c.d") == 5 and doc.line_of("b.zz") == 3
    assert key_line(doc.data["b"], "c") == 4 and item_line(doc.data["b"]["c"]["d"], 1) == 5
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_mapping(empty, allow_empty=True).data == {}
    with pytest.raises(YamlError, match="empty file"):
        load_mapping(empty)
