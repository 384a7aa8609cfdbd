"""One module per CLI verb; each defines register(app). Commands stay thin: parse, call one library
or launch function, render (tests/test_package_shape.py: no function here over 45 lines of work)."""
