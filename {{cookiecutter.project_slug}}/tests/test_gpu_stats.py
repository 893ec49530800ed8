"""GPU stats callback: clean degradation on the CPU, and the right readings from a (faked) GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pynvml
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from {{ cookiecutter.package_name }}.core.callbacks import gpu_stats
from {{ cookiecutter.package_name }}.core.callbacks.gpu_stats import GIB, GPUStats, memory_stats, nvml_stats

from .conftest import RecordingLogger

CUDA0 = torch.device("cuda", 0)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda's memory counters and NVML (under torch.cuda's wrappers) answer fixed values."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # NVML index = torch index
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4.5 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 6 * GIB)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: f"gpu{index}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda handle: SimpleNamespace(gpu=87, memory=41))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda handle, sensor: 64)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda handle: 312_500)  # milliwatts


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == gpu_stats.__name__]


def test_readings_have_the_right_names_units_and_values(fake_gpu):
    assert memory_stats(CUDA0) == {"gpu/mem_allocated_gib": 3.0, "gpu/mem_reserved_gib": 4.5, "gpu/mem_peak_gib": 6.0}
    metrics, errors = nvml_stats(CUDA0)
    assert errors == {}
    assert metrics == {"gpu/utilization_pct": 87.0, "gpu/temperature_c": 64.0, "gpu/power_w": 312.5}


def run_steps(callback: GPUStats, steps: list[int]) -> RecordingLogger:
    """Drive the callback as a trainer on ``cuda:0`` would, one on_train_batch_end per global step."""
    logger = RecordingLogger()
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=CUDA0), loggers=[logger], global_step=0)
    callback.setup(trainer, None, "fit")
    for step in steps:
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, 0)
    return logger


def test_logs_every_n_optimizer_steps_once_per_step(fake_gpu):
    # 1, 1, 2, 2 ...: gradient accumulation calls the hook twice per optimizer step
    logger = run_steps(GPUStats(every_n_steps=2), [1, 1, 2, 2, 3, 3, 4, 4])
    assert [step for step, _ in logger.records] == [2, 4]
    assert set(logger.records[0][1]) == {
        "gpu/mem_allocated_gib",
        "gpu/mem_reserved_gib",
        "gpu/mem_peak_gib",
        "gpu/utilization_pct",
        "gpu/temperature_c",
        "gpu/power_w",
    }


def test_a_failing_nvml_reading_is_reported_once_and_the_rest_still_logged(fake_gpu, monkeypatch, caplog):
    def no_power_sensor(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", no_power_sensor)
    with caplog.at_level(logging.INFO, logger=gpu_stats.__name__):
        logger = run_steps(GPUStats(every_n_steps=1), [1, 2, 3])
    assert len(logger.records) == 3
    for _, metrics in logger.records:
        assert "gpu/power_w" not in metrics
        assert metrics["gpu/utilization_pct"] == 87.0 and metrics["gpu/mem_peak_gib"] == 6.0
    [message] = messages(caplog)
    assert "gpu/power_w" in message and "Not Supported" in message


def test_without_nvml_memory_is_still_logged_and_one_message_says_why(fake_gpu, monkeypatch, caplog):
    def driver_not_loaded():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", driver_not_loaded)
    with caplog.at_level(logging.INFO, logger=gpu_stats.__name__):
        logger = run_steps(GPUStats(every_n_steps=1), [1, 2])
    assert [sorted(metrics) for _, metrics in logger.records] == [["gpu/mem_allocated_gib", "gpu/mem_peak_gib", "gpu/mem_reserved_gib"]] * 2
    [message] = messages(caplog)  # one reason for all three readings: one message
    assert "gpu/utilization_pct, gpu/temperature_c, gpu/power_w" in message


def test_on_the_cpu_a_real_fit_logs_no_gpu_metrics_and_says_so_once(caplog):
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=2)
    logger = RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GPUStats(every_n_steps=1)],
        log_every_n_steps=1,
    )
    with caplog.at_level(logging.INFO, logger=gpu_stats.__name__):
        trainer.fit(Regression(), data)
        trainer.validate(Regression(), data, verbose=False)  # setup runs again: still one message
    assert trainer.global_step == 6
    assert not [key for _, metrics in logger.records for key in metrics if key.startswith("gpu/")]
    [message] = messages(caplog)
    assert "cpu" in message


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        GPUStats(every_n_steps=0)
