"""The reference log-probs of a full fine-tune's DPO or KTO (task=preference), computed once from the starting weights.

With no adapters to switch off, the reference is the policy as it starts: rather than a second copy of the weights,
:class:`ReferenceLogProbs` runs one no-grad pass over every split's pairs before the first step and hands the module
a ``(pairs, 2)`` table per split (KTO: an answer and its mismatched answer for a pair) (:attr:`.module.PreferenceModule.reference_tables`, kept in checkpoints). The tables
are cached in ``<data.cache_dir>/reference_logps/`` keyed by what determines them (the base model files' sha256, model,
peft, precision, attention, seed, tokenised pairs), so a change never reads an old one; plain tensors, ``weights_only=True``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from ...core.errors import ConfigError
from ...core.identity.fingerprint import hub_or_files

log = logging.getLogger(__name__)


class ReferenceLogProbs(L.Callback):
    """Give a DPO or KTO full fine-tune its reference tables before any pair is scored; nothing for other runs.
    ``seed`` (``${seed}``) is part of the cache key (it draws a model from scratch).

    Raises (from the hooks):
        ConfigError: a split without a table on a module past its starting weights.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ensure_tables(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ensure_tables(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ensure_tables(trainer, pl_module)

    def ensure_tables(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Fill ``module.reference_tables`` for every split the data module has prepared."""
        if not module.needs_reference_tables:
            return
        datamodule = trainer.datamodule
        missing = [split for split in datamodule.datasets if split not in module.reference_tables]
        if not missing:
            return
        if not module.at_starting_weights:
            raise ConfigError(
                f"the reference log-probs of {missing} were not computed when this run started, and the weights have been "
                "trained since (they are no longer the reference); fix: start a new run with these splits in data.splits"
            )
        for split in missing:
            module.reference_tables[split] = self.table(trainer, module, datamodule, split)
            module.reference_fingerprints[split] = datamodule.pair_fingerprints(split)

    def table(self, trainer: L.Trainer, module: L.LightningModule, datamodule, split: str) -> torch.Tensor:
        """The split's ``(pairs, 2)`` table: from the cache, or one pass of the starting weights."""
        dataset = datamodule.datasets[split]
        path = self.cache_path(module, datamodule, split)
        if path is not None and path.is_file():
            table = torch.load(path, weights_only=True)["reference_logps"]
            if table.shape == (len(dataset), 2):
                log.info("reference log-probs of %s: read from %s", split, path)
                return table
        table = reference_table(module, dataset, datamodule.collator(), datamodule.batch_size, trainer.precision_plugin)
        if path is not None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            torch.save({"reference_logps": table}, temporary)
            os.replace(temporary, path)  # (a file of this key holds the same table, whoever wrote it)
        return table

    def cache_path(self, module: L.LightningModule, datamodule, split: str) -> Path | None:
        """Where the table of ``split`` is cached (``None``: no ``data.cache_dir``)."""
        if not datamodule.cache_dir:
            return None
        base = str(module.hparams.model.get("name_or_path") or "")
        key = {
            "base_files": hub_or_files(base),
            "model": {k: v for k, v in module.hparams.model.items() if k != "fetch"},
            "hf_config": module.hparams.hf_config,
            "peft": module.hparams.peft,
            "attention": module.hparams.get("attention"),
            "precision": str(module.inputs.precision),
            "seed": self.seed,
            "pairs": pairs_digest(datamodule.datasets[split]),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        return Path(datamodule.cache_dir) / "reference_logps" / f"{digest[:24]}.pt"


def pairs_digest(dataset) -> str:
    """sha256 of the tokenised pairs: every side's token ids and labels (its ``*input_ids`` and ``*labels`` columns, by name),
    in order."""
    digest = hashlib.sha256()
    for column in sorted(c for c in dataset.column_names if c.endswith(("input_ids", "labels"))):
        for values in dataset[column]:
            digest.update(np.asarray(values, dtype=np.int64).tobytes())
            digest.update(b"|")
    return digest.hexdigest()


@torch.no_grad()
def reference_table(module: L.LightningModule, dataset, collator, batch_size: int, precision_plugin) -> torch.Tensor:
    """``(pairs, 2)`` float32 summed completion log-probs (chosen, rejected; KTO: answer, mismatched answer) of ``module``'s current weights over
    ``dataset`` in order, in eval mode, under the run's precision (``precision_plugin.forward_context()``)."""
    was_training = module.training
    module.eval()
    rows = []
    try:
        for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collator):
            batch = {key: value.to(module.device) for key, value in batch.items()}
            with precision_plugin.forward_context():
                logps, _ = module.sequence_logps(batch)  # (2P,)
            pairs = logps.shape[0] // 2
            rows.append(torch.stack([logps[:pairs], logps[pairs:]], dim=1).float().cpu())
    finally:
        module.train(was_training)
    return torch.cat(rows)
