"""A step checkpoint and a validation at the same optimizer step: the checkpoint holds the state after the validation,
and that step's bytes are written once.

``step_checkpoint`` saves ``last.ckpt`` before a validation due at the same step (Lightning decides which steps validate
inside its loop), and ``model_checkpoint`` saves it again after that validation only when the best improved: a kill after a
validation that did not improve resumed from callback state of before it (early stopping's count, EMA, the best so far).
So the first save is held (background writes) and written again once the validation's hooks have run."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

from ..checkpoints.io import AtomicCheckpointIO


class HoldStepCheckpoint(Checkpoint):
    """Two duties, both no-ops unless the checkpoint IO is an :class:`AtomicCheckpointIO`:

    - A checkpoint saved at an optimizer step before a validation at that step, and not saved again during it, is saved
      again at the validation's end, so every callback's state in it is the state after that step's hooks.  A
      ``Checkpoint`` subclass: Lightning runs it after every other callback, and after the ``ModelCheckpoint``s before it.
    - With background writes, a checkpoint's write is held until the next training batch (``AtomicCheckpointIO.hold_saves``):
      a save of the same step before then supersedes it (the held name a hard link to the later file), so the re-save
      above writes those bytes once.  A kill during that validation leaves the previous ``last.ckpt``.
    """

    def __init__(self) -> None:
        self.io: AtomicCheckpointIO | None = None
        self.before: tuple | None = None  # the IO's last save when the validation started

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO):
            self.io = io
            io.hold_saves = io.background

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        if self.io is not None:
            self.io.release()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = self.io.last_saved if self.io is not None else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.io is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        saved = self.io.last_saved  # (path, global_step, number): set where the file is written (rank 0); one decision for all
        stale = saved is not None and saved == self.before and saved[1] == trainer.global_step
        path = trainer.strategy.broadcast(str(saved[0]) if stale else None)
        if path is not None:
            trainer.save_checkpoint(path)  # (collective under DDP: every rank calls it)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.io is not None:
            self.io.release()
            self.io.hold_saves = False
            self.io = None
