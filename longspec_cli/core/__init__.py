"""The pure core: stage manifest, config loading, validation, chaining.

Nothing under this package may import torch, deepspeed, transformers, hydra, omegaconf or textual.
"""
