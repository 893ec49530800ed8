"""What the real-data demos share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One ``paths.cache_dir`` for the demos that only need the fetched files, not the fetch: the
    first to run installs SmolLM2 and the VADER data there, the next ones read them (each GGUF
    conversion costs about a minute on 2 CPU cores).  The LoRA demo keeps a fresh cache of its own,
    so the fetch itself is still exercised."""
    return tmp_path_factory.mktemp("shared_cache")
