"""The training loop of one stage, top to bottom (`python -m longspec.train` runs `main`).

    run(cfg)        check the config, skip a complete stage, preflight, then a Session
    Session         setup (DeepSpeed engine, resume) -> train (steps, tau, checkpoints) -> save
                    (draft_model_weights.pth) -> finish (stage_complete.json, last) -> close
    guarded, main   the error boundary (longspec.training.failure) and the Hydra entry
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from longspec.training import dsconfig, failure, runwriter, simtau
from longspec.training.rank import (print0, progress, rank, seeded, single_process_env, take_local_rank,
                                    unlink_shm_buffer, world_size)
from longspec.training.entry import TrainError, implied_config_dir, make_hydra_entry, read_config
from longspec.training.preempt import EXIT_PREEMPTED, WATCH
from longspec.training.preflight import (DTYPES, Origin, Preflight, choose_kernels, config_origin, cpu_adam_error,
                                         draft_trainable, preflight, training_config_yaml, wants_offload)
from longspec.training.resume import decide_resume
from longspec.machine import cudaarch
from longspec.runs import runfolder
from longspec.project.mathkeys import layout, math_config

# ----------------------------------------------------------------------------- the run

def run(cfg) -> int:
    """Train the stage described by the composed config. Returns the exit code."""
    started = time.time()
    conf = read_config(cfg)                                   # ConfigError before anything loads
    origin = config_origin()
    out = runwriter.RunWriter(conf["output_dir"], enabled=rank() == 0)
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


def _still_complete(done: dict, out: runwriter.RunWriter, origin: Origin) -> bool:
    if origin.config_sha256 is None or done.get("config_sha256") != origin.config_sha256:
        return False
    weights = out.read.weights_for(done)
    if not weights.is_file():
        return False
    from longspec.runs.runfolder import cached_sha256

    return cached_sha256(weights) == done.get("sha256")


# ----------------------------------------------------------------------------- the session

class Session:
    """One rank's training run: setup (engine, data, resume), train, finish, close."""

    def __init__(self, conf: dict[str, Any], origin: Origin, out: runwriter.RunWriter,
                 pre: Preflight, started: float):
        self.conf, self.origin, self.out, self.pre, self.started = conf, origin, out, pre, started
        self.engine = None
        self.trackers: runwriter.Trackers | None = None
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

        from longspec.model import comm

        conf = self.conf
        accel = get_accelerator()
        self.on_cpu = accel.device_name() == "cpu"
        if self.on_cpu and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
        backend = accel.communication_backend_name()
        self.device = comm.init(backend)                 # this rank's GPU bound before NCCL starts
        deepspeed.init_distributed(dist_backend=backend)
        self.dist_ready = True
        if self.on_cpu:   # every local rank has mapped its peers' shared-memory buffers: names go
            torch.distributed.barrier()
            unlink_shm_buffer(torch.distributed.get_rank())
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # Sequence parallel: the SP ranks of a group (contiguous, as DeepSpeed builds them) share
        # every batch, so data, seeds and the loss average count data-parallel ranks.
        self.sp = int(conf.get("sequence_parallel_size") or 1)
        if self.world % self.sp:
            raise TrainError(f"sequence_parallel_size = {self.sp} does not divide the {self.world} ranks")
        self.dp_rank, self.dp_world = self.rank // self.sp, self.world // self.sp
        self.simtau = simtau.SimTau(conf, self.pre.dataset, self.out, self.rank, self.world,
                                    resume_from is not None)
        self.dataset, self.pad_id = self.simtau.train_part, self.pre.tokenizer.pad_token_id
        self.per_epoch = len(self._loader(epoch=0, skip=0))
        if self.per_epoch == 0:
            raise TrainError(f"train_file = {conf['train_file']}: no batch of "
                             f"{conf['per_gpu_train_batch_size']} records per rank over {self.dp_world} "
                             "data-parallel ranks")
        self.total, warmup = dsconfig.plan_steps(conf, self.per_epoch)

        adam_error = cpu_adam_error(accel) if wants_offload(conf) else None
        ds_conf, notes = dsconfig.build_ds_config(
            conf, world_size=self.world, total_steps=self.total, warmup_steps=warmup,
            on_cpu=self.on_cpu, cpu_adam_error=adam_error,
            draft_trainable=draft_trainable(self.pre.target_config, conf["draft"]["sliding_window"]))
        for note in notes:
            print0(f"[{conf['stage']}] note: {note}")
        self.ds_conf = ds_conf

        # All ranks decided on resume_from before anything is written (read-only so far).
        torch.distributed.barrier()
        if self.rank == 0:
            if conf["force"]:
                self.out.remove_all_checkpoints()
            self.out.clear_stage_complete()
            self.out.write_training_config(training_config_yaml(conf, ds_conf, self.origin))
            self.simtau.commit()

        self.backends = choose_kernels(conf, accel, self.on_cpu)   # KernelUnavailable before the model loads
        self.engine = self._engine(ds_conf)
        self.trackers = runwriter.Trackers(conf, self.out.dir, enabled=self.rank == 0)
        if resume_from is not None:
            self._resume(resume_from)
            self.simtau.after_resume(self.step)
        else:
            self.out.event("start", 0, total_steps=self.total, world_size=self.world,
                           config_sha256=self.origin.config_sha256, kernels=self.backends)
        self.max_offset = self._max_offset()
        sp_note = f" (sequence parallel {self.sp}: {self.dp_world} data-parallel)" if self.sp > 1 else ""
        print0(f"[{conf['stage']}] {self.total} steps, {self.world} rank(s){sp_note} x "
               f"{conf['per_gpu_train_batch_size']} x {conf['gradient_accumulation_steps']} accumulation, "
               f"ZeRO-{ds_conf['zero_optimization']['stage']}, {conf['precision']}, optimizer "
               f"{dsconfig.optimizer_name(getattr(self.engine, 'basic_optimizer', None))}, {self.per_epoch} "
               f"batches/epoch/rank, {len(self.dataset)} records")
        print0(f"[{conf['stage']}] kernels ({conf['kernels']}): attention {self.backends['attention']} "
               f"(target {self.backends['target_attention']}), loss {self.backends['linear_cross_entropy']}, "
               f"tf32 {self.backends['tf32']}")
        print0(f"[{conf['stage']}] {self.simtau.plan_text()}")

    def _loader(self, epoch: int, skip: int):
        from longspec.data import encoding

        return encoding.make_loader(self.dataset, self.conf["per_gpu_train_batch_size"],
                                seed=self.conf["seed"], rank=self.dp_rank, world_size=self.dp_world,
                                pad_token_id=self.pad_id, skip_batches=skip, epoch=epoch)

    def _engine(self, ds_conf: dict):
        import deepspeed
        import torch

        from longspec.model.weights import load_draft_weights
        from longspec.model.glide import build_glide
        from longspec.model.zero import parameter_bytes

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
        extra = {}
        if self.sp > 1:
            from longspec.model import seqpar

            try:
                extra["mpu"], model.sp = seqpar.register_target(model.target.model, self.sp,
                                                                conf["per_gpu_train_batch_size"])
            except ValueError as e:                      # head counts, or an eager target
                raise TrainError(f"sequence_parallel_size = {self.sp}: {e}") from None
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.trainable_parameters(), config=ds_conf, **extra)
        return engine

    def _resume(self, ckpt) -> None:
        path = ckpt.path / runwriter.DS_STATE
        loaded, client = self.engine.load_checkpoint(
            str(path), tag=runwriter.DS_TAG, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=True)
        if loaded is None:
            raise TrainError(f"{ckpt.path}: DeepSpeed state could not be loaded")
        self.step = int(client.get("step", ckpt.step))
        progress["step"] = self.step
        self.last_loss = ckpt.info.get("loss")
        self.out.event("resume", self.step, total_steps=self.total, path=str(ckpt.path),
                       config_sha256=self.origin.config_sha256, kernels=self.backends)
        print0(f"[{self.conf['stage']}] resumed from {ckpt.path} at step {self.step}")

    def _max_offset(self) -> int:
        from longspec.training.positions import default_max_offset

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
        from longspec.training.positions import anchor_offset_position_ids, plain_position_ids

        p = self.conf["positions"]
        if p["mode"] == "plain":
            return plain_position_ids(seq, batch)
        gen = seeded(self.conf["seed"], self.step, micro, self.dp_rank)   # alike across an SP group
        return anchor_offset_position_ids(seq, batch, anchors=p["anchors"], max_offset=self.max_offset,
                                          threshold=p["threshold"], generator=gen)

    def train(self) -> None:
        import torch

        from longspec.model import comm
        from longspec.training.positions import sample_cross_lag

        conf, engine = self.conf, self.engine
        ga = conf["gradient_accumulation_steps"]
        device = engine.device
        stream = self.batches(self.step * ga)
        t_train, step0 = time.time(), self.step
        t_log, tokens_log = time.time(), 0.0
        engine.train()
        if self.step == 0 or self.simtau.redo:
            self.simtau.maybe(self, force=True)
        while self.step < self.total:
            # loss, llm_loss, tokens, stop request: summed where they are made, one sync per step
            sums = torch.zeros(4, dtype=torch.float64, device=device)
            for micro in range(ga):
                batch = next(stream)
                ids = batch["input_ids"]                       # (B, T)
                mask = batch.get("attention_mask")
                pos = self.positions(ids.shape[0], ids.shape[1], micro)
                # one lag per forward (and per rank), as the reference draws it inside the model
                lag = sample_cross_lag(conf["cross_attn_lag"], seeded(conf["seed"], self.step, micro, self.dp_rank, -1))
                result = engine(input_ids=ids.to(device), labels=batch["labels"].to(device),
                                position_ids=pos.to(device), cross_lag=lag,
                                attention_mask=None if mask is None else mask.to(device))
                engine.backward(result["loss"])
                engine.step()
                sums[0] += result["loss"].detach().double()
                sums[1] += result["llm_loss"].detach().double()
                sums[2] += (float(mask.sum()) if mask is not None else ids.numel()) / self.sp
            self.step += 1
            progress["step"] = self.step
            sums[3] = 1.0 if WATCH.requested.is_set() else 0.0   # every rank stops at the same step
            sums = comm.all_reduce(sums).tolist()
            # Under SP each rank's loss is its share of its group's mean: the shares add up.
            loss, llm_loss = sums[0] / (ga * self.dp_world), sums[1] / (ga * self.dp_world)
            self.last_loss = loss
            tokens_log += sums[2]
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
                       f"ETA {runwriter.clock(per_step * (self.total - self.step))}")
                t_log, tokens_log = now, 0.0
            if self.simtau.maybe(self):
                t_log = time.time()
            if self.step % conf["save_steps"] == 0 or self.step == self.total:
                self.save_checkpoint()
                t_log = time.time()                      # throughput leaves the save time out
            if sums[3] > 0 and self.step < self.total:
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

        from longspec.model.weights import save_draft

        path = self.out.checkpoint_dir(self.step)
        progress["writing"] = path
        if self.rank == 0:
            self.out.prepare_checkpoint(self.step)
        torch.distributed.barrier()
        self.engine.save_checkpoint(str(path / runwriter.DS_STATE), tag=runwriter.DS_TAG,
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
                                            "math": math_config(self.conf), "layout": layout(self.world, self.sp)})
            self.out.rotate(self.conf["save_total_limit"], self.step)
            self.out.event("checkpoint", self.step, path=str(path))
        self.saved = (self.step, state)
        progress["writing"] = None

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

        from longspec.model.weights import WEIGHTS_NAME, save_draft

        state = self.saved[1] if self.saved and self.saved[0] == self.step else self.draft_state()
        if self.rank == 0:
            progress["writing"] = self.out.dir / WEIGHTS_NAME
            weights = save_draft(state, self.out.dir / WEIGHTS_NAME)
            progress["writing"] = self.out.dir / runfolder.STAGE_COMPLETE
            self.out.event("end", self.step, final_loss=self.last_loss,
                           elapsed_s=round(time.time() - self.started, 3))
            self.out.write_stage_complete(
                stage=self.conf["stage"], steps=self.step, final_loss=self.last_loss,
                target=str(Path(self.conf["model_name_or_path"]).resolve()),
                config_sha256=self.origin.config_sha256, draft_sha256=self.pre.draft_sha256,
                weights=weights, math=math_config(self.conf))
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


# ----------------------------------------------------------------------------- entry point

def guarded(cfg) -> int:
    """run() inside the trainer's error boundary (longspec.training.failure)."""
    return failure.guarded(run, cfg)


def main() -> None:
    WATCH.install()                  # before any thread starts: the stop signals go to one thread
    if note := cudaarch.fix_environ():    # before DeepSpeed builds an op (FusedAdam, cpu_adam)
        print0(f"note: {note}")
    sys.argv = [sys.argv[0]] + implied_config_dir(take_local_rank(sys.argv[1:]))
    single_process_env()
    _hydra_entry()                   # returns on success only (exit codes leave through sys.exit)
    # Everything is written and closed and the process group is gone: skip the interpreter's
    # teardown of torch's and DeepSpeed's native thread pools (seconds per stage on the CPU), as a
    # preempted rank does.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_hydra_entry = make_hydra_entry(guarded)
