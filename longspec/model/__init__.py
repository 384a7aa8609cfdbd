"""longspec.model."""
