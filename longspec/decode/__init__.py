"""Speculative decoding with a GLIDE draft.

    chain.py       greedy chain speculative decoding (GlideProposer) and plain greedy decoding
    tree.py        token-tree speculative decoding (greedy and speculative sampling), plain sampling
    tree_attn.py   tree attention masks; reference and hybrid prefix + tree attention
    engines.py     regeneration's answers: greedy `generate` on the target, or OpenAI-compatible servers
    servers.py     which of those servers are in the rotation; the stop when none answers
    openai_http.py one request to such a server: streamed, every read bounded, no redirect, bodies masked
    regenloop.py   regeneration's loop: rows asked of an engine, handed on in source order

Imports longspec.model only. (A docstring only: nothing loads through the package.)
"""
