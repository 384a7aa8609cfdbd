"""One module per CLI verb; each defines register(app). Commands stay thin: parse, call the core, render."""
