"""Run identity (core/identity/fingerprint.py, core/identity/hashes.py): the classes of docs/reliability.md's
"Run identity" table, content hashes and their cache, and the datasets cache keyed by content.
The resumes, evals and exports that use them: tests/test_resume_identity.py (classification) and
tests/test_adapter_base.py (causal LM); the sweep row: tests/test_sweeps.py ("fixed overrides").
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.core.identity import hashes as file_hashes
from {{ cookiecutter.package_name }}.core.identity.fingerprint import command_line_value, resume_class
from {{ cookiecutter.package_name }}.tasks import tasks


@pytest.fixture(autouse=True)
def own_hash_cache(tmp_path, monkeypatch):
    """Each test hashes into a cache file of its own (not the user's ~/.cache)."""
    monkeypatch.setenv(file_hashes.CACHE_ENV, str(tmp_path / "file_hashes.json"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ the table's classes
@pytest.mark.parametrize(
    "key, kind",
    [
        ("task.name", "refused"),
        ("model.config.num_hidden_layers", "refused"),
        ("peft.alpha", "refused"),
        ("data.max_length", "refused"),
        ("batch.global_batch_size", "refused"),
        ("trainer.precision", "refused"),
        ("data.splits.train (content)", "refused"),
        ("labels", "refused"),
        ("trainer.max_steps", "allowed"),
        ("trainer.max_epochs", "allowed"),
        ("logger.wandb.project", "allowed"),
        ("callbacks.progress_bar.refresh_rate", "allowed"),
        ("trainer.devices", "allowed"),
        ("trainer.strategy", "allowed"),
        ("data.splits.test (content)", "allowed"),
        ("optimizer.lr", "allow_changed"),
        ("optimizer.weight_decay", "allow_changed"),
        ("lr_schedule.warmup_ratio", "allow_changed"),
        ("seed", "allow_changed"),
        ("data.group_by_length", "allow_changed"),
        ("batch.micro_batch_size", "allow_changed"),
        ("paths.output_dir", "ignored"),
        ("data.splits.train", "ignored"),
        ("batch.accumulate_grad_batches", "ignored"),
    ],
)
def test_each_key_falls_in_its_row_of_the_table(key, kind):
    assert resume_class(key) == kind


def test_each_task_declares_keys_a_resume_refuses():
    for task in tasks().values():
        assert task.identity_keys["model"] or task.identity_keys["data"], task.name
        for pattern in task.resume_refuses():
            assert resume_class(pattern) == "allow_changed", pattern  # (refused only through the task)
            assert resume_class(pattern, task.resume_refuses()) == "refused"


def test_the_command_line_value_is_read_from_hydras_overrides():
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
        cfg = compose("eval", ["model.name_or_path=/somewhere/base", "seed=3"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        assert command_line_value("model.name_or_path") == "/somewhere/base"
        assert command_line_value("model.tokenizer") is None
    finally:
        HydraConfig.instance().cfg = None


# ------------------------------------------------------------------ hashing and the datasets cache
def test_a_file_rewritten_with_its_mtime_kept_is_read_as_its_new_rows(tmp_path):
    """``cp -p``/``rsync -t`` keep the mtime: datasets' cache (path + mtime) served the old rows."""
    from {{ cookiecutter.package_name }}.core.data.loading import load_split

    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "a good film,positive\n" * 64)
    stat = path.stat()
    assert len(load_split("train", str(path), None, None, str(tmp_path / "cache"))) == 64
    path.write_text("text,label\n" + "a dull film,negative\n" * 80)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert len(load_split("train", str(path), None, None, str(tmp_path / "cache"))) == 80


def test_an_unchanged_file_is_hashed_once_across_processes_and_a_rewritten_one_again(tmp_path, monkeypatch):
    reads = []
    real = file_hashes.hashlib.file_digest
    monkeypatch.setattr(file_hashes.hashlib, "file_digest", lambda file, name: reads.append(file.name) or real(file, name))
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 1000)
    first = file_hashes.file_sha256(path)
    assert first == sha256(path) and file_hashes.file_sha256(path) == first and len(reads) == 1
    file_hashes.forget()  # a new process: the cache file is read
    assert file_hashes.file_sha256(path) == first and len(reads) == 1
    stat = path.stat()
    path.write_bytes(b"y" * 1000)  # same size, mtime put back (cp -p): ctime moved
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_hashes.file_sha256(path) == sha256(path) != first and len(reads) == 2


def test_a_folder_whose_files_changed_is_named_with_the_differing_files(tmp_path):
    from {{ cookiecutter.package_name }}.core.identity.fingerprint import file_changes, path_entry

    folder = tmp_path / "train"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(name)
    before = {"data.splits.train": path_entry(str(folder))}
    (folder / "b.txt").write_text("other")
    (folder / "c.txt").write_text("new")
    (change,) = file_changes(before, {"data.splits.train": path_entry(str(folder))})
    assert change.key == "data.splits.train (content)" and change.new.endswith("(differing files: b.txt, c.txt)"), change


def test_a_folder_of_many_files_is_hashed_with_one_write_of_the_cache(tmp_path, monkeypatch):
    """A corpus folder of .txt documents: one cache write for the folder (not one per file, each
    rewriting the whole growing cache), and every file's digest right."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for index in range(50):
        (folder / f"doc{index:02d}.txt").write_text(f"document {index}")
    writes = []
    save = file_hashes._save_cache
    monkeypatch.setattr(file_hashes, "_save_cache", lambda: writes.append(1) or save())
    digests = file_hashes.folder_sha256(folder)
    assert len(writes) == 1 and digests == {path.name: sha256(path) for path in sorted(folder.iterdir())}
    assert file_hashes.folder_sha256(folder) == digests and len(writes) == 1  # (all cached: no write)


def fake_hub_cache(cache: Path, repo: str, snapshots: dict[str, Path | None], main: str) -> Path:
    """A Hugging Face cache as huggingface_hub lays it out (no blobs needed): ``models--org--name/refs/main`` naming one of
    ``snapshots`` (commit -> a folder to copy in, or ``None`` for a config.json of its own)."""
    import shutil

    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    for commit, source in snapshots.items():
        folder = repo_dir / "snapshots" / commit
        if source is None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps({"commit": commit}))
        else:
            shutil.copytree(source, folder, dirs_exist_ok=True)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(main)
    return repo_dir


def test_a_hub_id_is_its_cached_revision_in_identity_and_cache_keys(tmp_path, monkeypatch, caplog):
    """A Hub name stood for whatever its cache held: a moved refs/main resumed (and read cached reference tables) silently."""
    import logging

    import huggingface_hub

    from {{ cookiecutter.package_name }}.core.identity.fingerprint import base_problem, file_changes, hub_or_files, path_entry, resume_problems

    first, second = "a" * 40, "b" * 40
    repo = fake_hub_cache(tmp_path, "org/tiny", {first: None, second: None}, main=first)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = {"model.name_or_path": path_entry("org/tiny")}
    key_before = hub_or_files("org/tiny")
    assert before["model.name_or_path"] == {"given": "org/tiny", "hub": True, "revision": first}
    (repo / "refs" / "main").write_text(second)
    after = {"model.name_or_path": path_entry("org/tiny")}
    assert hub_or_files("org/tiny") != key_before  # the reference log-prob table of the old revision is not read
    changes = file_changes(before, after)
    assert [change.key for change in changes] == ["model.name_or_path@revision"]
    problems, _ = resume_problems(changes, (), [], "ckpt_path='last.ckpt'")
    assert f"revision {first}" in problems[0] and f"revision {second}" in problems[0]
    assert "fix: resume.allow_changed=[model.name_or_path@revision]" in problems[0]
    assert resume_problems(changes, (), ["model.name_or_path@revision"], "x")[0] == []
    problem = base_problem(before["model.name_or_path"], "org/tiny", "ckpt_path='a.ckpt'")
    assert f"now resolves it to revision {second}" in problem and f"--revision {first}" in problem
    with caplog.at_level(logging.WARNING):  # a checkpoint of before revisions were recorded: warned, not refused
        assert file_changes({"model.name_or_path": {"given": "org/tiny", "hub": True}}, after) == []
    assert "(no revision recorded): whether its weights changed since cannot be checked" in caplog.text
    assert path_entry("org/not-cached") == {"given": "org/not-cached", "hub": True}
