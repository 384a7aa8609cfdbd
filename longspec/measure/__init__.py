"""longspec.measure."""
