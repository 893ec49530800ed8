"""Experiment loggers that take every optimizer step's row at their own pace.

``trainer.log_every_n_steps: 1`` sends every step's row to every logger: the CSV log needs them all (a resume's merge),
W&B and TensorBoard pay for each.  These Lightning subclasses skip per-step rows off their own ``log_every_n_steps``
(the last one is sent at finalize); all other rows pass through.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

from ..errors import ConfigError
from ..run.secrets import MaskedHyperparameters

# Keys of the per-step rows (``log_step_metric``); a row holding anything else is never skipped.
PER_STEP_KEYS = frozenset({"train/loss", "train/lr", "train/sparsity", "train/sparsity_model", "epoch"})


def skips_row(metrics: Mapping[str, object], step: int | None, every_n_steps: int) -> bool:
    """Whether this is a per-step row (only :data:`PER_STEP_KEYS`) of a step not a multiple of ``every_n_steps``."""
    return every_n_steps > 1 and step is not None and step % every_n_steps != 0 and set(metrics) <= PER_STEP_KEYS


def checked_every_n_steps(value: object, logger: str) -> int:
    """``value`` as a ``log_every_n_steps``.

    Raises:
        ConfigError: not an integer >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"logger.{logger}.log_every_n_steps={value!r}; fix: an integer >= 1 (1 = every optimizer step)")
    return value


class StepThinning:
    """Mixin for a Lightning logger: keyword ``log_every_n_steps``; ``log_metrics`` drops rows :func:`skips_row` names.
    The latest row left out is sent at ``finalize``, so the last ``train/loss`` (as in ``metrics.json``) shows.

    Raises:
        ConfigError: ``log_every_n_steps`` is not an integer >= 1.
    """

    config_name = "logger"

    def __init__(self, *args, log_every_n_steps: int = 1, **kwargs) -> None:
        self.log_every_n_steps = checked_every_n_steps(log_every_n_steps, self.config_name)
        self.left_out: tuple[int, dict] | None = None  # the latest per-step row left out, if no later one was sent
        super().__init__(*args, **kwargs)

    def thinned(self, metrics: Mapping[str, float], step: int | None) -> bool:
        """Whether this row is left out; keeps the latest left out in :attr:`left_out`."""
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
    """Lightning's ``WandbLogger`` with :class:`StepThinning`, masked config, and one ``wandb.log`` call per step.

    A step's rows are merged (each call is a message to W&B's service process, sharing the CPU with training) and sent at
    the next step, ``save``/``finalize`` or :meth:`send_row`; a row held at a kill is lost from W&B (the CSV log has it).

    Args:
        quiet: W&B's ``silent`` setting (``False``: W&B's own output); applied by
            :func:`..config.instantiate.start_wandb_run`, kept here so the key is this logger's.
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
        """Merge ``metrics`` into the held row of ``step`` (sending another step's first); a row without a step goes at once."""
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
    """Lightning's ``TensorBoardLogger`` with :class:`StepThinning` and a masked config."""

    config_name = "tensorboard"
