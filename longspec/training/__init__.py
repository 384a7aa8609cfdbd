"""longspec.training."""
