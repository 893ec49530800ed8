"""Experiment loggers that take every optimizer step's row at their own pace.

``trainer.log_every_n_steps: 1`` sends every optimizer step's row (``train/loss``, ``train/lr``)
to every logger: the CSV log keeps them all (a resume's merge needs each step), while a W&B
or TensorBoard run gains little from 1,000 points a minute and pays for each (W&B offline: one
message to its service process per call).  These subclasses of Lightning's loggers skip the
per-step rows of steps that are not a multiple of their own ``log_every_n_steps``; every other
row (validation, test, epoch-end, throughput and GPU stats) passes through whatever its step.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

from ..errors import ConfigError
from .secrets import MaskedHyperparameters

# What the modules and the LR schedule log in every optimizer step's row (see
# ``HFModule.log_step_metric``); a row holding anything else is never skipped.
PER_STEP_KEYS = frozenset({"train/loss", "train/lr", "train/sparsity", "train/sparsity_model", "epoch"})


def skips_row(metrics: Mapping[str, object], step: int | None, every_n_steps: int) -> bool:
    """Whether a logger with ``log_every_n_steps=every_n_steps`` leaves out this row: a per-step
    row (only :data:`PER_STEP_KEYS`) of a step that is not a multiple of ``every_n_steps``."""
    return every_n_steps > 1 and step is not None and step % every_n_steps != 0 and set(metrics) <= PER_STEP_KEYS


def checked_every_n_steps(value: object, logger: str) -> int:
    """``value`` as a ``log_every_n_steps``.

    Raises:
        ConfigError: not an integer >= 1 (the message names ``logger.<logger>.log_every_n_steps``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"logger.{logger}.log_every_n_steps={value!r}; fix: an integer >= 1 (1 = every optimizer step)")
    return value


class StepThinning:
    """Mixin for a Lightning logger: ``log_every_n_steps`` (an integer >= 1, keyword only) and a
    ``log_metrics`` that leaves out the rows :func:`skips_row` names.  ``config_name`` is the
    logger's key in the ``logger`` group, for the error message.

    Raises:
        ConfigError: ``log_every_n_steps`` is not an integer >= 1.
    """

    config_name = "logger"

    def __init__(self, *args, log_every_n_steps: int = 1, **kwargs) -> None:
        self.log_every_n_steps = checked_every_n_steps(log_every_n_steps, self.config_name)
        super().__init__(*args, **kwargs)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not skips_row(metrics, step, self.log_every_n_steps):
            super().log_metrics(metrics, step)


class WandbLogger(MaskedHyperparameters, StepThinning, LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` that logs the per-step training rows of every
    ``log_every_n_steps``-th optimizer step only (see the module docstring and
    :class:`StepThinning`), one ``wandb.log`` call per step, and its config with secrets masked
    (:mod:`.secrets`); other arguments as Lightning's.

    One call per step: the rows of one step (a step's ``train/loss`` and ``train/lr``, the
    throughput callback's ``perf/*`` of the same step number) are held and merged, and sent as one
    row when a row of another step arrives, at ``save`` and ``finalize``, and by
    :meth:`send_row` (called before the W&B run is finished).  Each ``wandb.log`` call is a
    message to W&B's service process, whose work shares the CPU with training; merging them cut
    the W&B logger's cost per optimizer step on ``bench/throughput.py --profile`` (see
    ``docs/performance.md``).  A row still held when the process is killed is lost from W&B (the
    CSV log has it).

    Args:
        quiet: W&B's ``silent`` setting (default here): W&B prints nothing, neither its start
            lines nor its run history and summary (``train``'s results show the figures and the
            W&B run folder with its ``wandb sync`` command).  ``False``: W&B's own output.
            Applied where the project starts the run (:func:`.instantiate.start_wandb_run`,
            which hands it in as ``experiment``); kept here so that the key is this logger's.
    """

    config_name = "wandb"

    def __init__(self, *args, quiet: bool = True, log_every_n_steps: int = 1, **kwargs) -> None:
        self.quiet = quiet
        self._held: tuple[int, dict] | None = None  # (step, merged row) not sent yet
        super().__init__(*args, log_every_n_steps=log_every_n_steps, **kwargs)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if skips_row(metrics, step, self.log_every_n_steps):
            return
        if self._held is not None and self._held[0] != step:
            self.send_row()
        if step is None:  # (no step to merge on)
            LightningWandbLogger.log_metrics(self, metrics, step)
            return
        if self._held is None:
            self._held = (step, {})
        self._held[1].update(metrics)

    def send_row(self) -> None:
        """Send the held row, if any, to W&B (one ``wandb.log`` call)."""
        if self._held is not None:
            step, row = self._held
            self._held = None
            LightningWandbLogger.log_metrics(self, row, step)

    def save(self) -> None:
        self.send_row()
        super().save()

    def finalize(self, status: str) -> None:
        self.send_row()
        super().finalize(status)


class TensorBoardLogger(MaskedHyperparameters, StepThinning, LightningTensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger`` with the same ``log_every_n_steps`` as
    :class:`WandbLogger`."""

    config_name = "tensorboard"
