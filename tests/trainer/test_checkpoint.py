"""Draft checkpoints: atomic save, safe load (pth / safetensors / HF folder), clear errors."""
from __future__ import annotations

import json
import pickle
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file

from longspec.model.weights import (
    SAFETENSORS_NAME,
    WEIGHTS_NAME,
    DraftLoadError,
    check_draft_state,
    gather_draft_state,
    load_draft_state,
    load_draft_weights,
    save_draft,
    save_hf_draft,
)
from longspec.model.glide import DraftConfig, GlideDraft
from tests.trainer.conftest import make_tiny_target
from tests.trainer.test_model import REFERENCE_KEYS


@pytest.fixture(scope="module")
def draft_cfg():
    return DraftConfig.from_target_config(make_tiny_target("qwen2").config)


def fresh_draft(cfg, seed):
    torch.manual_seed(seed)
    return GlideDraft(cfg)


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


class WritesMarker:
    """A pickle payload that, if ever unpickled, runs code that writes ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('owned')",))


# ----------------------------------------------------------------------------- round trips

def test_save_writes_pth_and_safetensors_twin_that_round_trip(tmp_path, draft_cfg):
    state = fresh_draft(draft_cfg, 0).state_dict()
    pth = save_draft(state, tmp_path / "run")
    assert pth == tmp_path / "run" / WEIGHTS_NAME
    assert (tmp_path / "run" / SAFETENSORS_NAME).is_file()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted([WEIGHTS_NAME, SAFETENSORS_NAME])  # no temp files
    assert_same_state(load_draft_state(pth), state)
    assert_same_state(load_draft_state(tmp_path / "run" / SAFETENSORS_NAME), state)
    assert_same_state(load_draft_state(tmp_path / "run"), state)            # a run folder


def test_saved_pth_is_a_plain_state_dict_the_reference_can_load(tmp_path, draft_cfg):
    """The reference does torch.load(path) then load_state_dict on its draft layer: keys must match."""
    pth = save_draft(fresh_draft(draft_cfg, 0).state_dict(), tmp_path / "w.pth")
    raw = torch.load(pth, weights_only=True)
    assert sorted(raw) == REFERENCE_KEYS
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in raw.values())


def test_save_overwrites_and_bf16_survives(tmp_path, draft_cfg):
    save_draft(fresh_draft(draft_cfg, 0).state_dict(), tmp_path)
    newer = fresh_draft(draft_cfg, 1).to(torch.bfloat16).state_dict()
    save_draft(newer, tmp_path)
    loaded = load_draft_state(tmp_path)
    assert_same_state(loaded, newer)
    assert loaded["mlp.up_proj.weight"].dtype == torch.bfloat16


def test_loads_reference_and_whole_model_prefixes(tmp_path, draft_cfg):
    state = fresh_draft(draft_cfg, 0).state_dict()
    whole = OrderedDict({"model.embed_tokens.weight": torch.zeros(3, 4)})
    whole.update((f"draft_model.{k}", v) for k, v in state.items())       # the reference's full model
    torch.save(whole, tmp_path / "whole.pth")
    assert_same_state(load_draft_state(tmp_path / "whole.pth"), state)
    wrapped = OrderedDict((f"module.draft.{k}", v) for k, v in state.items())  # a DeepSpeed-wrapped GlideModel
    torch.save(wrapped, tmp_path / "wrapped.pth")
    assert_same_state(load_draft_state(tmp_path / "wrapped.pth"), state)
    torch.save({"state_dict": dict(state)}, tmp_path / "nested.pt")
    assert_same_state(load_draft_state(tmp_path / "nested.pt"), state)


def test_loads_an_hf_draft_folder(tmp_path, draft_cfg):
    state = fresh_draft(draft_cfg, 0).state_dict()
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    assert_same_state(load_draft_state(folder), state)


def test_loads_a_sharded_hf_folder(tmp_path, draft_cfg):
    state = fresh_draft(draft_cfg, 0).state_dict()
    folder = tmp_path / "hf"
    folder.mkdir()
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    for name, ks in shards.items():
        save_file({k: state[k].contiguous() for k in ks}, str(folder / name))
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_draft_state(folder)
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], state[k]) for k in state)


def test_save_hf_draft_folder_round_trips(tmp_path, draft_cfg):
    target = make_tiny_target("llama")
    state = fresh_draft(DraftConfig.from_target_config(target.config), 0).state_dict()
    folder = save_hf_draft(state, target.config, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert_same_state(load_draft_state(folder), state)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_gather_draft_state_is_a_cpu_copy(draft_cfg):
    draft = fresh_draft(draft_cfg, 0)
    state = gather_draft_state(draft)
    assert_same_state(state, draft.state_dict())
    state["mlp.up_proj.weight"].zero_()
    assert draft.mlp.up_proj.weight.abs().sum() > 0           # a copy, not a view


def test_load_draft_weights_into_a_module(tmp_path, draft_cfg):
    src = fresh_draft(draft_cfg, 0)
    save_draft(src.state_dict(), tmp_path)
    dst = fresh_draft(draft_cfg, 1)
    load_draft_weights(dst, load_draft_state(tmp_path))
    assert_same_state(dst.state_dict(), src.state_dict())
    assert dst.cross_attn.k_proj.weight.requires_grad is False   # loading keeps the frozen layout


# ----------------------------------------------------------------------------- errors

def test_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(DraftLoadError, match="not found"):
        load_draft_state(tmp_path / "nope.pth")
    with pytest.raises(DraftLoadError, match="no draft weights in folder"):
        load_draft_state(tmp_path)
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(DraftLoadError, match="unknown weights format"):
        load_draft_state(tmp_path / "weights.txt")


@pytest.mark.parametrize("name", [WEIGHTS_NAME, SAFETENSORS_NAME])
def test_truncated_file_is_a_clear_error(tmp_path, draft_cfg, name):
    save_draft(fresh_draft(draft_cfg, 0).state_dict(), tmp_path)
    path = tmp_path / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftLoadError, match="corrupt or truncated"):
        load_draft_state(path)
    path.write_bytes(b"")
    with pytest.raises(DraftLoadError):
        load_draft_state(path)


def test_garbage_bytes_are_a_clear_error(tmp_path):
    (tmp_path / "junk.pth").write_bytes(b"\x00\x01not a checkpoint" * 10)
    with pytest.raises(DraftLoadError, match="corrupt or truncated"):
        load_draft_state(tmp_path / "junk.pth")


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, writer):
    """torch.save zip or a bare protocol-2 pickle: refused by name, the payload never runs."""
    marker = tmp_path / "marker"
    payload = {"self_attn.q_proj.weight": torch.zeros(2), "evil": WritesMarker(marker)}
    path = tmp_path / "draft_model_weights.pth"
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:       # a bare pickle: no tensors, just the payload
            pickle.dump({"evil": WritesMarker(marker)}, f, protocol=2)
    with pytest.raises(DraftLoadError, match="refused, it references the Python object 'exec'"):
        load_draft_state(path)
    assert not marker.exists()
    # the payload is live: an unsafe load would have run it
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as f:
            pickle.load(f)
    assert marker.read_text() == "owned"


def test_newer_protocol_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "marker"
    with open(tmp_path / "p.pth", "wb") as f:
        pickle.dump({"x": WritesMarker(marker)}, f, protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(DraftLoadError, match="nothing from it was executed"):
        load_draft_state(tmp_path / "p.pth")
    assert not marker.exists()


def test_not_a_dict_of_tensors(tmp_path):
    torch.save({"self_attn.q_proj.weight": torch.zeros(2), "step": 3}, tmp_path / "a.pth")
    with pytest.raises(DraftLoadError, match="not a dict of tensors"):
        load_draft_state(tmp_path / "a.pth")
    torch.save([torch.zeros(2)], tmp_path / "b.pth")
    with pytest.raises(DraftLoadError, match="not a state dict"):
        load_draft_state(tmp_path / "b.pth")
    torch.save({}, tmp_path / "c.pth")
    with pytest.raises(DraftLoadError, match="empty"):
        load_draft_state(tmp_path / "c.pth")


def test_check_names_missing_unexpected_and_mismatched(draft_cfg):
    draft = fresh_draft(draft_cfg, 0)
    state = dict(draft.state_dict())
    check_draft_state(state, draft)                      # a matching state passes
    del state["mlp.down_proj.weight"]
    state["lm_head.weight"] = torch.zeros(1)
    state["self_attn.q_proj.weight"] = torch.zeros(8, 8)
    with pytest.raises(DraftLoadError) as err:
        check_draft_state(state, draft)
    msg = str(err.value)
    assert "1 missing keys: mlp.down_proj.weight" in msg
    assert "1 unexpected keys: lm_head.weight" in msg
    assert "self_attn.q_proj.weight: file (8, 8) vs draft (64, 64)" in msg


def test_check_hints_at_missing_biases(draft_cfg):
    draft = fresh_draft(draft_cfg, 0)
    state = {k: v for k, v in draft.state_dict().items() if not k.endswith("bias")}
    with pytest.raises(DraftLoadError, match="no attention biases"):
        check_draft_state(state, draft)


def test_draft_for_another_target_is_refused(tmp_path, draft_cfg):
    small = DraftConfig.from_target_config(make_tiny_target("llama", hidden_size=32, intermediate_size=64).config)
    save_draft(GlideDraft(small).state_dict(), tmp_path)
    with pytest.raises(DraftLoadError, match="different target"):
        load_draft_weights(fresh_draft(draft_cfg, 0), load_draft_state(tmp_path))
