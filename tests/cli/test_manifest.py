"""longspec.yaml: loading, path resolution, and file:line errors for every shape mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspec.project.manifest import find_manifest, load_manifest
from longspec.files.yamlio import YamlError
from longspec.errors import UsageError


def test_loads_the_design_example_and_resolves_paths_against_the_project(project):
    m = load_manifest(project.root)
    assert m.name == "demo" and m.variant == "sinkpi-slicing" and m.preset is None
    assert m.stage_names == ["base", "long", "longcot"]
    assert m.target == project.root / "assets" / "target"
    assert m.launch.gpus == 1 and m.launch.nodes == 1 and m.launch.hostfile is None
    long = m.stage("long")
    assert long.config == project.config("long") and long.output_dir == project.out("long")
    assert long.draft_from == "base" and m.previous("long").name == "base"
    assert m.previous("base") is None
    assert m.index("longcot") == 2
    assert long.line == 9


def test_older_variant_name_still_loads(project):
    path = project.root / "longspec.yaml"
    path.write_text(path.read_text().replace("variant: sinkpi-slicing", "variant: sinkpi"))
    assert load_manifest(project.root).variant == "sinkpi-slicing"


def test_find_manifest_accepts_the_folder_or_the_file(project, tmp_path):
    assert find_manifest(project.root) == project.root / "longspec.yaml"
    assert find_manifest(project.root / "longspec.yaml") == project.root / "longspec.yaml"
    with pytest.raises(UsageError, match="no such file"):
        find_manifest(tmp_path / "nope")
    with pytest.raises(UsageError, match="not a longspec project"):
        find_manifest(tmp_path)


def test_absolute_paths_stay_and_manifest_given_relative_resolves(project, monkeypatch, tmp_path):
    text = (project.root / "longspec.yaml").read_text().replace("output_dir: runs/base", "output_dir: /abs/base")
    (project.root / "longspec.yaml").write_text(text)
    monkeypatch.chdir(project.root.parent)
    m = load_manifest(Path("proj"))
    assert m.stage("base").output_dir == Path("/abs/base")
    assert m.stage("long").output_dir == project.out("long")
    assert m.root.is_absolute()


def test_unknown_stage_name_has_a_did_you_mean(project):
    m = load_manifest(project.root)
    with pytest.raises(UsageError) as e:
        m.stage("lnog")
    assert "did you mean 'long'" in e.value.hint


BAD = [
    ("stages: {}\n", 1, "non-empty list"),
    ("name: x\n", 1, "missing `stages`"),
    ("variant: sinpki\nstages: [{name: a, config: a.yaml, output_dir: r}]\n", 1, "variant"),
    ("stages:\n  - {name: a, config: a.yaml, output_dir: r}\n  - {name: b, config: b.yaml, output_dir: s, draft_form: a}\n",
     3, "unknown key `draft_form`"),
    ("stages:\n  - {name: a, config: a.yaml, output_dir: r, draft_from: b}\n  - {name: b, config: b.yaml, output_dir: s}\n",
     2, "must name an earlier stage"),
    ("stages:\n  - {name: a, config: a.yaml, output_dir: r}\n  - {name: a, config: b.yaml, output_dir: s}\n",
     3, "used twice"),
    ("stages:\n  - {name: a, config: 3, output_dir: r}\n", 2, "config must be a non-empty string"),
    ("stages:\n  - just-a-string\n", 2, "must be a mapping"),
    ("launch: {gpus: 0}\nstages: [{name: a, config: a.yaml, output_dir: r}]\n", 1, "launch.gpus"),
    ("launch: {gpu: 8}\nstages: [{name: a, config: a.yaml, output_dir: r}]\n", 1, "launch.gpu"),
    ("target: [a, b]\nstages: [{name: a, config: a.yaml, output_dir: r}]\n", 1, "target"),
]


@pytest.mark.parametrize("text,line,needle", BAD, ids=[b[2] for b in BAD])
def test_shape_mistakes_name_file_and_line(tmp_path, text, line, needle):
    (tmp_path / "longspec.yaml").write_text(text)
    with pytest.raises(YamlError) as e:
        load_manifest(tmp_path)
    assert needle in e.value.message
    assert e.value.line == line, e.value.message
    assert f"longspec.yaml:{line}" in e.value.message
    assert e.value.exit_code == 3


def test_unknown_top_level_keys_are_kept_for_validate_not_fatal(tmp_path):
    (tmp_path / "longspec.yaml").write_text("name: x\nversion: 2\nstages: [{name: a, config: a.yaml, output_dir: r}]\n")
    m = load_manifest(tmp_path)
    assert m.unknown_keys == [("version", 2)]
