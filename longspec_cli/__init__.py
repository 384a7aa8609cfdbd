"""longspec: train long-context GLIDE speculative-decoding drafts in three chained stages."""

__version__ = "0.1.0"
