"""Learning-rate schedule as a callback: the LR is a pure function of the optimizer step.

Not a ``torch.optim.lr_scheduler``: Lightning steps those only under automatic optimization, and their state must be
restored on resume, while ``trainer.global_step`` comes back with the checkpoint.  It also logs ``train/lr``.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from omegaconf import DictConfig

from ..models.contract import TrainedModule


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, then linear/cosine/constant decay
    to ``min_lr_ratio``, the shape of transformers' ``get_{linear,cosine}_schedule_with_warmup`` (``optimization.py``).
    """
    if step < warmup_steps:
        return step / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class WarmupDecayLR(L.Callback):
    """Set each param group's LR to ``peak_lr * lr_factor(...)`` before each batch, counting optimizer steps less
    ``skipped_steps``; ``peak_lr``: the group's starting ``lr``.  Logs the first group's LR as ``train/lr``.

    Args:
        warmup_ratio: fraction of the optimizer steps spent in linear warmup, in ``[0, 1)``.
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
        # In the module's step row; a module without one gets a row of its own, as LearningRateMonitor sends.
        if self.rows:
            pl_module.log_step_metric("train/lr", self.lr)
            return
        for logger in trainer.loggers:
            logger.log_metrics({"train/lr": self.lr}, step=trainer.global_step)


DECAYS = ("linear", "cosine", "constant")


def schedule_problems(schedule: DictConfig) -> list[str]:
    """The ``lr_schedule`` group: warmup in [0, 1), a known decay, a final LR ratio in [0, 1]."""
    problems = []
    warmup, min_ratio = schedule.warmup_ratio, schedule.min_lr_ratio
    if not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
        problems.append(
            f"lr_schedule.warmup_ratio={warmup!r} must be in [0, 1): the fraction of optimizer steps spent warming up; "
            "fix: e.g. lr_schedule.warmup_ratio=0.06"
        )
    if schedule.decay not in DECAYS:
        problems.append(f"lr_schedule.decay={schedule.decay!r} is not one of {DECAYS}")
    if not isinstance(min_ratio, (int, float)) or not 0 <= min_ratio <= 1:
        problems.append(
            f"lr_schedule.min_lr_ratio={min_ratio!r} must be in [0, 1], the final LR as a fraction of the peak; "
            "fix: e.g. lr_schedule.min_lr_ratio=0.1 (0: decay to zero)"
        )
    return problems
