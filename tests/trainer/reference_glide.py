"""An independent, dense GLIDE block and loss, written from the LongSpec paper's equations.

Nothing here comes from longspec.model.glide, longspec.model.target or longspec.model.kernels: every mask is an
explicit (T, S) boolean matrix, attention is softmax(QK^T / sqrt(d) + mask) V over repeated KV
heads, the target's last-layer keys/values are recomputed from the Hugging Face model's own
modules, and the loss is the cross-entropy of full logits. It is slow and memory-hungry on
purpose: it is the yardstick the fast paths are measured against.

Notation (one sequence b; positions t, s from 0; W window; j lag):
    x_t = E[id_t]                                     target embedding (frozen)
    a   = x + SelfAttn(RMS(x)),  key s visible to t  iff  t - W <= s <= t
    c   = a + CrossAttn(RMS(a), K_L, V_L), key s visible to t  iff  s <= t - j
    h   = c + MLP(RMS(c))                              SwiGLU
    loss = mean over t with label_{t+1} != -100 and real tokens of  -log softmax(h_t H^T)[id_{t+1}]
K_L, V_L: the target's last layer keys/values (after its input norm, its per-head k norm when
the family has one (Qwen3), and RoPE at the same positions). Queries and keys of a Qwen3 draft
get the same per-head norm before RoPE. A query with no visible key outputs 0. Padded keys (attention_mask 0) are never
visible and padded tokens carry no label.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, T, hd) for plain RoPE: angle(t, i) = pos_t * theta^(-2i/hd), halves repeated."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv = theta ** (-2.0 * i / head_dim)                                    # (hd/2,)
    ang = position_ids.to(torch.float64)[..., None] * inv                  # (B, T, hd/2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def visibility(T: int, S: int, *, window: int | None, lag: int, key_mask: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, T, S) bool, spelled out element by element."""
    m = torch.zeros(T, S, dtype=torch.bool)
    for t in range(T):
        for s in range(S):
            ok = s <= t - lag
            if window is not None:
                ok = ok and s >= t - lag - window
            m[t, s] = ok
    m = m[None]
    if key_mask is not None:
        m = m & key_mask.bool()[:, None, :]
    return m


def attend(q, k, v, visible) -> torch.Tensor:
    """q (B, nh, T, hd), k/v (B, kvh, S, hd), visible (B|1, T, S) -> (B, nh, T, hd)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5                  # (B, nh, T, S)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    any_key = visible.any(-1)[:, None, :, None]                             # (B, 1, T, 1)
    probs = torch.softmax(scores.masked_fill(~any_key, 0.0), dim=-1) * any_key
    return probs @ v


def heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, hd: int) -> torch.Tensor:
    y = x @ w.T + (0 if b is None else b)
    B, T, _ = y.shape
    return y.view(B, T, -1, hd).transpose(1, 2)


def merge(y: torch.Tensor) -> torch.Tensor:
    B, nh, T, hd = y.shape
    return y.transpose(1, 2).reshape(B, T, nh * hd)


def target_last_kv(hf_model, input_ids, position_ids, attention_mask, cos, sin, dtype):
    """The target's last layer K, V (B, kvh, T, hd) from its own modules: the hidden state that
    enters the last layer, its input norm, k_proj / v_proj, RoPE on K."""
    if attention_mask is None:
        # transformers reads a jump in position_ids (the sinks' offset) as the start of a packed
        # sequence when neither a mask nor a cache is passed: an explicit mask says "one sequence"
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        out = hf_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                       output_hidden_states=True, use_cache=False)
    layer = hf_model.model.layers[-1]
    h_in = out.hidden_states[-2].to(dtype)                                  # input of the last layer
    cfg = hf_model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    norm = layer.input_layernorm
    x = rms(h_in, norm.weight.to(dtype), norm.variance_epsilon)
    att = layer.self_attn
    k = heads(x, att.k_proj.weight.to(dtype), None if att.k_proj.bias is None else att.k_proj.bias.to(dtype), hd)
    v = heads(x, att.v_proj.weight.to(dtype), None if att.v_proj.bias is None else att.v_proj.bias.to(dtype), hd)
    if getattr(att, "k_norm", None) is not None:           # Qwen3: per-head RMSNorm on k before RoPE
        k = rms(k, att.k_norm.weight.to(dtype), att.k_norm.variance_epsilon)
    return rotate(k, cos, sin), v, out.logits


def glide_block(p: dict[str, torch.Tensor], x, cos, sin, tk, tv, *, heads_q: int, head_dim: int, eps: float,
                window: int, lag: int, attention_mask=None) -> torch.Tensor:
    """The draft block on embeddings x (B, T, H) with parameters ``p`` (reference layout names)."""
    B, T, _ = x.shape
    key_mask = attention_mask

    def qk(n, attn, which):
        """Projected heads; with the family's per-head q/k norm (Qwen3) when the draft has one."""
        y = heads(n, p[f"{attn}.{which}_proj.weight"], p.get(f"{attn}.{which}_proj.bias"), head_dim)
        norm = p.get(f"{attn}.{which}_norm.weight")
        return y if norm is None else rms(y, norm, eps)

    # self-attention in the window
    n = rms(x, p["input_layernorm.weight"], eps)
    q = rotate(qk(n, "self_attn", "q"), cos, sin)
    k = rotate(qk(n, "self_attn", "k"), cos, sin)
    v = heads(n, p["self_attn.v_proj.weight"], p.get("self_attn.v_proj.bias"), head_dim)
    y = attend(q, k, v, visibility(T, T, window=window, lag=0, key_mask=key_mask))
    a = x + merge(y) @ p["self_attn.o_proj.weight"].T
    # cross-attention onto the target's K/V, lagged
    n = rms(a, p["post_self_attention_layernorm.weight"], eps)
    q = rotate(qk(n, "cross_attn", "q"), cos, sin)
    y = attend(q, tk, tv, visibility(T, tk.shape[2], window=None, lag=lag, key_mask=key_mask))
    c = a + merge(y) @ p["cross_attn.o_proj.weight"].T
    # SwiGLU MLP
    n = rms(c, p["post_cross_attention_layernorm.weight"], eps)
    up = F.silu(n @ p["mlp.gate_proj.weight"].T) * (n @ p["mlp.up_proj.weight"].T)
    return c + up @ p["mlp.down_proj.weight"].T


def next_token_ce(logits: torch.Tensor, labels: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """mean_t -log softmax(logits_t)[labels_{t+1}] over labelled, real targets."""
    labels = labels.clone()
    if attention_mask is not None:
        labels[attention_mask == 0] = -100
    lp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    y = labels[:, 1:]
    keep = y != -100
    picked = lp.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    return -(picked * keep).sum() / keep.sum()


def reference_forward(hf_model, draft_params: dict[str, torch.Tensor], input_ids, labels, position_ids, *,
                      window: int, lag: int, attention_mask=None, eps: float, dtype=torch.float64):
    """(draft loss, target loss, draft output h) computed densely in ``dtype``."""
    cfg = hf_model.config
    nh = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    cos, sin = rope_tables(position_ids, hd, theta, dtype)
    tk, tv, target_logits = target_last_kv(hf_model, input_ids, position_ids, attention_mask, cos, sin, dtype)
    x = hf_model.get_input_embeddings().weight.to(dtype)[input_ids]
    h = glide_block(draft_params, x, cos, sin, tk, tv, heads_q=nh, head_dim=hd, eps=eps,
                    window=window, lag=lag, attention_mask=attention_mask)
    head = hf_model.get_output_embeddings().weight.to(dtype)
    loss = next_token_ce(h @ head.T, labels, attention_mask)
    llm_loss = next_token_ce(target_logits, labels, attention_mask)
    return loss, llm_loss, h
