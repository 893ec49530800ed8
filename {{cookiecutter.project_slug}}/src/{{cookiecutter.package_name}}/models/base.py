"""What every task's LightningModule shares: fetching the model files, the optimizer, and the
tokenizer stored inside each checkpoint."""

from __future__ import annotations

import hydra
import lightning as L
import torch

from ..optim import build_optimizer
from .builder import tokenizer_from_files, tokenizer_to_files
from .levers import apply_levers


class HFModule(L.LightningModule):
    """Base of the task modules: ``self.model`` is the Hugging Face model (built in
    ``configure_model``), ``self.tokenizer`` its tokenizer; ``hparams.model``,
    ``hparams.optimizer``, ``hparams.attention``, ``hparams.checkpointing`` and
    ``hparams.compile`` are those config groups as plain dicts (the last three ``None`` = sdpa,
    no checkpointing, no compile).

    With ``optimizer.step_in_backward`` the module runs under manual optimization
    (:meth:`backward_and_step`); otherwise Lightning's automatic loop.

    Checkpoints carry the tokenizer's files as text (``checkpoint["tokenizer_files"]``), so
    eval/predict/generate need nothing but the checkpoint.
    """

    def __init__(self) -> None:
        super().__init__()
        self.model = None  # built in configure_model
        self.tokenizer = None
        self._tokenizer_files: dict[str, str] | None = None

    def prepare_data(self) -> None:
        """Install the model files once (``model.fetch``), before anything reads them."""
        if self.hparams.model.get("fetch"):
            hydra.utils.instantiate(self.hparams.model["fetch"])()

    def setup_optimization(self) -> None:
        """Call after ``save_hyperparameters``: manual optimization when the optimizer steps
        inside backward (Lightning's automatic loop would step it a second time)."""
        self.automatic_optimization = not self.hparams.optimizer["step_in_backward"]

    @property
    def attn_implementation(self) -> str:
        """The ``attention`` group's choice (``sdpa`` when the module was built without it)."""
        return self.hparams.attention["implementation"] if self.hparams.get("attention") else "sdpa"

    def apply_levers(self, compile_target: torch.nn.Module | None = None) -> None:
        """Activation checkpointing and compile, from the config groups (see :mod:`.levers`)."""
        apply_levers(self.model, self.hparams.get("checkpointing"), self.hparams.get("compile"), compile_target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No LR scheduler here: the schedule callback sets the LR from the optimizer step count,
        # the same way for every optimizer below (fused, 8-bit, stepped in backward).
        return build_optimizer(self.model, self.hparams.optimizer, self.device.type)

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """The manual-optimization step of ``optimizer.step_in_backward``: ``backward`` updates
        every parameter as its gradient completes; ``step()`` then only counts the step (global
        step, so the LR schedule and step-based checkpoints advance) and runs Lightning's
        optimizer hooks."""
        self.manual_backward(loss)
        self.optimizers().step()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_to_files(self.tokenizer)
        checkpoint["tokenizer_files"] = self._tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.tokenizer is None:
            self._tokenizer_files = checkpoint["tokenizer_files"]
            self.tokenizer = tokenizer_from_files(self._tokenizer_files)
