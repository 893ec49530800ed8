"""Learning-rate schedule as a callback: the LR is a pure function of the optimizer step.

Why a callback and not a ``torch.optim.lr_scheduler``: Lightning steps schedulers only under
automatic optimization, and a scheduler carries state that must be restored exactly on resume.
Setting ``lr = peak_lr * lr_factor(global_step, ...)`` before every batch needs no state,
works unchanged under manual optimization, and is right after a resume because
``trainer.global_step`` (optimizer steps taken) is restored with the checkpoint.

The same callback logs the LR (``train/lr``, in each optimizer step's row, at that step), so no
``LearningRateMonitor`` is needed: that one reads every param group of every optimizer before
each micro-batch, about 1 ms a step on a small CPU for a value this callback already knows
(``docs/performance.md``).
"""

from __future__ import annotations

import math

import lightning as L
import torch

from ..models.contract import TrainedModule


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Warmup: ``step / warmup_steps`` for ``step < warmup_steps`` (0 at step 0); then, with
    ``progress = (step - warmup_steps) / (total_steps - warmup_steps)``:

    - ``linear``: ``1 - progress``; ``cosine``: ``0.5 * (1 + cos(pi * progress))``;
      ``constant``: ``1``,

    rescaled to end at ``min_lr_ratio`` instead of 0.  This is the shape of transformers'
    ``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` (transformers
    ``optimization.py``), so runs compare with the HF Trainer's.
    """
    if step < warmup_steps:
        return step / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class WarmupDecayLR(L.Callback):
    """Set every param group's LR to ``peak_lr * lr_factor(step, ...)`` before each batch, where
    ``step`` is ``trainer.global_step`` less the module's ``skipped_steps`` (updates skipped on a
    non-finite loss do not advance the schedule).

    The peak LR is each group's ``lr`` when training starts, kept as ``group["peak_lr"]`` (saved
    with the optimizer state).  ``train/lr``, put in each optimizer step's row (the module's
    ``log_step_metric``: the row with that step's ``train/loss``, sent at Lightning's pace,
    ``trainer.log_every_n_steps``; a module without one: a row of its own to every logger each
    step, step = ``trainer.global_step``), is the LR that step used, of the first param group
    (the others differ only where their peak LR does).  ``total_steps`` is ``trainer.estimated_stepping_batches``: optimizer
    steps, not batches, so gradient accumulation does not stretch the schedule.

    Args:
        warmup_ratio: fraction of ``total_steps`` spent in linear warmup, in ``[0, 1)``.
        decay: ``linear`` | ``cosine`` | ``constant``.
        min_lr_ratio: final LR as a fraction of the peak LR.
    """

    def __init__(self, warmup_ratio: float, decay: str, min_lr_ratio: float) -> None:
        self.warmup_ratio, self.decay, self.min_lr_ratio = warmup_ratio, decay, min_lr_ratio
        self.total_steps = 0
        self.warmup_steps = 0
        self.lr = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rows = isinstance(pl_module, TrainedModule)  # the module's step row (else rows of our own)
        self.total_steps = int(trainer.estimated_stepping_batches)
        self.warmup_steps = int(self.warmup_ratio * self.total_steps)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group.setdefault("peak_lr", group["lr"])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        # Steps whose update was skipped (non-finite loss) do not advance the schedule.
        step = trainer.global_step - (pl_module.skipped_steps if self.rows else 0)
        factor = lr_factor(step, self.total_steps, self.warmup_steps, self.decay, self.min_lr_ratio)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["peak_lr"] * factor
        self.lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else 0.0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        # In the module's row of this step (HFModule.log_step_metric: one row, one call per
        # logger, at the step Lightning logs that step's train/loss at, before any checkpoint of
        # the step); a module without a step row gets a row of its own, straight to the loggers
        # (as LearningRateMonitor does), without the cost of a LightningModule.log call per step.
        if self.rows:
            pl_module.log_step_metric("train/lr", self.lr)
            return
        for logger in trainer.loggers:
            logger.log_metrics({"train/lr": self.lr}, step=trainer.global_step)
