"""What each logger receives: W&B and TensorBoard take the per-step rows at their own
``log_every_n_steps`` (every other row whatever its step); callbacks that do nothing on this
hardware are left out of the run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

from {{ cookiecutter.package_name }}.callbacks.build import instantiate_callbacks
from {{ cookiecutter.package_name }}.callbacks.gpu_stats import GPUStats
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.utils.instantiate import instantiate_loggers
from {{ cookiecutter.package_name }}.utils.loggers import TensorBoardLogger, WandbLogger, skips_row

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


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_a_bad_period_is_refused_with_the_field_and_the_fix(value, tmp_path):
    with pytest.raises(ConfigError, match=r"logger\.wandb\.log_every_n_steps=.*fix: an integer >= 1"):
        WandbLogger(save_dir=str(tmp_path), offline=True, log_every_n_steps=value)


def test_the_default_loggers_keep_every_step_in_the_csv_and_every_tenth_in_wandb(tmp_path):
    cfg = compose_config("train", [*common_overrides(tmp_path / "run"), "logger=[csv,wandb]", "logger.wandb.mode=disabled"])
    assert cfg.trainer.log_every_n_steps == 1 and cfg.logger.wandb.log_every_n_steps == 10
    wandb = next(logger for logger in instantiate_loggers(cfg) if isinstance(logger, WandbLogger))
    assert wandb.log_every_n_steps == 10
    wandb.experiment.finish()


def test_gpu_stats_is_left_out_of_a_run_without_a_cuda_gpu(tmp_path, monkeypatch):
    on_cpu = compose_config("train", common_overrides(tmp_path / "run"))  # trainer=cpu
    assert not any(isinstance(c, GPUStats) for c in instantiate_callbacks(on_cpu))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = compose_config("train", [*common_overrides(tmp_path / "run"), "trainer=default"])
    assert any(isinstance(c, GPUStats) for c in instantiate_callbacks(on_gpu))
