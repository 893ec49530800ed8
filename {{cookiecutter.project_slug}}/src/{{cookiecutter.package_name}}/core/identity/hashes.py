"""Content hashes of files: full sha256, cached by what the file system says of the file.

A run's identity (:mod:`.fingerprint`) and the ``datasets`` cache (:func:`content_cache_dir`) name
data and model files by their content, not by their path or modification time: a file rewritten
in place with its mtime kept (``cp -p``, ``rsync -t``) is different data, and a folder replaced by
another with the same name is a different model.

Every byte is hashed (sha256, no sampled blocks: about 1 GB/s on one core, so a 16 GB base takes
about 15 s once).  The digest is cached under the file's ``(device, inode, size, mtime_ns,
ctime_ns)``: an unchanged file is never read again, in this process or a later one.  ``ctime`` is
set by the kernel on every write and cannot be set back (``cp -p`` and ``touch -d`` restore only
``mtime``), so a rewritten file always misses the cache.  The cache is a JSON file,
``~/.cache/<package>/file_hashes.json`` (``$XDG_CACHE_HOME`` honoured; ``FILE_HASH_CACHE=<file>``
names another), rewritten atomically; two processes writing it at once lose at most an entry,
which costs one more read later.
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
    """Where the digests are kept (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / PACKAGE / "file_hashes.json"


def stat_key(path: Path) -> str:
    """``device:inode:size:mtime_ns:ctime_ns`` of ``path`` (a symlink followed)."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of every byte of ``path``, from the cache when the file is unchanged.

    Raises:
        OSError: the file cannot be read (missing, a folder, no permission).
    """
    return files_sha256([path])[0]


def files_sha256(paths: list[str | Path]) -> list[str]:
    """:func:`file_sha256` of each of ``paths``, the cache file written once at the end (a
    folder of 10,000 documents is one write, not 10,000 of a growing file).

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
    """``{file name: sha256}`` of the regular files at the top level of ``folder`` (a model folder
    is flat: weights, ``config.json``, tokenizer files), hidden files (``.gitattributes``, an
    installer's markers) and ``*.md`` left out."""
    paths = [
        path for path in sorted(Path(folder).iterdir()) if path.is_file() and not path.name.startswith(".") and path.suffix.lower() != ".md"
    ]
    return dict(zip((path.name for path in paths), files_sha256(paths), strict=True))


def combined(digests: dict[str, str]) -> str:
    """One sha256 of a ``{name: sha256}`` map (names included), for a folder or file list as a whole."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def content_cache_dir(cache_dir: str | None, files: list[str]) -> str:
    """The ``datasets`` cache folder for data read from ``files``: ``cache_dir`` (or the
    ``datasets`` default) / ``by_content/<first 16 hex digits of their combined sha256>``.

    ``datasets`` keys a local file's cache by its path and modification time, so a file
    rewritten with its mtime kept would be served from the cache as the old data; a folder
    named by the content is always the data's own (the tokenised ``map`` caches follow, as
    they live next to it)."""
    import datasets

    base = Path(cache_dir) if cache_dir else Path(datasets.config.HF_DATASETS_CACHE)
    digest = combined({str(index): value for index, value in enumerate(files_sha256(files))})
    return str(base / "by_content" / digest[:16])


def forget() -> None:
    """Drop this process's copy of the cache: the next hash reads the cache file again (as a new
    process would)."""
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
