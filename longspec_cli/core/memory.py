"""Per-GPU memory estimate of one training stage: arithmetic on sizes, nothing measured.

    persistent  target weights (precision bytes; ZeRO-3: / world, plus the gathered working set)
                draft weights, draft gradients (ZeRO-2/3: / world)
                Adam: fp32 master + 2 moments (ZeRO >= 1: / world; 0 on the GPU when offloaded)
                runtime (CUDA context, NCCL and allocator slack)
    phase A     target forward, no grad: one layer's transient (2H + 3I per token) + kept K/V
    phase B     draft forward + backward: saved activations of the one draft block, its backward
                transient, the attention extra (SDPA reference: one query chunk's mask and weights,
                SCORE_BUDGET; fused attention, flash-attn or torch's own on CUDA: none), the target's last-layer
                K/V and final hidden state, the loss chunk
    peak        persistent + max(phase A, phase B)

Sequence parallel (`sequence_parallel_size` SP): each GPU holds T/SP tokens of every sequence (and,
inside attention, all T tokens of nh/SP heads: the same size), so phases A and B divide by SP;
the persistent part does not (ZeRO still partitions over the whole world), nor does the SDPA
reference path's one chunk (bounded by SCORE_BUDGET at any length). bench/bench_sp.py measures
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


@dataclass
class MemoryEstimate:
    shape: StageShape
    persistent: list[tuple[str, float]] = field(default_factory=list)  # (what, bytes)
    phase_a: list[tuple[str, float]] = field(default_factory=list)
    phase_b: list[tuple[str, float]] = field(default_factory=list)
    cpu_offload_per_node: float = 0.0  # bytes of optimizer state held in CPU RAM per node
    ranks_per_node: int = 1

    @property
    def peak(self) -> float:
        return sum(b for _, b in self.persistent) + max(sum(b for _, b in self.phase_a),
                                                        sum(b for _, b in self.phase_b))

    @property
    def peak_phase(self) -> str:
        return "target forward" if sum(b for _, b in self.phase_a) > sum(b for _, b in self.phase_b) \
            else "draft forward/backward"

    def lines(self) -> list[str]:
        s = self.shape
        head = (f"per-GPU memory estimate: {gib(self.peak)} peak ({self.peak_phase}); {s.precision}, "
                f"ZeRO-{s.zero_stage}{' + optimizer offload' if s.offload_optimizer else ''}, "
                f"{s.seq_len} tokens x {s.micro_batch}, world {s.world_size}, "
                f"{_sp_text(s)}"
                f"{'fused attention' if s.flash else 'SDPA reference attention'}")
        out = [head]
        for title, items in (("persistent", self.persistent), ("target forward", self.phase_a),
                             ("draft fwd/bwd", self.phase_b)):
            out.append(f"  {title:<15} {gib(sum(b for _, b in items)):>10}  "
                       + ", ".join(f"{w} {gib(b)}" for w, b in items if b >= 0.005 * GiB))
        if self.cpu_offload_per_node:
            out.append(f"  CPU RAM (offloaded optimizer, per node): {gib(self.cpu_offload_per_node)}")
        return out


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
    est.persistent.append(("draft grads", draft_train * p / (W if s.zero_stage >= 2 else 1)))
    if s.zero_stage in (1, 2):
        est.persistent.append(("reduce bucket", min(draft_train, ZERO12_REDUCE_BUCKET) * p))
    optim_bytes = (12 if p < 4 else 8) * draft_train  # fp32 master (mixed precision only) + m + v
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

    # --- phase B: draft forward + backward, then the losses
    # Saved for backward per token: three RMSNorm inputs with their fp32 copies (~3H each),
    # q/k/v and RoPE inputs, two attention outputs and o_proj inputs, the MLP's four I-wide tensors.
    saved = tokens * (20 * H + 4 * m.kv_dim + 4 * I) * p
    est.phase_b.append(("draft activations", saved))
    est.phase_b.append(("draft backward transient", 2 * tokens * I * p))
    if not s.flash:
        # The reference path: query chunks within SCORE_BUDGET, checkpointed when several, so one
        # chunk's mask (1 byte) and weights (p bytes) live at a time, whatever the length or SP.
        est.phase_b.append(("SDPA reference chunk", SCORE_BUDGET["cuda" if s.cuda else "cpu"] * (p + 1)))
    est.phase_b.append(("target K/V + final hidden", kv_kept + tokens * H * p))
    # Linear CE (longspec/model/kernels.py, chunked or Liger): the gradient of the hidden states
    # (N, H) in the precision, and one chunk of fp32 logits (softmax and gradient in place) with
    # the low-precision copy its gradient product reads: (chunk, V) x 2 x 4 bytes at most.
    chunk = min(s.loss_chunk or DEFAULT_CE_CHUNK, tokens)
    est.phase_b.append(("loss chunk", tokens * H * p + 2 * chunk * V * 4))
    return est


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
