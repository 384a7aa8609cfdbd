"""Target families longspec can train a GLIDE draft for, and what a target folder says about itself.

Pure (JSON only, no torch or transformers): `init --target`, `validate` and the trainer read the
supported families and the refusal sentence from here; `longspec.model.families` holds, per family,
how the draft gets at the target's parts.

    info = read_target(Path("/models/Qwen3-8B"))   # config.json + tokenizer files
    info.family, info.position_limit, info.precision, info.chat_template
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longspec.errors import InputError, RefusedError

# model_type values of the targets a draft can be built for (longspec.model.families has one entry each).
SUPPORTED_FAMILIES = ("qwen2", "llama", "qwen3", "mistral")
# The draft's MLP is SwiGLU: the target's MLP activation must be SiLU.
SUPPORTED_ACTIVATIONS = ("silu",)
DTYPE_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def supported_sentence() -> str:
    return (f"GLIDE drafts support {', '.join(SUPPORTED_FAMILIES[:-1])} and {SUPPORTED_FAMILIES[-1]} "
            f"targets with a {' or '.join(SUPPORTED_ACTIVATIONS)} MLP activation")


def refusal(family: Any, activation: Any) -> str | None:
    """The one sentence refusing a target of this family / activation, or None when supported."""
    if family is None:
        return f"a target without a model_type is not supported: {supported_sentence()}."
    if family not in SUPPORTED_FAMILIES:
        return f"a target of family {family!r} is not supported: {supported_sentence()}."
    if (activation or "silu") not in SUPPORTED_ACTIVATIONS:
        return f"a target with MLP activation {activation!r} is not supported: {supported_sentence()}."
    return None


def config_refusal(config: dict) -> str | None:
    """refusal() for a parsed config.json (`model_type`, `hidden_act`)."""
    return refusal(config.get("model_type"), config.get("hidden_act"))


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    family: str
    position_limit: int | None          # max_position_embeddings
    precision: str | None               # from torch_dtype / dtype; None when absent
    chat_template: str | None           # where the tokenizer's chat template lives, or None
    eos_token_id: Any = None
    size: dict[str, int] = field(default_factory=dict)


def read_config(path: Path) -> dict:
    """config.json of a target folder as a dict; InputError when missing or malformed."""
    cfg_file = path / "config.json"
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"target {path} has no config.json", hint="point at a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{cfg_file} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{cfg_file} is not a JSON object")
    return data


def precision_of(config: dict) -> str | None:
    """bf16 / fp16 / fp32 from `torch_dtype` (transformers 4) or `dtype` (transformers 5)."""
    dtype = config.get("torch_dtype") or config.get("dtype")
    return DTYPE_PRECISION.get(str(dtype).replace("torch.", "")) if dtype else None


def chat_template_of(path: Path) -> str | None:
    """The file that holds the tokenizer's chat template, or None (chats then render as plain text)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return name
    tok = path / "tokenizer_config.json"
    try:
        data = json.loads(tok.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return tok.name if isinstance(data, dict) and data.get("chat_template") else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def read_target(path: Path) -> TargetInfo:
    """What init and validate need of a local target folder. RefusedError (one sentence) for an
    unsupported family or activation; InputError for an unreadable config.json."""
    config = read_config(path)
    problem = config_refusal(config)
    if problem:
        raise RefusedError(problem)
    size = {k: _int(config.get(src)) for k, src in (
        ("hidden", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads"),
        ("kv_heads", "num_key_value_heads"), ("intermediate", "intermediate_size"), ("vocab", "vocab_size"))}
    size["kv_heads"] = size["kv_heads"] or size["heads"]
    return TargetInfo(
        path=path, family=config["model_type"], position_limit=_int(config.get("max_position_embeddings")),
        precision=precision_of(config), chat_template=chat_template_of(path),
        eos_token_id=config.get("eos_token_id"), size={k: v for k, v in size.items() if v},
    )
