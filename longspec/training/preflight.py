"""A stage's preflight: everything that reads the user's files, before any model weight loads.

    config_origin()          which experiment file and overrides Hydra composed (config_sha256)
    preflight(conf)          the target is a supported causal LM, the data is prepared, the input
                             draft is safe and fits, the kernels and loggers asked for exist
    wants_offload, cpu_adam_error   whether DeepSpeed's optimizer offload can build its CPU Adam
    training_config_yaml     the resolved config written beside the run

Raises TrainError / DataError / DraftLoadError: the trainer's error boundary words them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec.training import runwriter
from longspec.training.rank import print0, rank, world_size
from longspec.training.entry import TrainError
from longspec.runs import runfolder
from longspec.formats.datafiles import names_data


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
@dataclass
class Origin:
    exp_file: Path | None        # DIR/conf/exp/STAGE.yaml
    overrides: list[str]          # command-line overrides that change the config
    config_sha256: str | None


def config_origin() -> Origin:
    """Which experiment file Hydra composed and with which overrides (for config_sha256)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return Origin(None, [], None)
    hc = HydraConfig.get()
    choice = hc.runtime.choices.get("exp")
    exp_file = None
    if choice:
        for source in hc.runtime.config_sources:
            if source.schema != "file":
                continue
            candidate = Path(source.path) / "exp" / f"{choice}.yaml"
            if candidate.is_file():
                exp_file = candidate.resolve()
                break
    overrides = runfolder.config_overrides(hc.overrides.task)
    sha = runwriter.fingerprint(exp_file, overrides) if exp_file else None
    return Origin(exp_file, overrides, sha)


@dataclass
class Preflight:
    target_config: Any
    tokenizer: Any
    dataset: Any                  # data.cache.PreparedDataset: the memory-mapped prepared cache
    draft_state: Any | None       # state dict from draft_model_name_or_path, checked
    draft_sha256: str | None


def preflight(conf: dict[str, Any]) -> Preflight:
    """Everything that reads user files but no model weights, before any process group exists:
    the target is a supported causal LM, the data tokenizes, the draft file is safe and fits.
    Raises TrainError / DataError / DraftLoadError."""
    target = Path(conf["model_name_or_path"])
    if not (target / "config.json").is_file():
        raise TrainError(f"model_name_or_path = {target}: not a Hugging Face model folder (no config.json)")
    tcfg = target_config(target)
    check_sequence_parallel(conf, tcfg)
    train_file = Path(conf["train_file"])
    if not names_data(train_file):
        raise TrainError(f"train_file = {train_file}: file not found")
    for name in ("wandb", "tensorboard"):
        if conf["logging"][name]:
            require_logger(name)
    check_kernels(conf)

    draft_state, draft_sha = None, None
    if conf["draft_model_name_or_path"] is not None:
        draft_state, draft_sha = load_draft(Path(conf["draft_model_name_or_path"]), tcfg, conf)

    from longspec.data.encoding import load_tokenizer     # torch: imported once the stop-signal watcher runs

    tokenizer = load_tokenizer(conf["model_name_or_path"])     # DataError: no usable tokenizer
    dataset = prepared_dataset(conf, train_file, tokenizer)
    if getattr(dataset, "skipped", 0):
        print0(f"[{conf['stage']}] skipped {dataset.skipped} bad records of {train_file}; first: "
               f"{(getattr(dataset, 'problems', None) or ['?'])[0]}")
    if getattr(dataset, "untrainable", 0):
        print0(f"[{conf['stage']}] skipped {dataset.untrainable} records with nothing to train within "
               f"max_seq_length; first: {(getattr(dataset, 'untrainable_problems', None) or ['?'])[0]}")
    return Preflight(tcfg, tokenizer, dataset, draft_state, draft_sha)


def check_sequence_parallel(conf: dict[str, Any], tcfg) -> None:
    """sequence_parallel_size against the world and the target's (so the draft's) head counts:
    validate's rule (longspec.project.checks.seqpar), here before any weight loads. The length
    is not checked: the trainer pads a batch to a multiple of SP."""
    sp = int(conf.get("sequence_parallel_size") or 1)
    if sp <= 1:
        return
    from longspec.project.checks.seqpar import sp_problems

    text = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    heads = getattr(text, "num_attention_heads", None)
    problems = sp_problems(sp, world_size(), heads, getattr(text, "num_key_value_heads", None) or heads, None)
    if problems:
        raise TrainError("; ".join(problems))


def prepared_dataset(conf: dict[str, Any], train_file: Path, tokenizer):
    """The memory-mapped prepared cache of train_file; built here (one process per cache, under a
    lock; the others wait) when `longspec run`'s preflight has not built it already."""
    from longspec.data import cache

    try:
        dataset, _, _ = cache.ensure(train_file, conf["model_name_or_path"], conf["data"], tokenizer=tokenizer,
                                       workers=1, progress=rank() == 0,
                                       label=f"[{conf['stage']}] prepare (rank {rank()})")
    except cache.CacheWriteError as e:
        raise TrainError(str(e)) from None
    return dataset


def target_config(target: Path):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from longspec.project.targets import refusal

    try:
        tcfg = AutoConfig.from_pretrained(str(target))
    except (OSError, ValueError, KeyError) as e:
        raise TrainError(f"model_name_or_path = {target}: unreadable model config ({str(e).splitlines()[0]})") from None
    kind = getattr(tcfg, "model_type", None)
    archs = getattr(tcfg, "architectures", None) or []
    causal = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (not archs or any("CausalLM" in a for a in archs))
    if not causal:
        raise TrainError(f"model_name_or_path = {target}: not a causal language model "
                         f"(model_type {kind!r}, architectures {archs})")
    problem = refusal(kind, getattr(tcfg, "hidden_act", "silu"))
    if problem:
        raise TrainError(f"model_name_or_path = {target}: {problem}")
    return tcfg


def load_draft(path: Path, tcfg, conf: dict[str, Any]):
    """Load the input draft safely (weights_only) and check it against a meta-device draft."""
    import torch

    from longspec.model.weights import check_draft_state, load_draft_state
    from longspec.model.glide import DraftConfig, GlideDraft
    from longspec.files.atomic import sha256_file

    state = load_draft_state(path)            # DraftLoadError: missing, corrupt, pickle payload
    with torch.device("meta"):
        shell = GlideDraft(DraftConfig.from_target_config(tcfg, conf["draft"]["sliding_window"]))
    check_draft_state(state, shell)            # DraftLoadError naming keys and shapes
    file = path
    if path.is_dir():
        for name in ("draft_model_weights.pth", "draft_model_weights.safetensors", "model.safetensors"):
            if (path / name).is_file():
                file = path / name
                break
    return state, (sha256_file(file) if file.is_file() else None)


def draft_trainable(tcfg: Any, window: int) -> int | None:
    """The trainable parameters of the draft this target gets, counted on a meta-device draft
    (None if it cannot be built from the config); what the reduce bucket is sized to."""
    import torch

    from longspec.model.glide import DraftConfig, GlideDraft

    try:
        with torch.device("meta"):
            shell = GlideDraft(DraftConfig.from_target_config(tcfg, window))
    except (ValueError, TypeError, AttributeError):
        return None
    return sum(p.numel() for p in shell.parameters() if p.requires_grad)


def check_kernels(conf: dict[str, Any]) -> None:
    """``kernels: fused`` where the fused kernels cannot run is refused before anything loads."""
    if conf["kernels"] != "fused":
        return
    import torch

    from longspec.model import kernels

    if conf["precision"] == "fp32":
        raise TrainError("kernels = fused needs precision bf16 or fp16 (flash-attn has no fp32 "
                         "kernels); set precision=bf16 or kernels=auto")
    kernels.set_mode("fused")
    try:
        kernels.backend("cuda" if torch.cuda.is_available() else "cpu")
    except kernels.KernelUnavailable as e:
        raise TrainError(str(e)) from None


def require_logger(name: str) -> None:
    import importlib.util

    module = {"wandb": "wandb", "tensorboard": "tensorboard"}[name]
    if importlib.util.find_spec(module) is None:
        raise TrainError(f"logging.{name} = true but the `{module}` package is not installed "
                         f"(install it, or set logging.{name}=false)")


def wants_offload(conf: dict) -> bool:
    zero = (conf.get("ds_cfg") or {}).get("zero_optimization") or {}
    device = (zero.get("offload_optimizer") or {}).get("device")
    return device not in (None, "none")


def cpu_adam_error(accel) -> str | None:
    """None when DeepSpeedCPUAdam's op builds/loads here, else why not (one line)."""
    try:
        accel.create_op_builder("CPUAdamBuilder").load(verbose=False)
    except Exception as e:  # a compiler error, a missing toolchain, an unsupported CPU
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return None


def training_config_yaml(conf: dict, ds_conf: dict, origin: Origin) -> str:
    from omegaconf import OmegaConf

    head = (f"# resolved by longspec.train from {origin.exp_file or '(no experiment file)'}\n"
            f"# overrides: {' '.join(origin.overrides) or '(none)'}\n"
            f"# config_sha256: {origin.config_sha256}\n")
    return head + OmegaConf.to_yaml(OmegaConf.create({**conf, "ds_cfg": ds_conf}))


def choose_kernels(conf: dict, accel, on_cpu: bool) -> dict[str, str]:
    """The attention / loss kernels (``kernels`` key: the attention ladder's rung, the target's
    transformers attention, the loss kernel), TF32 on for CUDA's fp32 matmuls (the loss runs in
    fp32); what was chosen goes into the log and the start event. TrainError when `kernels: fused`
    cannot run here."""
    import torch

    from longspec.model import kernels

    kernels.set_mode(conf["kernels"])
    device = "cpu" if on_cpu else accel.device_name()
    on_cuda = device.startswith("cuda")
    try:
        dtype = getattr(torch, DTYPES[conf["precision"]])
        chosen = kernels.backend(device if on_cuda else "cpu", dtype)
        chosen["target_attention"] = kernels.target_attn_implementation(dtype)
    except kernels.KernelUnavailable as e:
        raise TrainError(str(e), hint="`longspec doctor` shows which kernels this machine has") from None
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    return {**chosen, "tf32": "on" if on_cuda else "off"}
