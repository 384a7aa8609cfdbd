"""References that find a file by name or path, not by import: each must follow its file.

(The prepared cache's collator version: tests/trainer/test_prepare.py; an installed wheel's
templates, trainer conf and PYTHONPATH root: tests/cli/test_init.py.)
"""

from __future__ import annotations

from pathlib import Path

from longspec.project import composecache, hydracompose

ROOT = Path(__file__).resolve().parents[1]


def test_the_compose_cache_hashes_files_that_exist_and_sees_a_change(tmp_path, monkeypatch):
    here = Path(composecache.__file__).parents[1]     # longspec/: _CODE's paths are relative to it
    missing = [n for n in composecache._CODE if not (here / n).is_file()]
    assert not missing, f"composecache._CODE names files that are not in longspec/: {missing}"
    monkeypatch.setattr(composecache, "_SALT", [])
    before = composecache._salt()
    for name in composecache._CODE:               # a change in any hashed file changes the salt
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p, n=name: real(p) + (b"#" if p.as_posix().endswith("/" + n) else b""))
        monkeypatch.setattr(composecache, "_SALT", [])
        assert composecache._salt() != before, name
        monkeypatch.setattr(Path, "read_bytes", real)


def test_hydra_main_reads_the_conf_the_cli_composes_with():
    from longspec.training.entry import HYDRA_MAIN

    conf = Path(HYDRA_MAIN["config_path"])
    assert conf == hydracompose.trainer_conf_dir() == ROOT / "longspec" / "conf"
    assert (conf / "config.yaml").is_file()
