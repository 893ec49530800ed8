"""What the real-data demos share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One ``paths.cache_dir`` for the demos (per pytest-xdist worker: two processes never fetch into
    one folder at once): the first to run fetches SmolLM2 and its data there, so the fetch is
    exercised; the next ones read the files (each GGUF conversion costs about a minute on 2 CPU cores)."""
    return tmp_path_factory.mktemp("shared_cache")
