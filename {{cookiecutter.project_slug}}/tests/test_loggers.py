"""What each logger receives: W&B and TensorBoard take the per-step rows at their own
``log_every_n_steps`` (every other row whatever its step); callbacks that do nothing on this
hardware are left out of the run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

from {{ cookiecutter.package_name }}.core.callbacks.build import instantiate_callbacks
from {{ cookiecutter.package_name }}.core.callbacks.gpu_stats import GPUStats
from {{ cookiecutter.package_name }}.core.config.instantiate import instantiate_loggers
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.loggers.trackers import TensorBoardLogger, WandbLogger, skips_row
from {{ cookiecutter.package_name }}.core.run.entry import close_loggers

from .conftest import common_overrides, compose_config


def test_only_per_step_rows_off_the_period_are_skipped():
    assert skips_row({"train/loss": 1.0, "train/lr": 0.1, "epoch": 0}, step=3, every_n_steps=10)
    assert not skips_row({"train/loss": 1.0}, step=20, every_n_steps=10)  # on the period
    assert not skips_row({"val/loss": 1.0, "val/acc": 0.5, "epoch": 0}, step=3, every_n_steps=10)  # validation: always
    assert not skips_row({"train/loss": 1.0, "perf/tokens_per_sec": 5.0}, step=3, every_n_steps=10)  # anything else: kept
    assert not skips_row({"train/acc": 0.9, "epoch": 1}, step=7, every_n_steps=10)  # epoch-end training metrics
    assert not skips_row({"train/loss": 1.0}, step=3, every_n_steps=1)
    assert not skips_row({"train/loss": 1.0}, step=None, every_n_steps=10)


def test_tensorboard_logs_every_nth_step_row_and_every_validation_row(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    received = []
    monkeypatch.setattr(LightningTensorBoardLogger, "log_metrics", lambda self, metrics, step=None: received.append((step, set(metrics))))
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb", log_every_n_steps=5)
    for step in range(12):
        logger.log_metrics({"train/loss": 1.0, "train/lr": 0.1, "epoch": 0}, step=step)
    logger.log_metrics({"val/acc": 0.5, "epoch": 0}, step=11)
    assert received == [(0, {"train/loss", "train/lr", "epoch"}), (5, {"train/loss", "train/lr", "epoch"}),
                        (10, {"train/loss", "train/lr", "epoch"}), (11, {"val/acc", "epoch"})]  # fmt: skip


def test_wandb_sends_the_rows_of_one_step_as_one_call(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(LightningWandbLogger, "log_metrics", lambda self, metrics, step=None: sent.append((step, dict(metrics))))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, log_every_n_steps=5)
    logger.log_metrics({"perf/tokens_per_sec": 9.0}, step=5)  # a callback's row of step 5
    logger.log_metrics({"train/loss": 1.0, "epoch": 0}, step=4)  # off the period: skipped, holds nothing back
    logger.log_metrics({"train/loss": 0.5, "train/lr": 0.1, "epoch": 0}, step=5)  # the step's own row
    assert sent == []  # held until a row of another step arrives
    logger.log_metrics({"val/acc": 0.75, "epoch": 0}, step=6)
    assert sent == [(5, {"perf/tokens_per_sec": 9.0, "train/loss": 0.5, "train/lr": 0.1, "epoch": 0})]
    logger.save()  # (Lightning calls it after its own rows; also before the run is finished)
    assert sent[1:] == [(6, {"val/acc": 0.75, "epoch": 0})]
    logger.log_metrics({"train/loss": 0.25, "epoch": 1}, step=10)
    logger.log_metrics({"test/acc": 0.5}, step=None)  # no step to merge on: the held row first, then this one
    assert sent[2:] == [(10, {"train/loss": 0.25, "epoch": 1}), (None, {"test/acc": 0.5})]
    logger.log_metrics({"train/loss": 0.125, "epoch": 1}, step=15)
    logger.finalize("success")
    assert sent[4:] == [(15, {"train/loss": 0.125, "epoch": 1})]


def test_the_last_step_row_off_the_period_is_sent_at_finalize(tmp_path, monkeypatch):
    # A run of 13 optimizer steps, period 5: rows 0, 5, 10 go out; the last one (12) at the end
    # of the fit (Lightning finalizes the loggers then), merged in W&B with a held row of its step.
    sent = []
    monkeypatch.setattr(LightningWandbLogger, "log_metrics", lambda self, metrics, step=None: sent.append((step, dict(metrics))))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, log_every_n_steps=5)
    for step in range(13):
        logger.log_metrics({"train/loss": 1.0 / (step + 1), "epoch": 0}, step=step)
    logger.log_metrics({"val/acc": 0.5, "epoch": 0}, step=12)
    logger.finalize("success")
    assert [step for step, _ in sent] == [0, 5, 10, 12]
    assert sent[-1] == (12, {"val/acc": 0.5, "epoch": 0, "train/loss": 1.0 / 13})
    logger.finalize("success")  # (again after the test): nothing more
    logger.log_metrics({"train/loss": 0.1, "epoch": 1}, step=15)  # on the period: nothing left out
    logger.finalize("success")
    assert [step for step, _ in sent] == [0, 5, 10, 12, 15]


def test_tensorboard_sends_the_last_step_row_off_the_period_at_finalize(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    received = []
    monkeypatch.setattr(LightningTensorBoardLogger, "log_metrics", lambda self, metrics, step=None: received.append(step))
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb", log_every_n_steps=5)
    for step in range(8):
        logger.log_metrics({"train/loss": 1.0, "epoch": 0}, step=step)
    logger.finalize("success")
    assert received == [0, 5, 7]


def test_close_loggers_sends_the_held_wandb_row_before_finishing_the_run(tmp_path, monkeypatch):
    import wandb

    sent, events = [], []
    monkeypatch.setattr(LightningWandbLogger, "log_metrics", lambda self, metrics, step=None: events.append("log") or sent.append(step))
    run = wandb.init(mode="disabled")
    finish = run.finish
    monkeypatch.setattr(run, "finish", lambda exit_code=0: events.append("finish"))
    try:
        logger = WandbLogger(save_dir=str(tmp_path), offline=True)
        logger.log_metrics({"train/loss": 1.0}, step=7)
        close_loggers([logger], failed=False)
    finally:
        finish()
    assert sent == [7] and events == ["log", "finish"]


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_a_bad_period_is_refused_with_the_field_and_the_fix(value, tmp_path):
    with pytest.raises(ConfigError, match=r"logger\.wandb\.log_every_n_steps=.*fix: an integer >= 1"):
        WandbLogger(save_dir=str(tmp_path), offline=True, log_every_n_steps=value)


def test_the_default_loggers_keep_every_step_in_the_csv_and_every_fiftieth_in_wandb(tmp_path):
    cfg = compose_config("train", [*common_overrides(tmp_path / "run"), "logger=[csv,wandb]", "logger.wandb.mode=disabled"])
    assert cfg.trainer.log_every_n_steps == 1 and cfg.logger.wandb.log_every_n_steps == 50
    wandb = next(logger for logger in instantiate_loggers(cfg) if isinstance(logger, WandbLogger))
    assert wandb.log_every_n_steps == 50
    wandb.experiment.finish()


def test_gpu_stats_is_left_out_of_a_run_without_a_cuda_gpu(tmp_path, monkeypatch):
    on_cpu = compose_config("train", common_overrides(tmp_path / "run"))  # trainer=cpu
    assert not any(isinstance(c, GPUStats) for c in instantiate_callbacks(on_cpu))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = compose_config("train", [*common_overrides(tmp_path / "run"), "trainer=default"])
    assert any(isinstance(c, GPUStats) for c in instantiate_callbacks(on_gpu))
