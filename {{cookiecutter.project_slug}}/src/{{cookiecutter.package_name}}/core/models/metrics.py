"""Metric updates gathered over micro-batches (the training metrics of a task read once, at the epoch's end)."""

from __future__ import annotations

import torch
from torchmetrics import MetricCollection


class PendingUpdates:
    """Training metric updates, applied every ``every`` micro-batches as one ``update`` of the gathered predictions and labels
    ``(B,)`` (and on :meth:`flush`): the same figures (sums over rows, read at the epoch's end) for far fewer small kernels."""

    def __init__(self, metrics: MetricCollection, every: int = 64) -> None:
        self.metrics, self.every = metrics, every
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        """Class ids ``(B,)`` (long) against labels ``(B,)``."""
        self.predictions.append(predictions)
        self.labels.append(labels)
        if len(self.predictions) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.predictions:
            self.metrics.update(torch.cat(self.predictions), torch.cat(self.labels))
            self.predictions, self.labels = [], []
