"""Run identity on a resume (classification): one test per row of docs/reliability.md's "Run
identity" table, and per case that resumed with another result and exit 0 (another tokenizer of the
same size, another lr or max_length, a data file with other rows).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.identity import hashes as file_hashes
from {{ cookiecutter.package_name }}.core.identity.fingerprint import IDENTITY_FILE
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config, tiny_overrides, toy_rows, write_csv
from .processes import step_losses
from .test_run_identity import own_hash_cache, sha256  # noqa: F401 (an autouse fixture)


# ------------------------------------------------------------------ a short classification run
@pytest.fixture(scope="module")
def run(tokenizer_dir, toy_data, tmp_path_factory):
    """A 4-step tiny-BERT run on copies of the toy data and tokenizer (tests change copies of them)."""
    folder = tmp_path_factory.mktemp("identity")
    data = {split: Path(shutil.copy(path, folder / path.name)) for split, path in toy_data.items()}
    tokenizer = Path(shutil.copytree(tokenizer_dir, folder / "tokenizer"))
    run_dir = folder / "run"
    base = tiny_overrides(tokenizer, data, run_dir) + [
        "trainer.max_steps=4",
        "batch.micro_batch_size=8",
        "test_after_fit=false",
        "callbacks.progress_bar=null",
    ]
    os.environ[file_hashes.CACHE_ENV] = str(folder / "file_hashes.json")
    try:
        metrics = train(compose_config("train", base))
    finally:
        del os.environ[file_hashes.CACHE_ENV]
    return SimpleNamespace(dir=run_dir, base=base, data=data, tokenizer=tokenizer, metrics=metrics)


def resume(run, tmp_path: Path, *overrides: str) -> tuple[dict, Path]:
    """Resume a copy of ``run``'s folder (``ckpt_path=last``) with ``overrides``."""
    target = tmp_path / "run"
    shutil.copytree(run.dir, target)
    kept = [o for o in run.base if not o.startswith("paths.output_dir=")]
    cfg = compose_config("train", [*kept, f"paths.output_dir={target}", "ckpt_path=last", *overrides])
    return train(cfg), target


def test_the_run_folder_and_every_checkpoint_hold_the_identity(run):
    identity = json.loads((run.dir / IDENTITY_FILE).read_text())
    stored = torch.load(run.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["identity"]
    assert stored == identity
    assert identity["config"]["data"]["max_length"] == 32 and identity["config"]["optimizer"]["lr"] > 0
    assert "_target_" not in json.dumps(identity)  # (a checkpoint holds no class path)
    files = identity["files"]
    for split, path in run.data.items():
        entry = files[f"data.splits.{split}"]
        assert entry["sha256"] == sha256(path) and entry["resolved"] == str(path.resolve())
    assert files["model.tokenizer"]["files"]["tokenizer.json"] == sha256(run.tokenizer / "tokenizer.json")


# ------------------------------------------------------------------ resume: refused
@pytest.mark.parametrize(
    "override, key",
    [
        ("data.max_length=16", "data.max_length"),
        ("batch.global_batch_size=8", "batch.global_batch_size"),
        ("model.config.hidden_size=32", "model.config.hidden_size"),
        ("peft=lora", "peft.method"),
        ("precision=bf16-true", "trainer.precision"),
        ("data.label_column=sentiment", "data.label_column"),  # the classification task's model key
    ],
)
def test_a_resume_that_changes_what_the_run_is_made_of_is_refused_before_anything_loads(run, tmp_path, override, key, monkeypatch):
    import {{ cookiecutter.package_name }}.train as train_module

    monkeypatch.setattr(train_module, "build_module", lambda cfg: pytest.fail("the module was built"))
    with pytest.raises(ConfigError) as error:
        resume(run, tmp_path, override, "resume.allow_changed=[optimizer.lr]")
    message = str(error.value)
    assert f"{key}: " in message and "start a new run (drop ckpt_path)" in message, message
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes() == (run.dir / "checkpoints" / "last.ckpt").read_bytes()


def test_a_misspelt_allow_changed_key_is_refused_naming_the_close_one(run, tmp_path):
    with pytest.raises(ConfigError, match=r"'optimzer.lr', which names no key of the run's config; did you mean optimizer.lr\?"):
        resume(run, tmp_path, "resume.allow_changed=[optimzer.lr]")


def test_allow_changed_cannot_allow_a_refused_key(run, tmp_path):
    with pytest.raises(ConfigError, match=r"resume.allow_changed contains 'data.max_length', which a resume never changes"):
        resume(run, tmp_path, "data.max_length=16", "resume.allow_changed=[data.max_length]")


@pytest.mark.parametrize("what", ["tokenizer", "data"])
def test_a_resume_on_other_files_is_refused_before_the_weights_load(run, tmp_path, what, monkeypatch):
    """The same vocabulary size, other ids (two words' ids swapped); a train file with
    other rows: named by their key, both hashes and both paths."""
    if what == "tokenizer":
        changed = Path(shutil.copytree(run.tokenizer, tmp_path / "tokenizer"))
        spec = json.loads((changed / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        first, second = list(vocab)[-2:]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (changed / "tokenizer.json").write_text(json.dumps(spec))
        override, key = f"model.tokenizer={changed}", "model.tokenizer (content)"
    else:
        changed = write_csv(tmp_path / "train.csv", toy_rows(96, seed=5))
        override, key = f"data.splits.train={changed}", "data.splits.train (content)"
    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule

    monkeypatch.setattr(SequenceClassificationModule, "configure_model", lambda self: pytest.fail("weights were built"))
    with pytest.raises(ConfigError) as error:
        resume(run, tmp_path, override)
    message = str(error.value)
    assert key in message and str(changed.resolve()) in message and "sha256 " in message, message


def test_a_moved_data_file_with_the_same_content_resumes(run, tmp_path):
    moved = Path(shutil.copy(run.data["train"], tmp_path / "moved.csv"))
    metrics, target = resume(run, tmp_path, f"data.splits.train={moved}", "trainer.max_steps=5")
    assert max(step_losses(target)) == 4  # (steps 0-4)
    assert json.loads((target / IDENTITY_FILE).read_text())["files"]["data.splits.train"]["resolved"] == str(moved.resolve())


# ------------------------------------------------------------------ resume: allowed, and with the flag
def test_a_longer_run_resumes_and_says_it_is_an_extended_run_in_the_log_and_metrics(run, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        metrics, target = resume(run, tmp_path, "trainer.max_steps=6", "logger=none", "callbacks.gpu_stats.every_n_steps=5")
    assert "resuming with trainer.max_steps: 4 -> 6: an extended run, not the uninterrupted longer one" in caplog.text
    assert metrics["val/acc"] is not None
    written = json.loads((target / "metrics.json").read_text())
    assert written["extended"] == {"from_step": 4, "trainer.max_steps": ["4", "6"]}
    again, _ = resume(run, tmp_path / "same", "logger=none")
    assert "extended" not in again


def test_a_checkpoint_copied_to_another_folder_names_no_best_of_the_old_folder(run, tmp_path):
    """Lightning restores the best checkpoint's path of the folder the checkpoint was written in: a resume elsewhere with no
    validation left to run reported (and would have tested) that other run's file."""
    kept = [o for o in run.base if not o.startswith("paths.output_dir=")]
    original = tmp_path / "original"
    first = train(compose_config("train", [*kept, f"paths.output_dir={original}", "trainer.val_check_interval=4"]))
    assert Path(first["best_checkpoint"]).parent == original / "checkpoints"
    for name, copied in (("folder", None), ("alone", "copied.ckpt")):
        target = tmp_path / name
        if copied is None:  # the whole folder copied: its own copy of the best stands for it
            shutil.copytree(original, target)
            ckpt = target / "checkpoints" / "last.ckpt"
        else:
            (target / "checkpoints").mkdir(parents=True)
            ckpt = Path(shutil.copy(original / "checkpoints" / "last.ckpt", target / "checkpoints" / copied))
        cfg = compose_config("train", [*kept, f"paths.output_dir={target}", "trainer.val_check_interval=4", f"ckpt_path={ckpt}"])
        best = train(cfg)["best_checkpoint"]
        assert best == (str(target / "checkpoints" / Path(first["best_checkpoint"]).name) if copied is None else None), best


def test_another_lr_needs_allow_changed_and_then_resumes(run, tmp_path):
    with pytest.raises(ConfigError) as error:
        resume(run, tmp_path, "optimizer.lr=0.01", "seed=7")
    message = str(error.value)
    assert "optimizer.lr: 5e-05 -> 0.01" in message and "resume.allow_changed=[data.seed,optimizer.lr,seed]" in message, message
    shutil.rmtree(tmp_path / "run")
    metrics, target = resume(run, tmp_path, "optimizer.lr=0.01", "trainer.max_steps=5", "resume.allow_changed=[optimizer.lr]")
    assert max(step_losses(target)) == 4
    stored = torch.load(target / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["identity"]
    assert stored["config"]["optimizer"]["lr"] == 0.01  # (the next resume compares with what this launch ran)


def test_a_checkpoint_without_an_identity_resumes_with_one_warning(run, tmp_path, caplog):
    target = tmp_path / "run"
    shutil.copytree(run.dir, target)
    checkpoint = torch.load(target / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    del checkpoint["identity"]
    torch.save(checkpoint, target / "checkpoints" / "last.ckpt")
    kept = [o for o in run.base if not o.startswith("paths.output_dir=")]
    with caplog.at_level(logging.WARNING):
        train(compose_config("train", [*kept, f"paths.output_dir={target}", "ckpt_path=last", "trainer.max_steps=5", "optimizer.lr=1"]))
    assert [r.message for r in caplog.records if "cannot be checked" in r.message] == [
        f"ckpt_path={str(target / 'checkpoints' / 'last.ckpt')!r} was written before checkpoints recorded their run's identity: "
        "its config, data and model cannot be checked"
    ]
