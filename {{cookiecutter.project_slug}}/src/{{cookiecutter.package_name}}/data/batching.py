"""What the task data modules share: the one-time fetch, the test-split flag, and batching."""

from __future__ import annotations

from collections.abc import Callable

import math

import lightning as L
from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import LengthGroupedSampler

from ..utils.config import ConfigError
from .tokenization import disable_tokenizer_parallelism


class TokenizedDataModule(L.LightningDataModule):
    """Base of the task data modules: ``self.datasets[split]`` holds tokenised rows with an
    ``input_ids`` column; subclasses give the collator and say whether to group by length.

    Subclasses set ``splits``, ``fetch``, ``batch_size``, ``num_workers``, ``datasets`` in
    ``__init__`` and implement :meth:`collator` and :attr:`groups_by_length`.
    """

    @property
    def has_test(self) -> bool:
        return "test" in self.splits

    @property
    def groups_by_length(self) -> bool:
        """Draw training batches of similar length (transformers' ``LengthGroupedSampler``:
        shuffled mega-batches of 50 batches, each sorted by length), so padding wastes little."""
        raise NotImplementedError

    def sequence_lengths(self, split: str) -> list[int]:
        """Tokens per row of ``split`` (for length grouping)."""
        return [len(ids) for ids in self.datasets[split]["input_ids"]]

    def collator(self) -> Callable[[list[dict]], dict]:
        raise NotImplementedError

    def check_validation_interval(self) -> None:
        """Refuse an integer ``trainer.val_check_interval`` above the batches of one epoch, which
        Lightning only rejects after the model is built (a small corpus with a recipe made for
        a large one).  Call at the end of ``setup("fit")``.

        Raises:
            ConfigError: with the number of batches and the fix.
        """
        interval = getattr(self.trainer, "val_check_interval", None)
        batches = math.ceil(len(self.datasets["train"]) / self.batch_size)
        if isinstance(interval, int) and not isinstance(interval, bool) and interval > batches:
            raise ConfigError(
                f"trainer.val_check_interval={interval} is more than the {batches} training batches of one epoch "
                f"({len(self.datasets['train'])} sequences / micro-batch {self.batch_size}); "
                f"fix: trainer.val_check_interval={batches}, or 1.0 (once per epoch)"
            )

    def prepare_data(self) -> None:
        """Download/convert the data once (Lightning calls this on one process per node)."""
        if self.fetch is not None:
            self.fetch()

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if self.num_workers > 0:
            disable_tokenizer_parallelism()  # before the workers fork (tokenising is done by now)
        dataset = self.datasets[split]
        sampler = None
        if shuffle and self.groups_by_length:
            sampler = LengthGroupedSampler(self.batch_size, lengths=self.sequence_lengths(split))
            shuffle = False
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collator(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
