"""longspec.decode."""
