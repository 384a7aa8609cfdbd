"""vLLM's entry point for longspec (`vllm.general_plugins`: longspec_glide -> register).

vLLM calls `register()` in every process it starts, whatever model it serves, so it stays cheap and
never raises for a model that is not a GLIDE draft: on an unsupported vLLM it leaves vLLM as it is
and the draft's model class refuses to load with the reason (`require_supported`).
"""

from __future__ import annotations

import logging

from longspec.formats.vllmdraft import ARCHITECTURE, unsupported_vllm

logger = logging.getLogger("vllm.longspec_glide")   # under vLLM's logger: its handlers print it


class UnsupportedVllm(RuntimeError):
    """This vLLM is not one the plugin was tried on (longspec/formats/vllmdraft.py SUPPORTED_VLLM)."""


def require_supported(version: str | None = None) -> None:
    if version is None:
        import vllm

        version = vllm.__version__
    problem = unsupported_vllm(version)
    if problem:
        raise UnsupportedVllm(problem)


def register() -> None:
    import vllm
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "longspec.serve.vllm_model:GlideForCausalLM")
    problem = unsupported_vllm(vllm.__version__)
    if problem:
        logger.warning("%s (GLIDE drafts will not load)", problem)
        return
    from longspec.serve import vllm_proposer

    vllm_proposer.install()
