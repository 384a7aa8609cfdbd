"""Per-GPU memory estimate of one training stage: arithmetic on sizes, nothing measured.

    persistent  target weights (precision bytes; ZeRO-3: / world, plus the gathered working set)
                draft weights; draft gradients (ZeRO-2/3: / world; ZeRO-1/2: only when gradients
                accumulate, with their reduce bucket, else from the backward to the step)
                ZeRO-3's reduce bucket (allocated once)
                Adam: fp32 master + 2 moments (ZeRO >= 1: / world; 0 on the GPU when offloaded;
                ZeRO-1/2 copy the master even from fp32 weights)
                runtime (CUDA context, NCCL and allocator slack)
    phase A     target forward, no grad: one layer's transient (2H + 3I per token) + kept K/V
    phase B     draft forward, loss, backward: throughout, the one draft block's saved activations,
                the target's last-layer K/V and final hidden state and the loss's gradient of
                the hidden states; then the larger of two moments: the loss's forward (one chunk
                of logits: Liger's or longspec's, ``loss_chunk_bytes``) or the draft's backward
                (its transient, the SDPA reference's largest chunk where the attention is not
                fused, and ZeRO-1/2's gradients with the reduce bucket, allocated when the first
                gradient is made)
    phase C     the optimizer step: ZeRO-1/2's gradients and their partition's fp32 copy
    peak        persistent + max(phase A, phase B, phase C)

DeepSpeed allocates the whole reduce bucket whatever the model's size; the trainer sizes it to
the draft (``reduce_bucket_elements``). bench/gpu_check.py --dry-run measures the estimate against
the live tensors of the trainer's own DeepSpeed engine on the CPU (hostmem.TensorPeak).

Sequence parallel (`sequence_parallel_size` SP): each GPU holds T/SP tokens of every sequence (and,
inside attention, all T tokens of nh/SP heads: the same size), so phases A and B divide by SP;
the persistent part does not (ZeRO still partitions over the whole world), nor does the SDPA
reference path's largest chunk (bounded by SCORE_BUDGET at any length). bench/bench_sp.py measures
it on the CPU: the peak per rank grows about half as fast per token at SP 2 as at SP 1.

The layer shapes follow longspec/model/glide.py (self-attn + cross-attn with q/k/v biases, SwiGLU MLP,
three RMSNorms; the cross-attn k/v projections are frozen) and longspec/model/kernels.py (SDPA chunked
over queries with a boolean mask, linear cross-entropy in fp32 chunks of 1024 rows by default, the
lm_head read in its own dtype). bench/bench_saved_activations.py counts what autograd keeps for
a Qwen2.5-7B-shaped GLIDE block in bf16 on the CPU: 292 KB per token at 512 tokens and 264 KB at
1,024 (the reference attention's chunks checkpointed), where "draft activations" says 299 KB.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 1024 ** 3
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RUNTIME_BYTES = int(2.0 * GiB)  # CUDA context + NCCL buffers + caching-allocator slack
# The trainer's own sizes (longspec/model/kernels.py and attention.py read them from here):
DEFAULT_CE_CHUNK = 1024  # rows of fp32 logits per chunk of the reference cross-entropy
# Score elements (B x nh x queries x keys, twice: mask and weights) per SDPA call on the reference
# attention path: bounds its memory at any length. On CUDA 2^28 bool elements are 256 MB.
SCORE_BUDGET = {"cpu": 1 << 24, "cuda": 1 << 28}
ZERO12_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2 targets; Llama targets have none

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    def attention_params(self, bias: bool) -> int:
        H = self.hidden
        return H * self.q_dim + 2 * H * self.kv_dim + self.q_dim * H + (self.q_dim + 2 * self.kv_dim if bias else 0)

    def layer_params(self) -> int:
        return self.attention_params(self.qkv_bias) + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def target_params(self) -> int:
        emb = self.vocab * self.hidden
        return emb * (1 if self.tie_embeddings else 2) + self.layers * self.layer_params() + self.hidden

    def draft_params(self) -> tuple[int, int]:
        """(all, trainable): the GLIDE block has biased q/k/v in both attentions; cross k/v are frozen."""
        H = self.hidden
        attn = self.attention_params(True)
        total = 2 * attn + 3 * H * self.intermediate + 3 * H
        frozen = 2 * (H * self.kv_dim + self.kv_dim)
        return total, total - frozen

    @classmethod
    def from_mapping(cls, d: dict[str, Any]) -> "ModelSize":
        """From a preset `size:` table or a transformers config.json."""
        g = lambda *names: next((d[n] for n in names if d.get(n) is not None), None)  # noqa: E731
        hidden, heads = g("hidden", "hidden_size"), g("heads", "num_attention_heads")
        vals = dict(hidden=hidden, layers=g("layers", "num_hidden_layers"), heads=heads,
                    kv_heads=g("kv_heads", "num_key_value_heads") or heads,
                    intermediate=g("intermediate", "intermediate_size"), vocab=g("vocab", "vocab_size"))
        missing = [k for k, v in vals.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
        if missing:
            raise ValueError(f"model size lacks {', '.join(missing)}")
        family = d.get("model_type") or d.get("family")
        bias = d.get("attention_bias")
        return cls(**vals, head_dim=g("head_dim"), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                   qkv_bias=bool(bias) if bias is not None else family != "llama")

    @classmethod
    def from_config_json(cls, path: Path) -> "ModelSize":
        data = json.loads(Path(path).read_text())
        if isinstance(data.get("text_config"), dict):  # multimodal wrappers keep the LM inside
            data = {**data, **data["text_config"]}
        return cls.from_mapping(data)


@dataclass(frozen=True)
class StageShape:
    """What the estimate needs to know about a stage and its launch."""

    size: ModelSize
    precision: str = "bf16"
    zero_stage: int = 1
    offload_optimizer: bool = True
    seq_len: int = 1024
    micro_batch: int = 1
    world_size: int = 1
    flash: bool = True
    loss_chunk: int = DEFAULT_CE_CHUNK
    sliding_window: int = 512
    prefetch_params: int = 100_000_000  # stage3_prefetch_bucket_size
    cuda: bool = True  # False: a CPU run (no CUDA context; the estimate is informational)
    sequence_parallel: int = 1  # SP ranks share each sequence (DeepSpeed Ulysses)
    loss_kernel: str = "chunked"  # "liger" (Liger's fused loss), "chunked" (longspec's) or "either": the larger
    reduce_bucket: int | None = None  # zero_optimization.reduce_bucket_size (elements); None: the trainer's
    overlap_comm: bool = False  # zero_optimization.overlap_comm (ZeRO-1/2: a second bucket)
    contiguous_gradients: bool = True  # zero_optimization.contiguous_gradients (DeepSpeed's default)
    grad_accumulation: int = 1  # gradient_accumulation_steps: ZeRO-1/2 then hold gradients across micro-steps


@dataclass
class MemoryEstimate:
    shape: StageShape
    persistent: list[tuple[str, float]] = field(default_factory=list)  # (what, bytes)
    phase_a: list[tuple[str, float]] = field(default_factory=list)
    phase_b: list[tuple[str, float]] = field(default_factory=list)
    # Phase B's two moments on top of what it holds throughout: the loss's chunk in the forward,
    # then the draft block's backward; the larger counts.
    phase_b_max: list[tuple[str, list[tuple[str, float]]]] = field(default_factory=list)
    phase_c: list[tuple[str, float]] = field(default_factory=list)   # the optimizer step
    cpu_offload_per_node: float = 0.0  # bytes of optimizer state held in CPU RAM per node
    ranks_per_node: int = 1

    def _phases(self) -> dict[str, float]:
        b = sum(x for _, x in self.phase_b) + max((sum(x for _, x in items) for _, items in self.phase_b_max),
                                                  default=0.0)
        return {"target forward": sum(x for _, x in self.phase_a), "draft forward/backward": b,
                "optimizer step": sum(x for _, x in self.phase_c)}

    @property
    def peak(self) -> float:
        return sum(b for _, b in self.persistent) + max(self._phases().values())

    @property
    def peak_phase(self) -> str:
        phases = self._phases()
        return max(phases, key=phases.get)

    def lines(self) -> list[str]:
        s = self.shape
        head = (f"per-GPU memory estimate: {gib(self.peak)} peak ({self.peak_phase}); {s.precision}, "
                f"ZeRO-{s.zero_stage}{' + optimizer offload' if s.offload_optimizer else ''}, "
                f"{s.seq_len} tokens x {s.micro_batch}, world {s.world_size}, "
                f"{_sp_text(s)}"
                f"{'fused attention' if s.flash else 'SDPA reference attention'}")
        out = [head]
        phases = self._phases()
        for title, items, total in (("persistent", self.persistent, sum(b for _, b in self.persistent)),
                                    ("target forward", self.phase_a, phases["target forward"]),
                                    ("draft fwd/bwd", self.phase_b, phases["draft forward/backward"]),
                                    ("optimizer step", self.phase_c, phases["optimizer step"])):
            parts = [f"{w} {gib(b)}" for w, b in items if b >= 0.005 * GiB]
            if items is self.phase_b and self.phase_b_max:
                parts.append("then the larger of " + " | ".join(_moment_text(n, a) for n, a in self.phase_b_max))
            if items or total:
                out.append(f"  {title:<15} {gib(total):>10}  " + ", ".join(parts))
        if self.cpu_offload_per_node:
            out.append(f"  CPU RAM (offloaded optimizer, per node): {gib(self.cpu_offload_per_node)}")
        return out


def _moment_text(name: str, items: list[tuple[str, float]]) -> str:
    shown = ", ".join(f"{w} {gib(b)}" for w, b in items if b >= 0.005 * GiB)
    return f"{name} {gib(sum(b for _, b in items))}" + (f" ({shown})" if shown else "")


def _sp_text(s: StageShape) -> str:
    sp = s.sequence_parallel
    return f"sequence parallel {sp} ({s.seq_len // sp} tokens per GPU), " if sp > 1 else ""


def gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= 0.1 * GiB else f"{b / 1024 ** 2:.0f} MiB"


def estimate(s: StageShape, ranks_per_node: int | None = None) -> MemoryEstimate:
    m, p = s.size, PRECISION_BYTES[s.precision]
    W = max(1, s.world_size)
    B, T, H, I, V = s.micro_batch, s.seq_len, m.hidden, m.intermediate, m.vocab
    SP = max(1, s.sequence_parallel)
    tokens = B * T / SP if SP > 1 else B * T        # this GPU's share of every sequence
    draft_all, draft_train = m.draft_params()
    z3 = s.zero_stage >= 3
    est = MemoryEstimate(shape=s, ranks_per_node=ranks_per_node or W)

    # --- persistent
    target = m.target_params() * p
    est.persistent.append(("target weights" + (" /world" if z3 else ""), target / W if z3 else target))
    if z3:
        # ZeRO-3 gathers a module's full weight to use it; the largest is the vocab matrix (lm_head
        # for the loss, embeddings for the draft input), plus what the prefetch bucket brings in.
        biggest = max(V * H, m.layer_params())
        est.persistent.append(("ZeRO-3 gathered", (biggest + min(s.prefetch_params, m.layer_params())) * p))
    est.persistent.append(("draft weights", draft_all * p / (W if z3 else 1)))
    z12 = s.zero_stage in (1, 2)
    reduce_bucket = reduce_bucket_elements(draft_train, s.reduce_bucket)
    # Gradients. ZeRO-0/3 keep theirs (ZeRO-3 in a partition buffer allocated at start). ZeRO-1/2
    # make them at the backward and hold them to the optimizer step, across the next micro-steps'
    # forwards too when gradients accumulate: ZeRO-1 each parameter's whole gradient, ZeRO-2 its
    # partition. Beside them the reduce bucket (reduce_bucket_size elements whatever the draft's
    # size; two with overlap_comm), allocated at the first gradient and released at the step.
    grads = draft_train * p / (W if s.zero_stage >= 2 else 1)
    held: list[tuple[str, float]] = []          # ZeRO-1/2: from the backward to the step
    if z12:
        held.append(("draft grads", grads))
        if s.contiguous_gradients:
            held.append(("reduce bucket", reduce_bucket * p * (2 if s.overlap_comm else 1)))
    else:
        est.persistent.append(("draft grads", grads))
    accumulating = z12 and s.grad_accumulation > 1
    if accumulating:
        est.persistent.extend((f"{what} (accumulating)", b) for what, b in held)
    if z3 and s.contiguous_gradients:
        # ZeRO-3 allocates its reduce bucket once, at start, beside the gradient partitions
        est.persistent.append(("reduce bucket", reduce_bucket * p))
    # fp32 master + m + v; ZeRO-1/2 copy the master partition even when the weights are fp32
    optim_bytes = (12 if p < 4 or z12 else 8) * draft_train
    shard = optim_bytes / (W if s.zero_stage >= 1 else 1)
    if s.offload_optimizer:
        # DeepSpeed's CPU Adam also keeps an fp32 gradient copy of its partition.
        est.cpu_offload_per_node = (shard + 4 * draft_train / (W if s.zero_stage >= 1 else 1)) * est.ranks_per_node
    else:
        est.persistent.append(("Adam states" + (" /world" if s.zero_stage >= 1 else ""), shard))
    if s.cuda:
        est.persistent.append(("runtime", RUNTIME_BYTES))

    # --- phase A: the frozen target's forward (no autograd graph: one layer live at a time)
    kv_kept = 2 * tokens * m.kv_dim * p
    est.phase_a.append(("layer transient", tokens * (2 * H + 3 * I) * p))
    est.phase_a.append(("last-layer K/V", kv_kept))

    # --- phase B: draft forward, the loss (its gradient made in its forward), the draft's backward
    # Saved for backward per token: three RMSNorm inputs with their fp32 copies (~3H each),
    # q/k/v and RoPE inputs, two attention outputs and o_proj inputs, the MLP's four I-wide tensors.
    saved = tokens * (20 * H + 4 * m.kv_dim + 4 * I) * p
    est.phase_b.append(("draft activations", saved))
    est.phase_b.append(("target K/V + final hidden", kv_kept + tokens * H * p))
    est.phase_b.append(("loss gradient", tokens * H * p))      # d loss / d hidden, made in the loss's forward
    est.phase_b_max.append(("loss forward", [("loss chunk", loss_chunk_bytes(s, tokens))]))
    backward = [("draft backward transient", 2 * tokens * I * p)]
    if not s.flash:
        # The reference path: query chunks within SCORE_BUDGET, checkpointed when several, so one
        # chunk's mask (1 byte) and weights (p bytes) live at a time, whatever the length or SP.
        backward.append(("SDPA reference chunk", reference_chunk_bytes(s)))
    if not accumulating:
        backward.extend(held)
    if z12 and not s.contiguous_gradients:   # a bucket's gradients flattened when it is reduced
        backward.append(("reduce flatten", min(draft_train, reduce_bucket) * p))
    est.phase_b_max.append(("draft backward", backward))

    # --- phase C: the optimizer step (activations gone): ZeRO-1/2 hold the gradients and flatten
    # the rank's partition into fp32 for the step
    if z12 and not s.offload_optimizer:
        if not accumulating:
            est.phase_c.append(("draft grads", grads))
        est.phase_c.append(("fp32 grads", 4 * draft_train / W))
    return est


def query_chunks(rows: int, B: int, nh: int, keys: int, budget: int, q_chunk: int | None = None,
                 window: int | None = None) -> list[int]:
    """Query-chunk sizes of one reference-attention call (longspec.model.attention.chunk_plan with
    the device's SCORE_BUDGET): ``rows`` queries against ``keys`` keys in as few chunks as the
    budget allows, all of one size but the last (at most smaller by the number of chunks).

    A chunk of ``size`` queries reads ``keys`` keys, or with a ``window`` the ``size + window`` keys
    its band spans (at most ``keys``): the size is the largest whose scores, B x nh x size x span
    (twice: the mask and the weights), fit the budget. Sized by its window alone (window + 1 keys),
    a chunk would read size + window keys: several times the budget."""
    if rows <= 0:
        return []
    if q_chunk is None:
        cap = budget // max(1, 2 * B * nh)
        keys = max(1, keys)
        q_chunk = cap // keys                    # every chunk reads all the keys
        if window is not None and q_chunk + window < keys:
            # the band: the largest size with size x (size + window) <= cap
            q_chunk = int((math.isqrt(window * window + 4 * cap) - window) // 2)
    q_chunk = max(16, int(q_chunk))
    n = -(-rows // q_chunk)
    size = -(-rows // n)
    return [size] * (rows // size) + ([rows % size] if rows % size else [])


def reference_chunk_bytes(s: StageShape) -> float:
    """The largest chunk of the reference attention in training: its mask (1 byte) and weights
    (the precision) per score, B x heads x queries x keys. The windowed self-attention's band
    chunks; the cross-attention's chunks only where a batch can hold padding (micro batch > 1, or
    sequence parallel padding the length to a multiple of SP; unpadded, it is one call of SDPA's
    causal path and keeps no scores)."""
    m, p = s.size, PRECISION_BYTES[s.precision]
    B, T = s.micro_batch, max(1, s.seq_len)
    nh = max(1, m.heads // max(1, s.sequence_parallel))      # Ulysses: all T tokens of nh / SP heads
    budget = SCORE_BUDGET["cuda" if s.cuda else "cpu"]
    rows = query_chunks(T, B, nh, T, budget, window=s.sliding_window)[0]
    scores = B * nh * rows * min(T, rows + s.sliding_window)
    if B > 1 or T % max(1, s.sequence_parallel):     # padding: several rows, or SP's pad to a multiple
        rows = query_chunks(T, B, nh, T, budget)[0]
        scores = max(scores, B * nh * rows * T)
    return scores * (1 + p)


def reduce_bucket_elements(draft_trainable: int | None, configured: int | None = None) -> int:
    """The reduce bucket a stage's DeepSpeed engine runs with (elements): the stage's
    zero_optimization.reduce_bucket_size where it sets one, else the draft's trainable parameter
    count up to DeepSpeed's default. DeepSpeed allocates the whole bucket whatever the model's size
    (ZeRO-1/2 at every backward, ZeRO-3 once at start); its default, 5e8, is sized for whole LLMs
    and is twice a 7B target's draft: the trainer (longspec.training.dsconfig) sets this instead."""
    if configured:
        return int(configured)
    if not draft_trainable:
        return ZERO12_REDUCE_BUCKET
    return min(ZERO12_REDUCE_BUCKET, int(draft_trainable))


def loss_chunk_bytes(s: StageShape, tokens: float) -> float:
    """The loss's largest transient: one chunk of logits. Liger's fused loss (0.8): chunks of
    next_pow2(N / ceil(V / H)) rows in the hidden states' dtype, the gradient written over the
    logits. longspec's chunked loss (model/kernels.py): chunks of ``loss_chunk`` rows of fp32
    logits, softmax and gradient in place; a low-precision lm_head adds the gradient's copy in its
    dtype on CUDA, and its own fp32 copy elsewhere."""
    m, p = s.size, PRECISION_BYTES[s.precision]
    n = max(1, int(tokens))
    rows = min(n, 1 << max(0, math.ceil(n / math.ceil(m.vocab / m.hidden)) - 1).bit_length())
    liger = rows * m.vocab * p
    rows = min(s.loss_chunk or DEFAULT_CE_CHUNK, n)
    extra = (rows * m.vocab * p if s.cuda else m.vocab * m.hidden * 4) if p < 4 else 0
    chunked = rows * m.vocab * 4 + extra
    return {"liger": liger, "chunked": chunked}.get(s.loss_kernel, max(liger, chunked))


def fit_warning(est: MemoryEstimate, capacity_bytes: float | None, where: str, margin: float = 0.95) -> str | None:
    """A warning sentence when the estimate does not fit `margin` of the GPU, else None."""
    if not capacity_bytes:
        return None
    if est.peak <= margin * capacity_bytes:
        return None
    s = est.shape
    tips = []
    if s.zero_stage < 3:
        tips.append("ZeRO-3 (partitions the target over the GPUs)")
    if not s.offload_optimizer:
        tips.append("optimizer offload")
    if not s.flash:
        tips.append("kernels: auto (fused attention on CUDA, no mask kept)")
    sp = sequence_parallel_needed(est, capacity_bytes, margin)
    if sp:
        tips.append(f"sequence_parallel_size={sp} (each GPU holds {s.seq_len // sp} of the {s.seq_len} tokens)")
    tips.append("a shorter data.max_seq_length or per_gpu_train_batch_size")
    return (f"stage needs ~{gib(est.peak)} per GPU but {where} has {gib(capacity_bytes)}; "
            f"it will likely run out of memory. Try " + ", or ".join(tips) + ".")


def sequence_parallel_needed(est: MemoryEstimate, capacity_bytes: float, margin: float = 0.95) -> int | None:
    """The smallest SP above the stage's that fits: it divides the world, the head counts (query
    heads by SP; key-value heads by SP or SP by them) and the sequence length. None: none does."""
    from dataclasses import replace

    s = est.shape
    m = s.size
    for sp in range(max(1, s.sequence_parallel) + 1, max(1, s.world_size) + 1):
        if s.world_size % sp or s.seq_len % sp or m.heads % sp or (m.kv_heads % sp and sp % m.kv_heads):
            continue
        if estimate(replace(s, sequence_parallel=sp), est.ranks_per_node).peak <= margin * capacity_bytes:
            return sp
    return None
