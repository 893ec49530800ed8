"""A CSV log that survives kills and continues across resumes, on Lightning's public logger API.

Each launch writes its own ``<run>/csv/version_<n>/metrics.csv``; :func:`.metrics_csv.read_metrics` merges them by step,
a later launch's rows replacing earlier ones from its first step on.  Rows are appended every ``flush_logs_every_n_steps``
and before every checkpoint (:class:`StepLogBeforeCheckpoint`), so a SIGKILL loses only steps the resumed run logs again.
A new column rewrites the file atomically (Lightning's writer rewrites it in place).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from ..models.contract import TrainedModule
from ..run.entry import atomic_write_path
from ..run.secrets import MaskedHyperparameters


def _contains(row: dict, part: dict) -> bool:
    """Whether ``row`` has every key of ``part`` with the same value (NaN equal to NaN: a skipped step logs NaN)."""

    def same(a: object, b: object) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    return all(key in row and same(row[key], value) for key, value in part.items())


class _AtomicWriter(ExperimentWriter):
    """Lightning's writer with atomic header rewrites, and without a second copy of a row :meth:`write_now` wrote."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.written_early: tuple[int, dict] | None = None
        self.last_logged: tuple[int | None, dict] = (None, {})

    def write_now(self, metrics: dict, step: int) -> None:
        """Write one step's row at once, unless just logged; Lightning's later delivery of it is not written twice."""
        if self.last_logged[0] != step or not _contains(self.last_logged[1], metrics):
            self.log_metrics(metrics, step)
            self.written_early = (step, dict(metrics))
        self.save()

    def log_metrics(self, metrics_dict: dict, step: int | None = None) -> None:
        values = {key: value.item() if isinstance(value, torch.Tensor) else value for key, value in metrics_dict.items()}
        if self.written_early is not None and self.written_early[0] == step and _contains(values, self.written_early[1]):
            early, self.written_early = self.written_early[1], None  # the module's delivery of the row written early
            values = {key: value for key, value in values.items() if key not in early}
            if not values:
                return
        super().log_metrics(values, step)
        self.last_logged = (step, values)

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        new_keys = set().union(*self.metrics) - set(self.metrics_keys)
        keys = sorted(set(self.metrics_keys) | new_keys)
        exists = path.is_file() and path.stat().st_size > 0
        if exists and new_keys:
            with path.open(newline="") as file:
                rows = list(csv.DictReader(file))
            with atomic_write_path(path) as partial, partial.open("w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=keys)
                writer.writeheader()
                writer.writerows(rows)
        self.metrics_keys = keys
        with path.open("a" if exists else "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []


class ResumableCSVLogger(MaskedHyperparameters, CSVLogger):
    """Lightning's ``CSVLogger`` writing one kill-safe file per launch, ``hparams.yaml`` with secrets masked.  Keep
    ``version`` ``None`` (a fixed one would make every launch overwrite the same file).

    Raises:
        ValueError: ``save_dir`` is a remote URL.
    """

    def __init__(self, save_dir: str, **kwargs) -> None:
        if "://" in str(save_dir):
            raise ValueError(f"logger.csv.save_dir={save_dir!r}: ResumableCSVLogger writes local files only; fix: a local folder")
        super().__init__(save_dir, **kwargs)
        self.writer: _AtomicWriter | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> _AtomicWriter:
        if self.writer is None:
            Path(self.root_dir).mkdir(parents=True, exist_ok=True)
            self.writer = _AtomicWriter(log_dir=self.log_dir)
        return self.writer

    def finalize(self, status: str) -> None:
        if self.writer is not None:  # (on a rank that wrote nothing there is nothing to save)
            self.save()


class StepLogBeforeCheckpoint(L.Callback):
    """Write a step's row (and every row in memory) to the CSV log *before* a checkpoint of that step: ``ModelCheckpoint``
    saves before the module sends the row, and a kill between would lose row ``k`` for good (a resume starts after it)."""

    def __init__(self) -> None:
        self.stepped = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        self.stepped = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.stepped = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stepped = False  # validation runs after Lightning logged the step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stepped = False

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # Only a row the module will send (HFModule.sends_step_row) is written early.
        sent = self.stepped and isinstance(pl_module, TrainedModule) and pl_module.sends_step_row()
        row = pl_module.step_row() if sent else None
        for logger in trainer.loggers:
            if not isinstance(logger, ResumableCSVLogger):
                continue
            if row is not None:
                step, metrics = row
                logger.experiment.write_now(metrics, step)  # (the rows still in memory are written too)
            else:
                logger.save()  # the rows in memory (flush_logs_every_n_steps), before the checkpoint
        self.stepped = False
