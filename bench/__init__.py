"""Microbenchmarks: `python -m bench ops ...` (see bench/__main__.py)."""
