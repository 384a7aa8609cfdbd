"""Draft weights on disk: atomic save (.pth + .safetensors twin), safe load, key/shape checks.

Loading never unpickles arbitrary objects: .pth/.bin go through torch.load(weights_only=True),
.safetensors through safetensors. Accepted inputs:
- a file: draft_model_weights.pth (what the LongSpec reference and this trainer write), any
  .pth/.pt/.bin state dict, or a .safetensors file;
- a folder: a run/checkpoint folder holding draft_model_weights.{pth,safetensors}, or an HF draft
  folder (config.json + model.safetensors / pytorch_model.bin, sharded index included).
Keys are unprefixed draft keys (`self_attn.q_proj.weight`, ...); a state dict of a whole model
(`draft_model.*` in the reference, `draft.*` here, `glide.*` in the reference's inference code,
optionally under `module.`) is reduced to its draft part.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

WEIGHTS_NAME = "draft_model_weights.pth"
SAFETENSORS_NAME = "draft_model_weights.safetensors"
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WRAPPER_PREFIXES = ("module.",)
DRAFT_PREFIXES = ("draft_model.", "draft.", "glide.")
PICKLE_SUFFIXES = (".pth", ".pt", ".bin")
ST_METADATA = {"format": "pt"}       # what transformers expects in a safetensors header


class DraftLoadError(Exception):
    """A draft checkpoint that cannot be used: missing, corrupt, unsafe or the wrong shape."""


# ----------------------------------------------------------------------------- save

def save_draft(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``path`` (a .pth file, or a folder -> folder/draft_model_weights.pth) and its
    .safetensors twin, each atomically. Tensors go to disk as CPU contiguous copies.
    Returns the .pth path. The twin is written first, so a present .pth means both are complete."""
    path = Path(path)
    pth = path if path.suffix == ".pth" else path / WEIGHTS_NAME
    pth.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_draft: {key!r} is a {type(value).__name__}, not a tensor")
        tensors[key] = value.detach().to("cpu").contiguous().clone()   # clone: no shared storage

    from safetensors.torch import save_file

    _atomic_write(pth.with_suffix(".safetensors"), lambda tmp: save_file(tensors, str(tmp), metadata=ST_METADATA))
    _atomic_write(pth, lambda tmp: torch.save(tensors, tmp))
    return pth


def save_hf_draft(state_dict: Mapping[str, torch.Tensor], target_config: Any, folder: str | Path) -> Path:
    """An HF-style draft folder (the target's config.json + model.safetensors), the form the
    reference's inference code opens with ``<Family>GlideDecoderLayer.from_pretrained(folder)``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    config = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    _atomic_write(folder / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata=ST_METADATA))
    _atomic_write(folder / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2, default=str)))
    return folder


def gather_draft_state(draft_module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """The draft's full state dict as CPU tensors, on every rank, also under ZeRO-3 (gathers the
    draft's parameters only, never the target's)."""
    params = [p for p in draft_module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in draft_module.state_dict().items())
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in draft_module.state_dict().items())


def _atomic_write(dest: Path, write: Callable[[Path], None]) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        dir_fd = os.open(dest.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ----------------------------------------------------------------------------- load

def load_draft_state(path: str | Path) -> "OrderedDict[str, torch.Tensor]":
    """Draft state dict (CPU tensors, unprefixed keys) from a file or folder; DraftLoadError if unusable."""
    path = Path(path)
    if not path.exists():
        raise DraftLoadError(f"draft weights not found: {path}")
    files = _weight_files_in(path) if path.is_dir() else [path]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_as_tensor_dict(_read_file(file), file))
    return strip_prefixes(state)


def _weight_files_in(folder: Path) -> list[Path]:
    for name in (WEIGHTS_NAME, SAFETENSORS_NAME, *HF_WEIGHT_FILES):
        if (folder / name).is_file():
            return [folder / name]
    for index_name in HF_INDEX_FILES:
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise DraftLoadError(f"{index}: not a valid weight index ({e})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise DraftLoadError(f"{index} lists shards that are missing: {', '.join(missing[:5])}")
            return [folder / s for s in shards]
    looked = ", ".join((WEIGHTS_NAME, SAFETENSORS_NAME, *HF_WEIGHT_FILES, *HF_INDEX_FILES))
    raise DraftLoadError(f"no draft weights in folder {folder} (looked for {looked})")


def _read_file(file: Path) -> Any:
    suffix = file.suffix.lower()
    if suffix == ".safetensors":
        return _read_safetensors(file)
    if suffix in PICKLE_SUFFIXES:
        return _read_pickle(file)
    raise DraftLoadError(f"{file}: unknown weights format {suffix or '(no extension)'!r}; use .pth, .bin or .safetensors")


def _read_safetensors(file: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as e:   # SafetensorError (header/size), OSError
        raise DraftLoadError(f"{file}: corrupt or truncated safetensors file ({_short(e)})") from None


def _read_pickle(file: Path) -> Any:
    if file.stat().st_size == 0:
        raise DraftLoadError(f"{file}: empty file")
    try:
        with warnings.catch_warnings():   # "Detected pickle protocol N": the error below says enough
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise DraftLoadError(
                f"{file}: refused, it references the Python object {found.group(1)!r}, not just tensors "
                "(possibly malicious); nothing from it was executed"
            ) from None
        raise DraftLoadError(
            f"{file}: corrupt or truncated checkpoint, or not a torch state dict; nothing from it was executed"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError) as e:
        raise DraftLoadError(f"{file}: corrupt or truncated checkpoint ({_short(e)})") from None


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


def _as_tensor_dict(obj: Any, source: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, Mapping):
        for wrapper in ("state_dict", "module", "model"):   # common {"state_dict": {...}} wrappers
            if set(obj) == {wrapper} and isinstance(obj[wrapper], Mapping):
                obj = obj[wrapper]
    if not isinstance(obj, Mapping):
        raise DraftLoadError(f"{source}: not a state dict (found a {type(obj).__name__})")
    if not obj:
        raise DraftLoadError(f"{source}: the state dict is empty")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise DraftLoadError(f"{source}: not a dict of tensors ({key!r} holds a {type(value).__name__})")
    return dict(obj)


def strip_prefixes(state: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """Unprefixed draft keys from a draft or whole-model state dict (see module docstring)."""
    state = OrderedDict(state)
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = OrderedDict((k[len(prefix):], v) for k, v in state.items())
    for prefix in DRAFT_PREFIXES:
        part = OrderedDict((k[len(prefix):], v) for k, v in state.items() if k.startswith(prefix))
        if part:
            return part
    return state


# ----------------------------------------------------------------------------- check + load into a module

def _expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    shapes = {}
    keys = set(module.state_dict().keys())
    for name, p in module.named_parameters():
        shapes[name] = tuple(getattr(p, "ds_shape", p.shape))      # ZeRO-3: the full, unpartitioned shape
    for name, b in module.named_buffers():
        shapes[name] = tuple(b.shape)
    return {k: shapes[k] for k in keys if k in shapes}


def check_draft_state(state: Mapping[str, torch.Tensor], draft_module: nn.Module) -> None:
    """Raise DraftLoadError naming missing keys, unexpected keys and shape mismatches."""
    expected = _expected_shapes(draft_module)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs draft {expected[k]}"
        for k in sorted(set(state) & set(expected))
        if tuple(state[k].shape) != expected[k]
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)):
        if items:
            more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:5])}{more}")
    hint = ""
    if mismatched:
        hint = " -- was this draft trained for a different target?"
    elif missing and all(k.endswith("_proj.bias") for k in missing):
        hint = " -- the file has no attention biases; the reference layout has q/k/v biases"
    raise DraftLoadError("draft weights do not fit the draft model: " + "; ".join(parts) + hint)


def load_draft_weights(draft_module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """check_draft_state, then copy into the module (gathering ZeRO-3 partitioned parameters)."""
    check_draft_state(state, draft_module)
    params = [p for p in draft_module.parameters() if hasattr(p, "ds_id")]
    if params:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            draft_module.load_state_dict(state, strict=True)
    else:
        draft_module.load_state_dict(state, strict=True)
