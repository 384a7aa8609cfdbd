"""longspec.data."""
