"""GPU memory, utilisation, temperature and power, logged every N optimizer steps."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger(__name__)

GIB = 1024**3

try:  # nvidia-ml-py is a core dependency; without it torch.cuda.utilization & co. raise ModuleNotFoundError
    from pynvml import NVMLError

    NVML_ERRORS: tuple[type[Exception], ...] = (ImportError, RuntimeError, NVMLError)
except ImportError:
    NVML_ERRORS = (ImportError, RuntimeError)


def memory_stats(device: torch.device) -> dict[str, float]:
    """PyTorch's view of ``device``'s memory in GiB: allocated (live tensors), reserved (caching allocator; ``nvidia-smi``
    adds the CUDA context, ~0.3-0.5 GiB) and peak allocated since start (the figure to compare with the budget)."""
    return {
        "gpu/mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "gpu/mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "gpu/mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


# Metric -> reader; torch.cuda's NVML wrappers map torch's device index to NVML's (which ignores CUDA_VISIBLE_DEVICES).
NVML_READINGS = {
    "gpu/utilization_pct": lambda device: torch.cuda.utilization(device),  # % of time a kernel ran, last sample period
    "gpu/temperature_c": lambda device: torch.cuda.temperature(device),  # GPU die, degrees C
    "gpu/power_w": lambda device: torch.cuda.power_draw(device) / 1000,  # NVML reports milliwatts
}


def nvml_stats(device: torch.device, skip: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, float], dict[str, str]]:
    """Read :data:`NVML_READINGS` of ``device`` but ``skip``; return ``(metrics, errors)``: the readings that worked,
    and why each other failed (no NVML, no driver, a reading the GPU lacks)."""
    metrics, errors = {}, {}
    for name, read in NVML_READINGS.items():
        if name in skip:
            continue
        try:
            metrics[name] = float(read(device))
        except NVML_ERRORS as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return metrics, errors


class GPUStats(L.Callback):
    """Every ``every_n_steps`` optimizer steps, log :func:`memory_stats` and :func:`nvml_stats` of the trainer's device.

    ``needs_cuda``: ``train`` leaves it out of a non-CUDA run. Built by hand it degrades instead: on a CPU it logs
    nothing, and a failing reading is dropped for the run; either way it says why once (rank 0).

    Raises:
        ValueError: ``every_n_steps`` < 1.
    """

    needs_cuda = True

    def __init__(self, every_n_steps: int) -> None:
        if every_n_steps < 1:
            raise ValueError(f"callbacks.gpu_stats.every_n_steps={every_n_steps} must be >= 1 (optimizer steps between readings)")
        self.every_n_steps = every_n_steps
        self.device: torch.device | None = None
        self._last_step = -1
        self._failed: set[str] = set()  # NVML readings dropped for the rest of the run
        self._said_no_gpu = False  # setup runs for fit and again for test: say it once

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.device = trainer.strategy.root_device
        if self.device.type != "cuda" and not self._said_no_gpu:
            self._said_no_gpu = True
            _say(logging.INFO, f"GPUStats: training on {self.device.type}, not a CUDA GPU: no gpu/* metrics are logged")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.device is None or self.device.type != "cuda" or step == self._last_step or step % self.every_n_steps:
            return  # no GPU, or no optimizer step since the last reading (gradient accumulation), or not due
        self._last_step = step
        metrics = memory_stats(self.device)
        readings, errors = nvml_stats(self.device, skip=self._failed)
        metrics.update(readings)
        self._report(errors)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _report(self, errors: dict[str, str]) -> None:
        """Drop the failed readings for good, and say once per reason which ones and why."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in errors.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            _say(logging.WARNING, f"GPUStats: not logging {', '.join(names)} for the rest of the run: NVML failed ({reason})")
        self._failed.update(errors)


@rank_zero_only
def _say(level: int, message: str) -> None:
    log.log(level, message)
