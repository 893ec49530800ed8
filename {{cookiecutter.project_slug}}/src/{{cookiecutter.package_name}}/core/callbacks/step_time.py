"""The measured step time beside the planner's prediction (:mod:`..memory.steptime`), once a run is warm: logs
``time/step_ms`` (wall-clock ms per optimizer step) and ``time/predicted_step_ms``, and prints their ratio."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info


class StepTimeCheck(L.Callback):
    """Time optimizer steps ``skip + 1 .. skip + steps`` of this fit (a resumed one too) and log them beside ``predicted_ms``.

    Raises:
        ValueError: ``predicted_ms`` <= 0, ``skip`` < 0 or ``steps`` < 1.
    """

    def __init__(self, predicted_ms: float, skip: int = 2, steps: int = 5) -> None:
        if predicted_ms <= 0 or skip < 0 or steps < 1:
            raise ValueError(f"StepTimeCheck: predicted_ms={predicted_ms}, skip={skip}, steps={steps}: need > 0, >= 0, >= 1")
        self.predicted_ms, self.skip, self.steps = predicted_ms, skip, steps
        self.first: int | None = None
        self.start: float | None = None
        self.measured_ms: float | None = None

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.first is None:
            self.first = step - 1 if step else 0  # (the step this batch may just have completed is the first timed from)
        done = step - self.first
        if done == self.skip and self.start is None:
            self.start = self._now(trainer)
        elif self.start is not None and self.measured_ms is None and done == self.skip + self.steps:
            self.measured_ms = 1e3 * (self._now(trainer) - self.start) / self.steps
            for logger in trainer.loggers:  # (once: self.log would repeat the row at the next logged step)
                logger.log_metrics({"time/step_ms": self.measured_ms, "time/predicted_step_ms": self.predicted_ms}, step=step)
            rank_zero_info(
                f"step time over steps {self.first + self.skip + 1}-{step}: measured {self.measured_ms:.1f} ms, "
                f"predicted {self.predicted_ms:.1f} ms (measured / predicted = {self.measured_ms / self.predicted_ms:.2f})"
            )
