"""Experiment loggers that take every optimizer step's row at their own pace.

``trainer.log_every_n_steps: 1`` sends every optimizer step's row (``train/loss``, ``train/lr``)
to every logger: the CSV log keeps them all (a resume's merge needs each step), while a W&B
or TensorBoard run gains little from 1,000 points a minute and pays for each (W&B offline: one
message to its service process per call).  These subclasses of Lightning's loggers skip the
per-step rows of steps that are not a multiple of their own ``log_every_n_steps``, except the
last one of a fit (sent when the logger is finalized); every other row (validation, test,
epoch-end, throughput and GPU stats) passes through whatever its step.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

from ..errors import ConfigError
from ..run.secrets import MaskedHyperparameters

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

    The last per-step row is never lost: the latest row left out is kept until a later per-step
    row is sent, and ``finalize`` (Lightning calls it at the end of every fit, validation and
    test) sends it, so a run whose last optimizer step is off the period still shows its last
    ``train/loss`` (the one ``metrics.json`` reports).

    Raises:
        ConfigError: ``log_every_n_steps`` is not an integer >= 1.
    """

    config_name = "logger"

    def __init__(self, *args, log_every_n_steps: int = 1, **kwargs) -> None:
        self.log_every_n_steps = checked_every_n_steps(log_every_n_steps, self.config_name)
        self.left_out: tuple[int, dict] | None = None  # the latest per-step row left out, if no later one was sent
        super().__init__(*args, **kwargs)

    def thinned(self, metrics: Mapping[str, float], step: int | None) -> bool:
        """Whether this row is left out (:func:`skips_row`); keeps the latest left out in :attr:`left_out`."""
        if skips_row(metrics, step, self.log_every_n_steps):
            self.left_out = (step, dict(metrics))
            return True
        if step is not None and set(metrics) <= PER_STEP_KEYS:
            self.left_out = None  # a later per-step row goes out
        return False

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.thinned(metrics, step):
            super().log_metrics(metrics, step)

    def send_left_out(self) -> None:
        """Send :attr:`left_out`, if any (through :meth:`log_unthinned`)."""
        if self.left_out is not None:
            step, metrics = self.left_out
            self.left_out = None
            self.log_unthinned(metrics, step)

    def log_unthinned(self, metrics: Mapping[str, float], step: int | None) -> None:
        super().log_metrics(metrics, step)

    def finalize(self, status: str) -> None:
        self.send_left_out()
        super().finalize(status)


class WandbLogger(MaskedHyperparameters, StepThinning, LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` that logs the per-step training rows of every
    ``log_every_n_steps``-th optimizer step only (see the module docstring and
    :class:`StepThinning`), one ``wandb.log`` call per step, and its config with secrets masked
    (:mod:`..run.secrets`); other arguments as Lightning's.

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
            Applied where the project starts the run (:func:`..config.instantiate.start_wandb_run`,
            which hands it in as ``experiment``); kept here so that the key is this logger's.
    """

    config_name = "wandb"

    def __init__(self, *args, quiet: bool = True, log_every_n_steps: int = 1, **kwargs) -> None:
        self.quiet = quiet
        self._held: tuple[int, dict] | None = None  # (step, merged row) not sent yet
        super().__init__(*args, log_every_n_steps=log_every_n_steps, **kwargs)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.thinned(metrics, step):
            self.log_unthinned(metrics, step)

    def log_unthinned(self, metrics: Mapping[str, float], step: int | None) -> None:
        """Hold ``metrics`` for ``step``, merged with the held row of the same step (sending a
        held row of another step first); a row without a step is sent at once."""
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
        self.send_left_out()
        self.send_row()
        super().finalize(status)


class TensorBoardLogger(MaskedHyperparameters, StepThinning, LightningTensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger`` with the same ``log_every_n_steps`` as
    :class:`WandbLogger`."""

    config_name = "tensorboard"
