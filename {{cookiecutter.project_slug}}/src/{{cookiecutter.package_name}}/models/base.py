"""What every task's LightningModule shares: fetching the model files, the optimizer, and the
tokenizer stored inside each checkpoint."""

from __future__ import annotations

import hydra
import lightning as L
import torch

from ..optim import build_optimizer
from .builder import tokenizer_from_files, tokenizer_to_files


class HFModule(L.LightningModule):
    """Base of the task modules: ``self.model`` is the Hugging Face model (built in
    ``configure_model``), ``self.tokenizer`` its tokenizer; ``hparams.model`` and
    ``hparams.optimizer`` are the ``model`` and ``optimizer`` config groups as plain dicts.

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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No LR scheduler here: the schedule callback sets the LR from the optimizer step count.
        return build_optimizer(self.model, self.hparams.optimizer)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_to_files(self.tokenizer)
        checkpoint["tokenizer_files"] = self._tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.tokenizer is None:
            self._tokenizer_files = checkpoint["tokenizer_files"]
            self.tokenizer = tokenizer_from_files(self._tokenizer_files)
