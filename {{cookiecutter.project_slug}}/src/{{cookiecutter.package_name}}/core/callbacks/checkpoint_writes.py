"""A step checkpoint and a validation at the same optimizer step: that step's bytes written once.

``step_checkpoint`` saves ``last.ckpt`` before a validation due at the same step, after which ``model_checkpoint`` saves
the same weights again; Lightning decides which steps validate inside its loop, so the first write is held instead."""

from __future__ import annotations

import lightning as L

from ..checkpoints.io import AtomicCheckpointIO


class HoldStepCheckpoint(L.Callback):
    """Hold a checkpoint's background write until the next training batch (``AtomicCheckpointIO.hold_saves``): a save of
    the same step before then supersedes it, the held name becoming a hard link to the later file. A kill during that
    validation leaves the previous ``last.ckpt``. No-op unless the checkpoint IO is a background ``AtomicCheckpointIO``."""

    def __init__(self) -> None:
        self.io: AtomicCheckpointIO | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO) and io.background:
            self.io = io
            io.hold_saves = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        if self.io is not None:
            self.io.release()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.io is not None:
            self.io.release()
            self.io.hold_saves = False
            self.io = None
