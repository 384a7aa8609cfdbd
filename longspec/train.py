"""Train one LongSpec stage: a GLIDE draft on a frozen target, with DeepSpeed.

    python -m longspec.train --config-dir DIR/conf +exp=STAGE output_dir=RUN [key=value ...]
    deepspeed --num_gpus N --module longspec.train --config-dir DIR/conf +exp=STAGE output_dir=RUN
    deepspeed --num_gpus N /path/to/longspec/train.py --config-dir DIR/conf +exp=STAGE ...

Hydra composes longspec/conf/config.yaml (every key and its default), then DIR/conf/exp/STAGE.yaml
(`# @package _global_`, defaults [/deepspeed@ds_cfg: NAME, _self_]), then the overrides. Run from a
project folder, `--config-dir` may be left out (`--config-dir conf` is implied). The launcher's
`--local_rank=N` is taken off the command line before Hydra sees it (LOCAL_RANK is set instead);
a plain `python -m longspec.train` runs as a single rank.

Without a GPU, DS_ACCELERATOR=cpu runs DeepSpeed on the CPU (gloo), one or several ranks (deepspeed
0.19.8: `deepspeed --num_gpus N --module longspec.train ...` starts N CPU ranks). On CPU, precision
is fp32 or bf16 (DeepSpeed's CPU accelerator has no fp16 training); optimizer offload uses
DeepSpeedCPUAdam (built on first use, ~1 min), or torch AdamW when that op cannot be built.

Steps: check the config (before anything loads) -> skip if the stage is already complete ->
preflight (target, data, draft) -> DeepSpeed engine -> resume from the newest complete checkpoint
-> train -> checkpoint-<step>/ every save_steps and at the end -> draft_model_weights.pth ->
stage_complete.json (last). Every rank tears the process group down and exits 0 on success;
a user mistake prints one `error:` block on stderr and exits 1, and so does a write that fails for
want of space (the block names the path, the free space left and the checkpoint a rerun resumes
from; a half-written checkpoint is removed, never marked complete). SIGTERM or SIGUSR1 (a scheduler's
preemption notice, `longspec stop`) finishes the current optimizer step, saves a checkpoint on every
rank, writes a `preempted` event and exits 5; a second signal exits at once (longspec/preempt.py).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longspec import dsconfig, outputs, simtau
from longspec.entry import (EXIT_ERROR, TrainError, implied_config_dir, make_hydra_entry, read_config,
                            report_error, user_errors)
from longspec.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED, WATCH
from longspec.resume import decide_resume, math_config
from longspec_cli.core import runfolder

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_progress = {"step": 0, "writing": None}   # the last finished step, the path being written


# ----------------------------------------------------------------------------- small helpers

def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args: Any) -> None:
    if rank() == 0:
        print(*args, flush=True)


def take_local_rank(argv: list[str]) -> list[str]:
    """Remove DeepSpeed's `--local_rank=N` / `--local_rank N` (Hydra would reject it); set LOCAL_RANK."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg == "--local_rank" and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def single_process_env() -> None:
    """`python -m longspec.train` without a launcher: a world of one on a free local port."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def seeded(*parts: int):
    """A torch.Generator seeded from (seed, step, ...): the same numbers after a resume."""
    import torch

    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


# ----------------------------------------------------------------------------- config

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
    sha = outputs.fingerprint(exp_file, overrides) if exp_file else None
    return Origin(exp_file, overrides, sha)


# ----------------------------------------------------------------------------- preflight

@dataclass
class Preflight:
    target_config: Any
    tokenizer: Any
    dataset: Any                  # prepare.PreparedDataset: the memory-mapped prepared cache
    draft_state: Any | None       # state dict from draft_model_name_or_path, checked
    draft_sha256: str | None


def preflight(conf: dict[str, Any]) -> Preflight:
    """Everything that reads user files but no model weights, before any process group exists:
    the target is a supported causal LM, the data tokenizes, the draft file is safe and fits.
    Raises TrainError / DataError / DraftLoadError."""
    target = Path(conf["model_name_or_path"])
    if not (target / "config.json").is_file():
        raise TrainError(f"model_name_or_path = {target}: not a Hugging Face model folder (no config.json)")
    tcfg = _target_config(target)
    train_file = Path(conf["train_file"])
    if not train_file.is_file():
        raise TrainError(f"train_file = {train_file}: file not found")
    for name in ("wandb", "tensorboard"):
        if conf["logging"][name]:
            _require_logger(name)
    _check_kernels(conf)

    draft_state, draft_sha = None, None
    if conf["draft_model_name_or_path"] is not None:
        draft_state, draft_sha = _load_draft(Path(conf["draft_model_name_or_path"]), tcfg, conf)

    tokenizer = _tokenizer(conf["model_name_or_path"])
    dataset = prepared_dataset(conf, train_file, tokenizer)
    if getattr(dataset, "skipped", 0):
        print0(f"[{conf['stage']}] skipped {dataset.skipped} bad records of {train_file}; first: "
               f"{(getattr(dataset, 'problems', None) or ['?'])[0]}")
    return Preflight(tcfg, tokenizer, dataset, draft_state, draft_sha)


def prepared_dataset(conf: dict[str, Any], train_file: Path, tokenizer):
    """The memory-mapped prepared cache of train_file; built here (one process per cache, under a
    lock; the others wait) when `longspec run`'s preflight has not built it already."""
    from longspec import prepare

    try:
        dataset, _, _ = prepare.ensure(train_file, conf["model_name_or_path"], conf["data"], tokenizer=tokenizer,
                                       workers=1, progress=rank() == 0,
                                       label=f"[{conf['stage']}] prepare (rank {rank()})")
    except prepare.CacheWriteError as e:
        raise TrainError(str(e)) from None
    return dataset


def _target_config(target: Path):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from longspec_cli.core.targets import refusal

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


def _load_draft(path: Path, tcfg, conf: dict[str, Any]):
    """Load the input draft safely (weights_only) and check it against a meta-device draft."""
    import torch

    from longspec.checkpoint import check_draft_state, load_draft_state
    from longspec.model import DraftConfig, GlideDraft
    from longspec_cli.core.atomic import sha256_file

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


def _check_kernels(conf: dict[str, Any]) -> None:
    """``kernels: fused`` where the fused kernels cannot run is refused before anything loads."""
    if conf["kernels"] != "fused":
        return
    import torch

    from longspec import kernels

    if conf["precision"] == "fp32":
        raise TrainError("kernels = fused needs precision bf16 or fp16 (flash-attn has no fp32 "
                         "kernels); set precision=bf16 or kernels=auto")
    kernels.set_mode("fused")
    try:
        kernels.backend("cuda" if torch.cuda.is_available() else "cpu")
    except kernels.KernelUnavailable as e:
        raise TrainError(str(e)) from None


def _require_logger(name: str) -> None:
    import importlib.util

    module = {"wandb": "wandb", "tensorboard": "tensorboard"}[name]
    if importlib.util.find_spec(module) is None:
        raise TrainError(f"logging.{name} = true but the `{module}` package is not installed "
                         f"(install it, or set logging.{name}=false)")


# ----------------------------------------------------------------------------- the run

def run(cfg) -> int:
    """Train the stage described by the composed config. Returns the exit code."""
    started = time.time()
    conf = read_config(cfg)                                   # ConfigError before anything loads
    origin = config_origin()
    out = outputs.RunWriter(conf["output_dir"], enabled=rank() == 0)
    done = out.stage_complete()
    if done and not conf["force"] and _still_complete(done, out, origin):
        print0(f"[{conf['stage']}] already complete ({done.get('steps')} steps, {out.dir}/"
               f"{done.get('weights', 'draft_model_weights.pth')}); pass force=true to train it again")
        return 0
    pre = preflight(conf)
    resume_from = decide_resume(out, origin, conf)

    session = Session(conf, origin, out, pre, started)
    try:
        session.setup(resume_from)
        session.train()
        if session.preempted:
            session.stop_preempted()
            return EXIT_PREEMPTED
        session.finish()
    finally:
        session.close()
    return 0


def _still_complete(done: dict, out: outputs.RunWriter, origin: Origin) -> bool:
    if origin.config_sha256 is None or done.get("config_sha256") != origin.config_sha256:
        return False
    weights = out.read.weights_for(done)
    if not weights.is_file():
        return False
    from longspec_cli.core.runfolder import cached_sha256

    return cached_sha256(weights) == done.get("sha256")


# ----------------------------------------------------------------------------- the session

class Session:
    """One rank's training run: setup (engine, data, resume), train, finish, close."""

    def __init__(self, conf: dict[str, Any], origin: Origin, out: outputs.RunWriter,
                 pre: Preflight, started: float):
        self.conf, self.origin, self.out, self.pre, self.started = conf, origin, out, pre, started
        self.engine = None
        self.trackers: outputs.Trackers | None = None
        self.dist_ready = False
        self.ok = False
        self.step = 0
        self.last_loss: float | None = None
        self.saved: tuple[int, Any] | None = None       # (step, draft state) of the last save
        self.preempted = False                            # a stop signal ended the loop

    # ------------------------------------------------------------------ setup
    def setup(self, resume_from) -> None:
        import deepspeed
        import torch
        from deepspeed.accelerator import get_accelerator

        conf = self.conf
        accel = get_accelerator()
        self.on_cpu = accel.device_name() == "cpu"
        if self.on_cpu and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
        self.dist_ready = True
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()

        self.simtau = simtau.SimTau(conf, self.pre.dataset, self.out, self.rank, self.world, resume_from is not None)
        self.dataset, self.pad_id = self.simtau.train_part, self.pre.tokenizer.pad_token_id
        self.per_epoch = len(self._loader(epoch=0, skip=0))
        if self.per_epoch == 0:
            raise TrainError(f"train_file = {conf['train_file']}: no batch of "
                             f"{conf['per_gpu_train_batch_size']} records per rank over {self.world} ranks")
        self.total, warmup = dsconfig.plan_steps(conf, self.per_epoch)

        cpu_adam_error = _cpu_adam_error(accel) if _wants_offload(conf) else None
        ds_conf, notes = dsconfig.build_ds_config(
            conf, world_size=self.world, total_steps=self.total, warmup_steps=warmup,
            on_cpu=self.on_cpu, cpu_adam_error=cpu_adam_error)
        for note in notes:
            print0(f"[{conf['stage']}] note: {note}")
        self.ds_conf = ds_conf

        # All ranks decided on resume_from before anything is written (read-only so far).
        torch.distributed.barrier()
        if self.rank == 0:
            if conf["force"]:
                self.out.remove_all_checkpoints()
            self.out.clear_stage_complete()
            self.out.write_training_config(_training_config_yaml(conf, ds_conf, self.origin))
            self.simtau.commit()

        self.backends = self._kernels(accel)               # KernelUnavailable before the model loads
        self.engine = self._engine(ds_conf)
        self.trackers = outputs.Trackers(conf, self.out.dir, enabled=self.rank == 0)
        if resume_from is not None:
            self._resume(resume_from)
        else:
            self.out.event("start", 0, total_steps=self.total, world_size=self.world,
                           config_sha256=self.origin.config_sha256, kernels=self.backends)
        self.max_offset = self._max_offset()
        print0(f"[{conf['stage']}] {self.total} steps, {self.world} rank(s) x "
               f"{conf['per_gpu_train_batch_size']} x {conf['gradient_accumulation_steps']} accumulation, "
               f"ZeRO-{ds_conf['zero_optimization']['stage']}, {conf['precision']}, optimizer "
               f"{type(getattr(self.engine, 'basic_optimizer', None)).__name__}, {self.per_epoch} "
               f"batches/epoch/rank, {len(self.dataset)} records")
        print0(f"[{conf['stage']}] kernels ({conf['kernels']}): attention {self.backends['attention']}, "
               f"loss {self.backends['linear_cross_entropy']}, tf32 {self.backends['tf32']}")

    def _kernels(self, accel) -> dict[str, str]:
        """Choose the attention / loss kernels (``kernels`` key) and turn TF32 on for CUDA's fp32
        matmuls (the loss runs in fp32); what was chosen goes into the log and the start event."""
        import torch

        from longspec import kernels

        kernels.set_mode(self.conf["kernels"])
        device = "cpu" if self.on_cpu else accel.device_name()
        on_cuda = device.startswith("cuda")
        try:
            chosen = kernels.backend(device if on_cuda else "cpu", getattr(torch, DTYPES[self.conf["precision"]]))
        except kernels.KernelUnavailable as e:
            raise TrainError(str(e)) from None
        if on_cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("high")
        return {**chosen, "tf32": "on" if on_cuda else "off"}

    def _loader(self, epoch: int, skip: int):
        from longspec import data

        return data.make_loader(self.dataset, self.conf["per_gpu_train_batch_size"],
                                seed=self.conf["seed"], rank=self.rank, world_size=self.world,
                                pad_token_id=self.pad_id, skip_batches=skip, epoch=epoch)

    def _engine(self, ds_conf: dict):
        import deepspeed
        import torch

        from longspec.checkpoint import load_draft_weights
        from longspec.model import build_glide
        from longspec.zero import parameter_bytes

        conf = self.conf
        torch.manual_seed(conf["seed"])                  # the same fresh draft on every rank
        dtype = getattr(torch, DTYPES[conf["precision"]])
        # ZeRO-3: partitioned while built, so no rank ever holds a whole copy of the target.
        zero3 = ds_conf if (ds_conf.get("zero_optimization") or {}).get("stage") == 3 else None
        model = build_glide(conf["model_name_or_path"], sliding_window=conf["draft"]["sliding_window"],
                            dtype=dtype, loss_chunk_size=conf["loss_chunk_size"], zero3_config=zero3)
        if zero3 is not None:
            (t_held, t_whole), (d_held, d_whole) = parameter_bytes(model.target), parameter_bytes(model.draft)
            print(f"[{conf['stage']}] rank {self.rank}: ZeRO-3 partitioned at load: target "
                  f"{t_held:,} of {t_whole:,} bytes, draft {d_held:,} of {d_whole:,} bytes on this rank",
                  flush=True)
        if self.pre.draft_state is not None:
            load_draft_weights(model.draft, self.pre.draft_state)
            self.pre.draft_state = None
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.trainable_parameters(), config=ds_conf)
        return engine

    def _resume(self, ckpt) -> None:
        path = ckpt.path / outputs.DS_STATE
        loaded, client = self.engine.load_checkpoint(
            str(path), tag=outputs.DS_TAG, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=True)
        if loaded is None:
            raise TrainError(f"{ckpt.path}: DeepSpeed state could not be loaded")
        self.step = int(client.get("step", ckpt.step))
        _progress["step"] = self.step
        self.last_loss = ckpt.info.get("loss")
        self.out.event("resume", self.step, total_steps=self.total, path=str(ckpt.path),
                       config_sha256=self.origin.config_sha256, kernels=self.backends)
        print0(f"[{self.conf['stage']}] resumed from {ckpt.path} at step {self.step}")

    def _max_offset(self) -> int:
        from longspec.positions import default_max_offset

        p = self.conf["positions"]
        if p["max_offset"] is not None:
            return int(p["max_offset"])
        limit = getattr(self.pre.target_config, "max_position_embeddings", 0) or 0
        return default_max_offset(limit, self.conf["data"]["max_seq_length"]) if limit > 0 else 0

    # ------------------------------------------------------------------ train
    def batches(self, consumed: int):
        """Micro-batches from `consumed` on: epoch = consumed // per_epoch, the rest skipped."""
        epoch, skip = divmod(consumed, self.per_epoch)
        while True:
            for batch in self._loader(epoch, skip):
                yield batch
            epoch, skip = epoch + 1, 0

    def positions(self, batch: int, seq: int, micro: int):
        from longspec.positions import anchor_offset_position_ids, plain_position_ids

        p = self.conf["positions"]
        if p["mode"] == "plain":
            return plain_position_ids(seq, batch)
        gen = seeded(self.conf["seed"], self.step, micro, self.rank)
        return anchor_offset_position_ids(seq, batch, anchors=p["anchors"], max_offset=self.max_offset,
                                          threshold=p["threshold"], generator=gen)

    def train(self) -> None:
        import torch

        from longspec.positions import sample_cross_lag

        conf, engine = self.conf, self.engine
        ga = conf["gradient_accumulation_steps"]
        device = engine.device
        stream = self.batches(self.step * ga)
        t_train, step0 = time.time(), self.step
        t_log, tokens_log = time.time(), 0.0
        engine.train()
        if self.step == 0:
            self.simtau.maybe(self)
        while self.step < self.total:
            sums = torch.zeros(4, dtype=torch.float64)       # loss, llm_loss, tokens, stop request
            for micro in range(ga):
                batch = next(stream)
                ids = batch["input_ids"]                       # (B, T)
                mask = batch.get("attention_mask")
                pos = self.positions(ids.shape[0], ids.shape[1], micro)
                # one lag per forward (and per rank), as the reference draws it inside the model
                lag = sample_cross_lag(conf["cross_attn_lag"], seeded(conf["seed"], self.step, micro, self.rank, -1))
                result = engine(input_ids=ids.to(device), labels=batch["labels"].to(device),
                                position_ids=pos.to(device), cross_lag=lag,
                                attention_mask=None if mask is None else mask.to(device))
                engine.backward(result["loss"])
                engine.step()
                sums[0] += result["loss"].detach().float().item()
                sums[1] += result["llm_loss"].detach().float().item()
                sums[2] += float(mask.sum()) if mask is not None else ids.numel()
            self.step += 1
            _progress["step"] = self.step
            sums[3] = 1.0 if WATCH.requested.is_set() else 0.0   # every rank stops at the same step
            torch.distributed.all_reduce(sums)
            loss, llm_loss = sums[0].item() / (ga * self.world), sums[1].item() / (ga * self.world)
            self.last_loss = loss
            tokens_log += sums[2].item()
            if self.step % conf["logging_steps"] == 0 or self.step == self.total:
                now = time.time()
                tps = tokens_log / max(now - t_log, 1e-9)
                lr = engine.get_lr()[0]
                self.out.step_record(step=self.step, total_steps=self.total, loss=loss, llm_loss=llm_loss,
                                     lr=lr, tokens_per_s=tps, elapsed_s=now - self.started)
                self.trackers.log(self.step, {"loss": loss, "llm_loss": llm_loss, "lr": lr,
                                              "tokens_per_s": tps})
                per_step = (now - t_train) / max(self.step - step0, 1)
                print0(f"[{conf['stage']}] step {self.step}/{self.total} loss {loss:.4f} "
                       f"llm_loss {llm_loss:.4f} lr {lr:.3g} {tps:,.0f} tok/s "
                       f"ETA {_clock(per_step * (self.total - self.step))}")
                t_log, tokens_log = now, 0.0
            if self.simtau.maybe(self):
                t_log = time.time()
            if self.step % conf["save_steps"] == 0 or self.step == self.total:
                self.save_checkpoint()
                t_log = time.time()                      # throughput leaves the save time out
            if sums[3].item() > 0 and self.step < self.total:
                self.preempted = True
                if not (self.saved and self.saved[0] == self.step):
                    self.save_checkpoint()
                return

    # ------------------------------------------------------------------ save
    def draft_state(self) -> dict | None:
        """The draft's full state dict as CPU tensors on rank 0 (ZeRO-3: gathered; collective)."""
        import deepspeed

        draft = self.engine.module.draft
        partitioned = [p for p in draft.parameters() if hasattr(p, "ds_id")]
        if partitioned:
            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                state = _cpu_state(draft) if self.rank == 0 else None
        else:
            state = _cpu_state(draft) if self.rank == 0 else None
        return state

    def save_checkpoint(self) -> None:
        import torch

        from longspec.checkpoint import save_draft

        path = self.out.checkpoint_dir(self.step)
        _progress["writing"] = path
        if self.rank == 0:
            self.out.prepare_checkpoint(self.step)
        torch.distributed.barrier()
        self.engine.save_checkpoint(str(path / outputs.DS_STATE), tag=outputs.DS_TAG,
                                    client_state={"step": self.step}, save_latest=False,
                                    exclude_frozen_parameters=True)
        state = self.draft_state()
        if self.rank == 0:
            save_draft(state, path)
        torch.distributed.barrier()                       # every rank's DeepSpeed shard is on disk
        if self.rank == 0:
            self.out.mark_checkpoint(path, {"step": self.step, "total_steps": self.total,
                                            "loss": self.last_loss, "stage": self.conf["stage"],
                                            "config_sha256": self.origin.config_sha256,
                                            "math": math_config(self.conf)})
            self.out.rotate(self.conf["save_total_limit"], self.step)
            self.out.event("checkpoint", self.step, path=str(path))
        self.saved = (self.step, state)
        _progress["writing"] = None

    def stop_preempted(self) -> None:
        """After a stop signal: the checkpoint of this step is on every rank's disk; say so, leave."""
        import torch

        path = self.out.checkpoint_dir(self.step)
        if self.rank == 0:
            self.out.event("preempted", self.step, total_steps=self.total, signal=WATCH.name, path=str(path))
            print0(f"[{self.conf['stage']}] {WATCH.name or 'stop signal'}: saved {path} at step "
                   f"{self.step}/{self.total}; a rerun resumes from it (exit code {EXIT_PREEMPTED})")
        torch.distributed.barrier()
        WATCH.saved = True
        self.ok = True

    def finish(self) -> None:
        import torch

        from longspec.checkpoint import WEIGHTS_NAME, save_draft

        state = self.saved[1] if self.saved and self.saved[0] == self.step else self.draft_state()
        if self.rank == 0:
            _progress["writing"] = self.out.dir / WEIGHTS_NAME
            weights = save_draft(state, self.out.dir / WEIGHTS_NAME)
            _progress["writing"] = self.out.dir / runfolder.STAGE_COMPLETE
            self.out.event("end", self.step, final_loss=self.last_loss,
                           elapsed_s=round(time.time() - self.started, 3))
            self.out.write_stage_complete(
                stage=self.conf["stage"], steps=self.step, final_loss=self.last_loss,
                target=str(Path(self.conf["model_name_or_path"]).resolve()),
                config_sha256=self.origin.config_sha256, draft_sha256=self.pre.draft_sha256,
                weights=weights)
            print0(f"[{self.conf['stage']}] done: {self.step} steps, final loss "
                   f"{self.last_loss if self.last_loss is None else round(self.last_loss, 4)}, {weights}")
        torch.distributed.barrier()
        self.ok = True

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Leave the process group cleanly on every rank (a ZeRO-3 run on gloo otherwise aborts
        at interpreter exit): barrier on success, drop the engine, destroy the group."""
        if self.trackers is not None:
            self.trackers.close()
        if not self.dist_ready:
            return
        import gc

        import torch.distributed as dist

        if self.engine is not None:
            try:
                self.engine.destroy()
            except Exception:
                pass
            self.engine = None
        gc.collect()
        if dist.is_initialized():
            if self.ok:
                dist.barrier()
            dist.destroy_process_group()


def _cpu_state(module) -> dict:
    return {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise TrainError(f"model_name_or_path = {path}: no usable tokenizer ({str(e).splitlines()[0]})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _wants_offload(conf: dict) -> bool:
    zero = (conf.get("ds_cfg") or {}).get("zero_optimization") or {}
    device = (zero.get("offload_optimizer") or {}).get("device")
    return device not in (None, "none")


def _cpu_adam_error(accel) -> str | None:
    """None when DeepSpeedCPUAdam's op builds/loads here, else why not (one line)."""
    try:
        accel.create_op_builder("CPUAdamBuilder").load(verbose=False)
    except Exception as e:  # a compiler error, a missing toolchain, an unsupported CPU
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return None


def _training_config_yaml(conf: dict, ds_conf: dict, origin: Origin) -> str:
    from omegaconf import OmegaConf

    head = (f"# resolved by longspec.train from {origin.exp_file or '(no experiment file)'}\n"
            f"# overrides: {' '.join(origin.overrides) or '(none)'}\n"
            f"# config_sha256: {origin.config_sha256}\n")
    return head + OmegaConf.to_yaml(OmegaConf.create({**conf, "ds_cfg": ds_conf}))


# ----------------------------------------------------------------------------- entry point

def guarded(cfg) -> int:
    """run() with the error boundary: user mistakes -> one `error:` block, exit 1, no traceback."""
    from longspec_cli.core import diskspace

    try:
        return run(cfg)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:
        if isinstance(e, dsconfig.ConfigError):
            message = "invalid stage config:\n" + "\n".join(f"- {p}" for p in e.problems)
        elif isinstance(e, user_errors()):
            message = str(e)
        elif diskspace.is_write_failure(e):
            message = _write_failure(cfg, e)
        else:
            import traceback

            traceback.print_exc()
            message = f"training failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if rank() == 0:
            report_error(message)
            _error_event(cfg, message)
        return EXIT_ERROR


def _error_event(cfg, message: str) -> None:
    try:
        out_dir = Path(cfg.get("output_dir"))
    except Exception:
        return
    if out_dir.is_dir():
        try:
            outputs.RunWriter(out_dir).event("error", _progress["step"], message=message)
        except OSError:
            pass                       # a full disk: the error block on stderr says it all


def _write_failure(cfg, e: BaseException) -> str:
    """A write failed for want of space: drop the half-written checkpoint (rank 0; it never got its
    checkpoint.json, so nothing reads it, but it holds space), then name path, space and resume point."""
    from longspec_cli.core import diskspace

    try:
        out_dir = Path(cfg.get("output_dir"))
    except Exception:
        out_dir = Path(".")
    path = _progress["writing"] or diskspace.failed_path(e) or "the training log (stdout)"
    if rank() == 0:
        outputs.RunWriter(out_dir).drop_incomplete_checkpoints()
    return diskspace.write_failure(path, out_dir, e)


def main() -> None:
    WATCH.install()                  # before any thread starts: the stop signals go to one thread
    sys.argv = [sys.argv[0]] + implied_config_dir(take_local_rank(sys.argv[1:]))
    single_process_env()
    _hydra_entry()


_hydra_entry = make_hydra_entry(guarded)

if __name__ == "__main__":
    main()
