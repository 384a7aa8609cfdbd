"""Serving a GLIDE draft in vLLM: a plugin that runs inside the user's vLLM environment (its own
torch; longspec installed there with the `vllm` extra). vLLM loads it in every process through the
`vllm.general_plugins` entry point `longspec_glide` (pyproject.toml). Imports only the ground floor
(longspec/formats/vllmdraft.py: the format, the supported vLLM versions) besides vLLM and torch.

    plugin.py          the entry point: checks the vLLM version, registers the draft's architecture,
                       puts the GLIDE proposer in place of draft_model's
    vllm_model.py      the draft block as a vLLM model: windowed self-attention with its own KV cache,
                       cross-attention sharing the target's last layer's cache, SwiGLU MLP; the
                       target's embeddings and lm_head
    vllm_proposer.py   draft_model's proposer with the two things GLIDE needs: the cross-attention's
                       own attention metadata (the verified length, non-causal) and the target's
                       embeddings and lm_head
    probe.py           `python -m longspec.serve.probe --json`: is vLLM here, which version, is the
                       plugin installed (package metadata only: vLLM is not imported)

(A docstring only: nothing loads through the package.)
"""
