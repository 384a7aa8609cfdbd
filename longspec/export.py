"""Export a stage's draft for use outside longspec.

    python -m longspec.export RUN_DIR --format hf|safetensors|vllm [--out PATH] [--force] [--json]

hf           a folder in the layout of the released LongSpec drafts (sail/longspec-*): the
             reference inference code loads them with `<Family>GlideDecoderLayer.from_pretrained`,
             a PreTrainedModel whose config class is the target family's (Qwen2Config /
             LlamaConfig / ...) and whose state dict is the bare decoder block. So:
               config.json        model_type of the target family, architectures
                                  ["<Family>GlideDecoderLayer"] (longspec.model.families), the
                                  draft's sizes, rope, sliding window, the target's name/path
               model.safetensors  unprefixed keys: self_attn.*, cross_attn.*, mlp.*,
                                  input_layernorm / post_self_attention_layernorm /
                                  post_cross_attention_layernorm .weight
safetensors  one .safetensors file with the same keys; the draft config rides in its metadata.
vllm         the hf folder as vLLM loads it as a speculative draft with longspec's plugin
             (longspec/serve/; the format: longspec/formats/vllmdraft.py): architecture
             LongSpecGlideForCausalLM, the family's sliding-window key cleared, the target's layer
             count recorded (its last layer's KV cache is what the cross-attention reads).

All are written atomically (a temp folder or file next to the destination, then a rename) and
read back with longspec.model.weights.load_draft_state, which must give tensors equal to the
source (torch.equal) before the export is reported. Exit codes: 0 ok, 1 refused (destination
exists without --force, no finished draft), 2 usage, 3 unreadable input.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from longspec.measure.runread import EvalError, read_run, stage_draft
from longspec.files.atomic import fsync_path

FORMATS = ("hf", "safetensors", "vllm")
FORMAT_VERSION = 1
HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"


# ----------------------------------------------------------------------------- config

def draft_config_json(target_config: Any, draft_cfg, *, target_name: str, dtype: str,
                      stage: str | None = None, source_sha256: str | None = None) -> dict:
    """config.json of an exported draft: a valid config of the target's family describing ONE block."""
    import transformers

    from longspec.model.families import FAMILIES, rope_params

    theta, rope_type = rope_params(target_config)
    rope_parameters = getattr(target_config, "rope_parameters", None)
    cfg = {
        "architectures": [FAMILIES[draft_cfg.family].architecture],
        "model_type": draft_cfg.family,
        "hidden_size": draft_cfg.hidden_size,
        "intermediate_size": draft_cfg.intermediate_size,
        "num_attention_heads": draft_cfg.num_attention_heads,
        "num_key_value_heads": draft_cfg.num_key_value_heads,
        "head_dim": draft_cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": draft_cfg.rms_norm_eps,
        "rope_theta": theta,
        "max_position_embeddings": draft_cfg.max_position_embeddings,
        "vocab_size": getattr(target_config, "vocab_size", None),
        "attention_bias": draft_cfg.attention_bias,
        "sliding_window": draft_cfg.sliding_window,
        "use_sliding_window": False,          # the target family's own SWA switch: off
        "initializer_range": draft_cfg.initializer_range,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": getattr(target_config, "bos_token_id", None),
        "eos_token_id": getattr(target_config, "eos_token_id", None),
        "pad_token_id": getattr(target_config, "pad_token_id", None),
        "target_model_name_or_path": target_name,
        "transformers_version": transformers.__version__,
        "longspec": {
            "format_version": FORMAT_VERSION,
            "kind": "glide_draft",
            "stage": stage,
            "draft_sha256": source_sha256,
            "draft_config": draft_cfg.to_dict(),
            "key_layout": "unprefixed GLIDE decoder block (self_attn, cross_attn, mlp, 3 norms)",
        },
    }
    if isinstance(rope_parameters, dict):
        cfg["rope_parameters"] = dict(rope_parameters)
    elif rope_type != "default":
        cfg["rope_scaling"] = dict(getattr(target_config, "rope_scaling", None) or {})
    return cfg


# ----------------------------------------------------------------------------- atomic writes

def _check_dest(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise EvalError(f"{out} already exists", 1, hint="pass --force to replace it, or --out another path")


def _replace(tmp: Path, out: Path) -> None:
    """Rename tmp over out; an existing out (file or folder) is moved aside first, then removed."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    fsync_path(out.parent)


def write_hf(state: Mapping[str, Any], config: dict, out: Path, force: bool = False) -> Path:
    """The HF draft folder, built in a temp folder beside ``out`` and renamed into place."""
    from safetensors.torch import save_file

    _check_dest(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name in (HF_WEIGHTS, HF_CONFIG):
            fsync_path(tmp / name)
        os.chmod(tmp, 0o755)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_safetensors(state: Mapping[str, Any], config: dict, out: Path, force: bool = False) -> Path:
    """One .safetensors file (metadata: format=pt, longspec_config=<config.json text>)."""
    from safetensors.torch import save_file

    if out.suffix.lower() != ".safetensors":
        raise EvalError(f"--out {out}: a safetensors export must end in .safetensors", 2)
    if out.is_dir():
        raise EvalError(f"{out} is a folder", 1, hint="give a file path ending in .safetensors")
    _check_dest(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp), metadata={"format": "pt", "longspec_config": json.dumps(config, sort_keys=True)})
        fsync_path(tmp)
        os.chmod(tmp, 0o644)
        _replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


# ----------------------------------------------------------------------------- export

def verify_round_trip(state: Mapping[str, Any], path: Path) -> None:
    """load_draft_state(path) must give exactly ``state`` (same keys, dtypes, shapes, values)."""
    import torch

    from longspec.model.weights import load_draft_state

    back = load_draft_state(path)
    if set(back) != set(state):
        raise RuntimeError(f"export check: keys differ after reading {path} back")
    for k, v in state.items():
        if back[k].dtype != v.dtype or not torch.equal(back[k], v.cpu()):
            raise RuntimeError(f"export check: tensor {k} differs after reading {path} back")


def export_draft(weights: Path, target: Path, fmt: str, out: Path, *, sliding_window: int,
                 stage: str | None = None, force: bool = False) -> dict:
    """Read the draft, check it fits the target's draft shape, write ``fmt`` to ``out``, verify."""
    import torch
    from transformers import AutoConfig

    from longspec.model.weights import DraftLoadError, check_draft_state, load_draft_state
    from longspec.model.glide import DraftConfig, GlideDraft
    from longspec.files.atomic import sha256_file

    if fmt not in FORMATS:
        raise EvalError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}", 2)
    if not (target / "config.json").is_file():
        raise EvalError(f"target model folder {target} has no config.json", 3,
                        hint="the export describes the draft from the target's config; pass --target PATH")
    try:
        tcfg = AutoConfig.from_pretrained(str(target))
        dcfg = DraftConfig.from_target_config(tcfg, sliding_window)
    except ValueError as e:
        raise EvalError(f"{target}: {e}", 3) from None
    try:
        state = load_draft_state(weights)
        with torch.device("meta"):                           # shapes only: no memory for a 32B draft
            check_draft_state(state, GlideDraft(dcfg))
    except DraftLoadError as e:
        raise EvalError(str(e), 3) from None
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    sha = sha256_file(weights) if weights.is_file() else None
    config = draft_config_json(tcfg, dcfg, target_name=str(target), dtype=dtypes[0] if len(dtypes) == 1 else "mixed",
                               stage=stage, source_sha256=sha)
    if fmt == "vllm":
        from longspec.formats.vllmdraft import vllm_config

        config = vllm_config(config, tcfg.num_hidden_layers)
    write = write_safetensors if fmt == "safetensors" else write_hf
    write(state, config, out, force=force)
    verify_round_trip(state, out)
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
    return {"stage": stage, "format": fmt, "out": str(out), "files": files, "tensors": len(state),
            "parameters": int(sum(v.numel() for v in state.values())), "dtype": config["torch_dtype"],
            "architecture": config["architectures"][0], "source": str(weights), "source_sha256": sha,
            "verified": True}


def default_out(run_dir: Path, stage: str, fmt: str) -> Path:
    return run_dir / "export" / (f"{stage}.safetensors" if fmt == "safetensors" else f"{stage}-{fmt}")


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longspec.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the stage's output_dir")
    p.add_argument("--format", dest="fmt", required=True, choices=FORMATS)
    p.add_argument("--out", type=Path, help="destination (default RUN_DIR/export/<stage>-hf or <stage>.safetensors)")
    p.add_argument("--stage", help="stage name (default: from the run folder)")
    p.add_argument("--target", type=Path, help="target model folder (default: model_name_or_path)")
    p.add_argument("--draft", type=Path, help="draft weights (default: the stage's final weights)")
    p.add_argument("--sliding-window", type=int)
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    conf, complete = read_run(args.run_dir)
    stage, weights, target, window = stage_draft(args.run_dir, conf, complete, args)
    out = (args.out or default_out(args.run_dir, stage, args.fmt)).expanduser().absolute()
    return export_draft(weights, target, args.fmt, out, sliding_window=window, stage=stage, force=args.force)


def main(argv: list[str] | None = None) -> int:
    as_json = "--json" in (argv if argv is not None else sys.argv[1:])
    try:
        args = parse_args(argv)
        result = run(args)
    except EvalError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        if as_json:
            print(json.dumps({"error": e.message, "hint": e.hint, "exit_code": e.code}))
        return e.code
    if args.json:
        print(json.dumps(result))
    else:
        print(f"exported {result['stage']} ({result['format']}, {result['tensors']} tensors, "
              f"{result['parameters']:,} parameters) to {result['out']}; read back identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
