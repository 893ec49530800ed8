"""A step checkpoint and a validation at the same optimizer step: that step's bytes written once.

``step_checkpoint`` saves ``last.ckpt`` in ``on_train_batch_end``; a validation due at the same
step runs right after, and ``model_checkpoint`` then saves ``best-*.ckpt`` (a new best) or
``last.ckpt`` again: two full writes of the same weights (270 MB each for MiniLM with its AdamW
state, several GB for a full fine-tune of a 1B model), where the HF Trainer writes one when
``eval_steps`` and ``save_steps`` coincide.  Lightning saves before it validates, and which steps
validate is decided inside its loop, so the step checkpoint cannot know that a later save of the
same step is coming; the write is held instead.
"""

from __future__ import annotations

import lightning as L

from ..checkpoints.io import AtomicCheckpointIO


class HoldStepCheckpoint(L.Callback):
    """Hold a checkpoint's background write until the next training batch starts
    (:attr:`..checkpoints.io.AtomicCheckpointIO.hold_saves`): a save of the same optimizer step before then (the
    validation's ``best-*.ckpt`` or ``last.ckpt``) supersedes it, and the held file's name
    becomes a hard link to the later file (:meth:`..checkpoints.io.AtomicCheckpointIO.save_checkpoint`).
    Otherwise the held write is queued at the next training batch, the next save or the end of
    the fit.  The cost: a kill during that step's validation leaves the previous ``last.ckpt``
    (resumable, one step checkpoint older), as a kill during the write would.  No-op unless the
    trainer's checkpoint IO is a background :class:`..checkpoints.io.AtomicCheckpointIO`.
    """

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
