"""Record what a run is made of, in its folder and every checkpoint; refuse a resume on other files.

The files a config names can only be hashed once installed: in ``setup``, after ``prepare_data``, before any weights load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from ..errors import ConfigError
from ..identity.fingerprint import Change, file_changes, identity_of, plain_config, resume_problems, write_identity
from ..models.contract import TrainedModule

log = logging.getLogger(__name__)


class RunIdentity(L.Callback):
    """Hashes the run's files at its first ``setup``, writes ``<run>/identity.json`` and ``checkpoint["identity"]``.

    Args:
        resumed: the checkpoint being resumed (``None`` for a fresh run): its files and label map are compared.
        where: the checkpoint as messages name it (``ckpt_path=...``).

    Raises (in ``setup``):
        ConfigError: resuming with a data file, base model, tokenizer or label map other than the checkpoint's run.
    """

    def __init__(self, cfg: DictConfig, resumed: dict | None = None, where: str = "") -> None:
        self.config = plain_config(cfg)
        self.run_dir = Path(str(cfg.paths.output_dir))
        self.old_identity = (resumed or {}).get("identity")
        self.old_labels = ((resumed or {}).get("model_inputs") or {}).get("id2label") if resumed is not None else None
        self.resumes = resumed is not None
        self.where = where
        self.identity: dict | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.identity is not None:
            return
        identity = identity_of(self.config)
        if self.resumes and isinstance(self.old_identity, dict):
            changes = file_changes(self.old_identity.get("files") or {}, identity["files"])
            inputs = pl_module.inputs if isinstance(pl_module, TrainedModule) else None
            labels = _labels(inputs.id2label if inputs is not None else None)
            if _labels(self.old_labels) != labels:
                changes.append(Change("labels", str(_labels(self.old_labels)), str(labels)))
            allow = [str(key) for key in ((self.config.get("resume") or {}).get("allow_changed") or [])]  # (a Hub revision)
            problems, notes = resume_problems(changes, (), allow, self.where)  # (files and labels: the same for every task)
            if problems:
                raise ConfigError("\n".join(problems))
            for note in notes:  # (a test split added or changed)
                log.warning(note)
        self.identity = identity
        if trainer.is_global_zero:
            write_identity(identity, self.run_dir)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.identity is not None:
            checkpoint["identity"] = self.identity


def _labels(id2label: dict | None) -> dict[int, str] | None:
    return None if id2label is None else {int(index): str(name) for index, name in id2label.items()}
