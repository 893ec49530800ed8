"""The LR schedule callback: the formula, and one LR per optimizer step under accumulation
and under manual optimization."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from {{ cookiecutter.package_name }}.core.callbacks import WarmupDecayLR, lr_factor

from .conftest import RecordingLogger


def test_warmup_then_linear_decay_to_zero():
    factors = [lr_factor(step, total_steps=10, warmup_steps=2, decay="linear", min_lr_ratio=0.0) for step in range(11)]
    assert factors[:3] == [0.0, 0.5, 1.0]
    assert factors[6] == pytest.approx(0.5)  # half way through the 8 decay steps
    assert factors[10] == 0.0


def test_cosine_decays_to_the_floor():
    assert lr_factor(5, total_steps=10, warmup_steps=0, decay="cosine", min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(10, total_steps=10, warmup_steps=0, decay="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(7, total_steps=10, warmup_steps=3, decay="constant", min_lr_ratio=0.0) == 1.0


class RecordLR(L.Callback):
    """Records (global_step, lr) at every optimizer step."""

    def __init__(self):
        self.seen: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append((trainer.global_step, optimizer.param_groups[0]["lr"]))


class Regression(L.LightningModule):
    def __init__(self, manual: bool = False, accumulate: int = 1):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.automatic_optimization = not manual
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss)
        self.optimizers().step()
        self.optimizers().zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(
    module: L.LightningModule, accumulate: int, batches: int = 12, epochs: int = 2, logger: RecordingLogger | None = None
) -> tuple[RecordLR, WarmupDecayLR]:
    data = DataLoader(TensorDataset(torch.randn(batches * 2, 4), torch.randn(batches * 2, 1)), batch_size=2)
    recorder, schedule = RecordLR(), WarmupDecayLR(warmup_ratio=0.25, decay="linear", min_lr_ratio=0.0)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=logger or False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[schedule, recorder],
        accumulate_grad_batches=accumulate if module.automatic_optimization else 1,
    )
    trainer.fit(module, data)
    return recorder, schedule


def expected(schedule: WarmupDecayLR, steps: int) -> list[tuple[int, float]]:
    return [(s, pytest.approx(0.1 * lr_factor(s, schedule.total_steps, schedule.warmup_steps, "linear", 0.0))) for s in range(steps)]


def test_schedule_counts_optimizer_steps_under_accumulation():
    recorder, schedule = run(Regression(), accumulate=3)
    # 12 batches per epoch / 3 per step = 4 optimizer steps per epoch, 2 epochs
    assert schedule.total_steps == 8 and schedule.warmup_steps == 2
    assert recorder.seen == expected(schedule, 8)


def test_schedule_is_the_same_under_manual_optimization():
    recorder, schedule = run(Regression(manual=True), accumulate=1)
    assert schedule.total_steps == 24
    assert recorder.seen == expected(schedule, 24)


def test_the_lr_each_optimizer_step_used_is_logged_once_in_that_steps_row():
    logger = RecordingLogger()
    recorder, schedule = run(Regression(), accumulate=3, logger=logger)
    logged = [(step, metrics["train/lr"]) for step, metrics in logger.records if "train/lr" in metrics]
    # One row per optimizer step (not per micro-batch), the LR set before that step's batches.
    assert logged == expected(schedule, 8) == recorder.seen
