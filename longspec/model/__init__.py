"""The draft and the frozen target it rides on.

    glide.py      the GLIDE draft block and the training model (draft + frozen target, both losses)
    target.py     the frozen target: last-layer post-RoPE K/V, embeddings, RoPE, next_token_loss
    families.py   target-family registry: embeddings, lm_head, K/V layer, rotary, draft layout
    attention.py  the attention ladder, one entry, a rung per call: flash-attn, torch's fused kernels
                  on CUDA (SDPA causal, FlexAttention with a cached BlockMask), the SDPA reference
    kernels.py    the kernel mode (`kernels: auto | fused | reference`), what each kernel can run on,
                  and the linear cross-entropy (Liger on CUDA, chunked reference elsewhere)
    comm.py       the trainer's collectives, each tensor on the device its process group takes
                  (NCCL: the rank's GPU); the one caller of torch.distributed's collectives
    seqpar.py     sequence parallelism (DeepSpeed Ulysses): each sequence split across an SP group,
                  the target's and the draft's attention over the whole sequence, the loss's shares
    zero.py       ZeRO-3 helpers: gathered parameters, bytes per rank, whole copies for decoding
    weights.py    draft weights on disk: atomic save (.pth + .safetensors), safe load, key/shape checks

Imports no other group of the trainer. (A docstring only: importing a module of this package
loads nothing else through the package.)
"""
