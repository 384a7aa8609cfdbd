"""Two-rank worker of tests/trainer/test_sequence_parallel.py (run under torchrun, DS_ACCELERATOR=cpu).

    python -m torch.distributed.run --nproc_per_node 2 tests/trainer/sp_worker.py TARGET OUT.json

Every rank first trains the plain model (SP=1) on the full global batch for STEPS SGD steps, then a
control (each rank alone on its chunk, no SP attention), then registers DeepSpeed's Ulysses hook
and trains the same fresh draft with SP=2 through a ZeRO-3 DeepSpeed engine whose config comes from
longspec.training.dsconfig (reduce_scatter forced off). Rank 0 writes the largest differences.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from longspec.model import seqpar  # noqa: E402
from longspec.model.glide import build_glide  # noqa: E402
from longspec.training import dsconfig  # noqa: E402
from longspec.training.positions import anchor_offset_position_ids  # noqa: E402
from longspec.training.rank import unlink_shm_buffer  # noqa: E402

STEPS, LR, B, T, WINDOW, LAG = 3, 0.5, 2, 45, 8, 2     # T odd: the SP path pads it to 46


def batch(step: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100                                  # a prompt
    labels[0, 20:26] = -100                               # an untrained span across the chunk boundary
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 7:] = 0                                   # right padding
    pos = anchor_offset_position_ids(T, B, anchors=4, max_offset=500, threshold=1200, generator=g)
    return dict(input_ids=ids, labels=labels, position_ids=pos, attention_mask=mask, cross_lag=LAG)


def fresh(target: str):
    torch.manual_seed(0)
    model = build_glide(target, sliding_window=WINDOW, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def draft_grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.trainable_parameters()]


def reference(target: str, vocab: int):
    model = fresh(target)
    params = model.trainable_parameters()
    losses, grads = [], []
    for step in range(STEPS):
        out = model(**batch(step, vocab))
        out["loss"].backward()
        losses.append((out["loss"].item(), out["llm_loss"].item()))
        grads.append(draft_grads(model))
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    return losses, grads, [p.detach().clone() for p in params]


def control(target: str, vocab: int, rank: int):
    """Each rank alone on its chunk (target and draft attend within the chunk only)."""
    model = fresh(target)
    sh = seqpar.prepare(**{k: v for k, v in batch(0, vocab).items() if k != "cross_lag"}, size=2, rank=rank)
    sp = seqpar.SeqParallel(dist.group.WORLD, rank, 2)
    tgt = model.target(sh.input_ids, sh.position_ids)
    hidden = model.target.embed(sh.input_ids)
    h = model.draft(hidden, sh.position_ids, tgt.k, tgt.v, cross_lag=LAG, rope=model.target.rotary(sh.position_ids, hidden))
    loss = seqpar.local_share(h, model.target.lm_head.weight, sh.labels, sp)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = draft_grads(model)
    for g in grads:
        dist.all_reduce(g)
    return total.item(), grads


def attention_alone(rank: int) -> dict:
    """seqpar.attention against attention.attention on the whole sequence, for the key-value head
    counts Ulysses splits (2 over SP 2) and replicates (1, as MQA): outputs and q/k/v gradients of
    this rank's chunk, with a window, a lag and right padding crossing the chunk boundary."""
    from longspec.model import attention

    sp = seqpar.SeqParallel(dist.group.WORLD, rank, 2)
    worst = {}
    for kvh in (2, 1):
        g = torch.Generator().manual_seed(7 + kvh)
        q, k, v = (torch.randn(2, n, 40, 16, generator=g) for n in (4, kvh, kvh))
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, 17:] = 0                                      # padding from inside rank 0's chunk on
        for kw in ({"window": 5}, {"lag": 3}):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = attention.attention(*full, causal=True, key_padding_mask=mask, **kw)   # (B, nh, T, hd)
            ref.pow(2).sum().backward()                       # the whole sequence's loss: both chunks'
            ref_out = ref.detach().transpose(1, 2).reshape(2, 40, -1)[:, rank * 20:(rank + 1) * 20]
            part = [t[:, :, rank * 20:(rank + 1) * 20].clone().requires_grad_() for t in (q, k, v)]
            out = seqpar.attention(sp, torch.nn.Module(), *part, torch.arange(rank * 20, rank * 20 + 20)[None].expand(2, 20),
                                   key_padding_mask=mask, **kw)
            out.pow(2).sum().backward()
            diffs = [float((out - ref_out).abs().max())]
            for a, b in zip(full, part):                      # grads reach every chunk through the all-to-all
                diffs.append(float((a.grad[:, :, rank * 20:(rank + 1) * 20] - b.grad).abs().max()))
            worst[f"kv{kvh}_{'window' if 'window' in kw else 'lag'}"] = max(diffs)
    return worst


def sequence_parallel(target: str, vocab: int):
    model = fresh(target)
    mpu, sp = seqpar.register_target(model.target.model, 2, B)
    model.sp = sp
    conf = {"per_gpu_train_batch_size": B, "gradient_accumulation_steps": 1, "global_batch_size": None,
            "max_grad_norm": 0.0, "learning_rate": LR, "adam_betas": [0.9, 0.95], "adam_epsilon": 1e-6,
            "weight_decay": 0.0, "precision": "fp32", "sequence_parallel_size": 2,
            "ds_cfg": {"zero_optimization": {"stage": 3}}}
    ds, notes = dsconfig.build_ds_config(conf, world_size=dist.get_world_size(), total_steps=STEPS,
                                         warmup_steps=1, on_cpu=True)
    for key in ("optimizer", "scheduler"):             # plain SGD, so weights can be compared exactly
        ds.pop(key)
    ds["zero_allow_untested_optimizer"] = True
    params = model.trainable_parameters()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=LR), config=ds, mpu=mpu)
    losses, grads = [], []
    for step in range(STEPS):
        out = engine(**batch(step, vocab))
        engine.backward(out["loss"])
        pair = torch.stack([out["loss"].detach(), out["llm_loss"].detach()]).double()
        dist.all_reduce(pair, group=sp.group)               # the shares sum to the sequence's mean
        losses.append(tuple(pair.tolist()))
        grads.append([deepspeed.utils.safe_get_full_grad(p).clone() for p in params])
        engine.step()
    weights = [deepspeed.utils.safe_get_full_fp32_param(p).clone() for p in params]
    return losses, grads, weights, ds, notes, engine


def maxdiff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main() -> None:
    target, out_path = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    dist.barrier()
    unlink_shm_buffer(rank)   # as the trainer does: DeepSpeed's CPU comm op leaves it in /dev/shm
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target).vocab_size
    ref_losses, ref_grads, ref_weights = reference(target, vocab)   # before Ulysses hooks transformers
    ctl_loss, ctl_grads = control(target, vocab, rank)
    alone = attention_alone(rank)
    losses, grads, weights, ds, notes, engine = sequence_parallel(target, vocab)
    report = {
        "steps": STEPS,
        "ref_losses": ref_losses, "sp_losses": losses,
        "loss_diff": max(abs(a - b) for r, s in zip(ref_losses, losses) for a, b in zip(r, s)),
        "grad_diff": [maxdiff(r, s) for r, s in zip(ref_grads, grads)],
        "grad_max": [max(float(g.abs().max()) for g in r) for r in ref_grads],
        "weight_diff": maxdiff(ref_weights, weights),
        "weight_change": maxdiff(ref_weights, [p.detach() for p in fresh(target).trainable_parameters()]),
        "control_loss_diff": abs(ctl_loss - ref_losses[0][0]),
        "control_grad_diff": maxdiff(ref_grads[0], ctl_grads),
        "reduce_scatter": ds["zero_optimization"].get("reduce_scatter"),
        "ds_sequence_parallel_size": ds.get("sequence_parallel_size"),
        "notes": notes,
        "engine_sp": engine.sequence_parallel_size,
        "attention_alone": alone,
    }
    gathered = [None, None]
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered}, f, indent=1)
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
