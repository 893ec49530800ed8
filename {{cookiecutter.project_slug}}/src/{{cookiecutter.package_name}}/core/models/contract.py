"""What core's callbacks read of the module they train, implemented by :class:`.base.HFModule`; a plain LightningModule
gets Lightning's own paths (``self.log``, no step row)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .inputs import ModelInputs


@runtime_checkable
class TrainedModule(Protocol):
    """The module's side of the callbacks' contract."""

    inputs: ModelInputs | None
    skipped_steps: int  # updates a non-finite loss skipped (the LR schedule waits)
    step_metrics: dict[str, torch.Tensor | float]  # the latest optimizer step's row

    def log_step_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Put a metric of the optimizer step being taken in its row."""

    def step_row(self) -> tuple[int, dict[str, float]]:
        """``(step, metrics)``: the latest optimizer step's row, as the loggers get it."""

    def sends_step_row(self) -> bool:
        """Whether the latest optimizer step's row goes to the loggers (Lightning's pace)."""
