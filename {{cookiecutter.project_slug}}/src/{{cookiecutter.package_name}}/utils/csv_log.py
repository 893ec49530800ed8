"""A CSV logger whose file survives kills and continues across resumes.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts, so a resumed run
would lose everything logged before the kill; and it rewrites the whole file in place when a new
column appears, which a kill can cut short.  :class:`ResumableCSVLogger` keeps the file, drops
the rows a resumed run is about to log again (those from the resume step on, which the killed
run logged after its last checkpoint), and rewrites only through a temporary file renamed into
place.  Rows are appended and the file closed (flushed to the OS) at every ``save``; with
``flush_logs_every_n_steps: 1`` that is every logged step, and :class:`StepLogBeforeCheckpoint`
writes a step's row before that step's checkpoint, so a SIGKILL loses no row that a resume
would not write again.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import lightning as L
from lightning.fabric.loggers.csv_logs import _ExperimentWriter as _FabricWriter
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from .run import atomic_write_path


def _same(a: dict, b: dict) -> bool:
    """Equal metric dicts, NaN equal to NaN (a skipped non-finite step logs a NaN loss)."""
    return a.keys() == b.keys() and all(x == y or (x != x and y != y) for x, y in ((a[k], b[k]) for k in a))


class _ResumableWriter(ExperimentWriter):
    """Lightning's writer, minus the delete-on-start, with atomic rewrites and resume trimming."""

    def __init__(self, log_dir: str) -> None:
        self.hparams = {}
        self.metrics, self.metrics_keys = [], []
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._fs = None  # local files only (ResumableCSVLogger refuses remote paths)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._trimmed = False
        self._early: tuple[int, dict] | None = None
        path = Path(self.metrics_file_path)
        if path.is_file() and path.stat().st_size:
            with path.open(newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    def log_hparams(self, params: dict) -> None:
        self.hparams.update(params)
        with atomic_write_path(Path(self.log_dir) / self.NAME_HPARAMS_FILE) as partial:
            save_hparams_to_yaml(partial, self.hparams)

    def log_metrics(self, metrics_dict: dict, step: int | None = None) -> None:
        if self._early is not None and self._early[0] == step and _same(self._early[1], metrics_dict):
            self._early = None  # Lightning's own delivery of a step already written early
            return
        super().log_metrics(metrics_dict, step)

    def write_early(self, metrics_dict: dict, step: int) -> None:
        """Write one step's row now, and skip the identical delivery that follows."""
        super().log_metrics(metrics_dict, step)
        self.save()
        self._early = (step, dict(metrics_dict))

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        old_keys = list(self.metrics_keys)
        new_keys = set().union(*self.metrics) - set(old_keys)
        keys = sorted(set(old_keys) | new_keys)
        first_step = min(int(row["step"]) for row in self.metrics)
        exists = path.is_file() and path.stat().st_size > 0
        if exists and (new_keys or not self._trimmed):
            # A new column, or the first write of this process into an older run's file: rewrite
            # it whole, without the rows this run is about to log again.
            with path.open(newline="") as file:
                rows = list(csv.DictReader(file))
            if not self._trimmed:
                rows = [row for row in rows if row.get("step", "") != "" and int(float(row["step"])) < first_step]
            with atomic_write_path(path) as partial, partial.open("w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=keys)
                writer.writeheader()
                writer.writerows(rows)
        self._trimmed = True
        self.metrics_keys = keys
        with path.open("a" if exists else "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []


class StepLogBeforeCheckpoint(L.Callback):
    """Write each optimizer step's row to the :class:`ResumableCSVLogger` *before* that step's
    checkpoints are saved.

    Lightning hands a step's metrics to the loggers right after the ``on_train_batch_end`` hooks,
    and ``ModelCheckpoint`` saves inside them: a kill between the two leaves a checkpoint of step
    ``k`` and no row for ``k``, which the resumed run (starting after ``k``) never writes.
    Lightning runs ``ModelCheckpoint`` callbacks last, so this one's ``on_train_batch_end`` comes
    first and writes the row as Lightning would (same metrics, same step); the logger then skips
    Lightning's identical delivery.  Other loggers (W&B) are left to Lightning.
    """

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, ResumableCSVLogger)]
        connector = trainer._logger_connector
        if not loggers or not connector.should_update_logs:
            return
        if trainer.fit_loop._should_accumulate() and pl_module.automatic_optimization:
            return  # between the micro-batches of a step: Lightning logs nothing either
        # What LoggerConnector.update_train_step_metrics -> log_metrics will send, computed the same way.
        metrics = convert_tensors_to_scalars(connector.metrics["log"])
        if not metrics:
            return
        step = metrics.pop("step", None)
        if step is None:
            metrics.setdefault("epoch", trainer.current_epoch)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in loggers:
            logger.experiment.write_early(metrics, int(step))


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that continues ``metrics.csv`` across kills and
    resumes (see the module docstring).  Same arguments; ``save_dir`` must be a local path.

    Raises:
        ValueError: ``save_dir`` is a remote URL.
    """

    def __init__(self, save_dir: str, **kwargs) -> None:
        if "://" in str(save_dir):
            raise ValueError(f"logger.csv.save_dir={save_dir!r}: ResumableCSVLogger writes local files only; fix: a local folder")
        super().__init__(save_dir, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> _FabricWriter:
        if self._experiment is None:
            self._experiment = _ResumableWriter(log_dir=self.log_dir)
        return self._experiment
