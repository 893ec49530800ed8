"""A CSV log that survives kills and continues across resumes, on Lightning's public logger API.

Each launch of a run writes its own file, in Lightning's versioned folders:
``<run>/csv/version_0/metrics.csv`` for the first launch, ``version_1`` for the first resume, and
so on (Lightning's ``CSVLogger`` with ``version: null``).  :func:`.metrics_csv.read_metrics` merges them
by step: a later launch's rows replace those of earlier launches from its first step on (a resumed
run logs again the steps the killed one logged after its last checkpoint).  No file is ever
rewritten by a later launch, so a kill can cost at most the rows not yet written.

Rows are kept in memory and appended, the file closed (flushed to the OS), at every ``save``:
every ``flush_logs_every_n_steps`` logged steps (10 in ``configs/logger/csv.yaml``: opening and
closing the file every step cost 0.7 ms a step, ``docs/performance.md``) and before every
checkpoint.  A new column rewrites the launch's file through a temporary file renamed into place
(Lightning's own writer rewrites it in place, which a kill can cut short).  And
:class:`StepLogBeforeCheckpoint` writes a step's row, and every row still in memory, before any
checkpoint is saved: a SIGKILL loses only rows of steps after the last checkpoint, which the
resumed run trains and logs again, so no step is lost across a resume.
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
    """Whether ``row`` has every key of ``part`` with the same value (NaN equal to NaN: a skipped
    non-finite step logs a NaN loss)."""

    def same(a: object, b: object) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    return all(key in row and same(row[key], value) for key, value in part.items())


class _AtomicWriter(ExperimentWriter):
    """Lightning's writer with atomic header rewrites, and without a second copy of a row that
    :meth:`write_now` already wrote."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.written_early: tuple[int, dict] | None = None
        self.last_logged: tuple[int | None, dict] = (None, {})

    def write_now(self, metrics: dict, step: int) -> None:
        """Write one step's row at once (see :class:`StepLogBeforeCheckpoint`), unless the same
        values were just logged for that step; the same values for the same step, when Lightning
        delivers them afterwards, are not written twice."""
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
    """``lightning.pytorch.loggers.CSVLogger`` writing one file per launch, each kill-safe (see
    the module docstring); :func:`.metrics_csv.read_metrics` reads a run's launches as one log; its
    ``hparams.yaml`` with secrets masked (:mod:`..run.secrets`).  Same
    arguments; ``save_dir`` must be a local path, and ``version`` should stay ``None`` (a fixed
    version would make every launch overwrite the same file).

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
    """Write an optimizer step's row to the CSV log *before* a checkpoint of that step is saved,
    with every row still held in memory (``flush_logs_every_n_steps``) before any checkpoint.

    The module sends a step's row to the loggers in its ``on_train_batch_end``, after the
    callbacks' (:meth:`..models.base.HFModule.on_train_batch_end`, where Lightning would send
    ``self.log``'s rows), and ``ModelCheckpoint`` saves inside the callbacks': a kill between the
    two would leave a checkpoint of step ``k`` and no row for ``k``, which the resumed run
    (starting after ``k``) never writes.  So when a checkpoint is saved between an optimizer step
    and the delivery of its row (``on_save_checkpoint``), this callback writes the row first: the
    module's :meth:`..models.base.HFModule.step_row`, which holds what will be sent.  The logger
    then skips the identical delivery.  Other loggers (W&B) get the delivery only.
    """

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
