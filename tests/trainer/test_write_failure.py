"""The writers the trainer uses (torch.save, safetensors, plain files) fail on a full disk in their
own ways; each is recognised as a failed write and worded with the path and the free space."""
from __future__ import annotations


import pytest
import torch

from longspec.model.weights import save_draft
from longspec.runs import diskspace
from tests.needs import small_disk


@pytest.fixture
def full_disk(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        yield disk


def _write_plain(path):
    path.write_bytes(b"x" * 200_000)


def _write_torch(path):
    torch.save({"w": torch.zeros(100_000)}, path)


def _write_safetensors(path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(100_000)}, str(path))


@pytest.mark.parametrize("write", [_write_plain, _write_torch, _write_safetensors])
def test_each_writer_on_a_full_disk_is_a_write_failure(full_disk, write):
    with pytest.raises(Exception) as info:
        write(full_disk / "f")
    assert diskspace.is_write_failure(info.value), repr(info.value)
    text = diskspace.write_failure(full_disk / "f", full_disk, info.value)
    assert text.startswith(f"could not write {full_disk / 'f'}: no space left on the device (")
    assert f"free on {full_disk})" in text and "no complete checkpoint yet" in text


def test_save_draft_on_a_full_disk_leaves_no_file_that_looks_complete(full_disk):
    with pytest.raises(Exception) as info:
        save_draft({"w": torch.zeros(100_000)}, full_disk / "run")
    assert diskspace.is_write_failure(info.value)
    assert list((full_disk / "run").iterdir()) == []  # neither the .pth nor its twin, no temp file


def test_other_errors_are_not_write_failures():
    assert not diskspace.is_write_failure(RuntimeError("CUDA out of memory"))
    assert not diskspace.is_write_failure(FileNotFoundError(2, "No such file or directory", "x"))
