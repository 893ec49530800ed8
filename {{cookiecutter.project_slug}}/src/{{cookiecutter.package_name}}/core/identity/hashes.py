"""Content hashes of files: full sha256 (no sampled blocks), cached by what the file system says of the file.

Run identity (:mod:`.fingerprint`) and the ``datasets`` cache (:func:`content_cache_dir`) name files by content, not path
or mtime: a file rewritten with its mtime kept (``cp -p``, ``rsync -t``) is different data.  Digests are cached under
``(device, inode, size, mtime_ns, ctime_ns)``; ``ctime`` is set by the kernel on every write and cannot be set back, so a
rewritten file always misses.  Cache: ``~/.cache/<package>/file_hashes.json`` (``$XDG_CACHE_HOME``; ``FILE_HASH_CACHE``
overrides), rewritten atomically; concurrent writers lose at most an entry (one more read later).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

PACKAGE = __package__.split(".")[0]
CACHE_ENV = "FILE_HASH_CACHE"
MAX_ENTRIES = 200_000  # the oldest are dropped beyond this (~25 MB of JSON; a file hashed again costs one read)

_memo: dict[str, str] = {}
_loaded_from: Path | None = None


def cache_file() -> Path:
    """The cache file (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / PACKAGE / "file_hashes.json"


def stat_key(path: Path) -> str:
    """``device:inode:size:mtime_ns:ctime_ns`` of ``path`` (a symlink followed)."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of ``path``, cached while unchanged.

    Raises:
        OSError: the file cannot be read (missing, a folder, no permission).
    """
    return files_sha256([path])[0]


def files_sha256(paths: list[str | Path]) -> list[str]:
    """:func:`file_sha256` of each of ``paths``, writing the cache file once at the end.

    Raises:
        OSError: a file cannot be read.
    """
    _load_cache()
    digests, added = [], False
    for path in map(Path, paths):
        key = stat_key(path)
        if key not in _memo:
            with path.open("rb") as file:
                digest = hashlib.file_digest(file, "sha256").hexdigest()
            if stat_key(path) != key:  # (a file written while it was read is not cached)
                digests.append(digest)
                continue
            _memo[key], added = digest, True
        digests.append(_memo[key])
    if added:
        _save_cache()
    return digests


def folder_sha256(folder: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` of the top-level regular files of ``folder`` (a model folder is flat), except hidden and ``*.md``."""
    paths = [
        path for path in sorted(Path(folder).iterdir()) if path.is_file() and not path.name.startswith(".") and path.suffix.lower() != ".md"
    ]
    return dict(zip((path.name for path in paths), files_sha256(paths), strict=True))


def combined(digests: dict[str, str]) -> str:
    """One sha256 of a ``{name: sha256}`` map (names included), for a folder or file list as a whole."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def content_cache_dir(cache_dir: str | None, files: list[str]) -> str:
    """``datasets`` cache folder for ``files``: ``cache_dir`` (or the default) / ``by_content/<16 hex of combined sha256>``.

    ``datasets`` keys a local file's cache by path and mtime, so a rewrite with the mtime kept would serve stale data."""
    import datasets

    base = Path(cache_dir) if cache_dir else Path(datasets.config.HF_DATASETS_CACHE)
    digest = combined({str(index): value for index, value in enumerate(files_sha256(files))})
    return str(base / "by_content" / digest[:16])


def forget() -> None:
    """Drop this process's copy of the cache; the next hash rereads the cache file."""
    global _loaded_from
    _memo.clear()
    _loaded_from = None


def _load_cache() -> None:
    global _loaded_from
    path = cache_file()
    if _loaded_from == path:
        return
    _memo.clear()
    _loaded_from = path
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: hashed again
        return
    if isinstance(stored, dict):
        _memo.update({str(k): str(v) for k, v in stored.items()})


def _save_cache() -> None:
    path = cache_file()
    while len(_memo) > MAX_ENTRIES:
        _memo.pop(next(iter(_memo)))
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        with os.fdopen(handle, "w") as file:
            json.dump(_memo, file)
        os.replace(partial, path)
    except OSError:  # a read-only home: hashing still works, uncached
        if partial is not None:
            Path(partial).unlink(missing_ok=True)
