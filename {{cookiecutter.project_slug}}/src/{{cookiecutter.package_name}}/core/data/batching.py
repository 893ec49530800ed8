"""What the task data modules share: the one-time fetch, the test-split flag, and batching."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import datasets
import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError, DataError
from .sampling import EvaluationShardSampler, ResumableDataLoader, ResumableSampler
from .tokenization import disable_tokenizer_parallelism

log = logging.getLogger(__name__)


class TokenizedDataModule(L.LightningDataModule):
    """Base of the task data modules: ``self.datasets[split]`` holds tokenised rows with an ``input_ids`` column;
    subclasses implement :meth:`collator` and :attr:`groups_by_length` and pass the shared keys on (``**shared``).

    **Resuming mid-epoch.**  The training order is a function of ``(seed, epoch)``; checkpoints store the epoch and rows
    done (:meth:`state_dict`).  No loader draws from the global RNG, so a validation pass cannot shift the next step's
    dropout masks: a resumed run sees the same batches and random numbers as the uninterrupted run.
    """

    # What the framework reads of every data module (train, eval, the planner, ModelInputs.of); set by setup.
    seed: int | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    max_length: int | None = None  # tokens per row (data.max_length)
    batch_size: int = 1  # the per-process micro-batch
    id2label: dict[int, str] | None = None  # class index -> label name (classification)
    eot_id: int | None = None  # chat data: the end-of-turn token closing assistant turns
    system_prompt: str | None = None  # chat data: the system turn set on every row
    task_facts: dict | None = None  # what else the task's module is told (plain JSON types)
    task_objects: dict | None = None  # what the task's module is handed each run, never saved (GRPO's reward functions)
    splits: dict[str, object]  # the data config's splits (train, validation, test)
    split_sizes: dict[str, int]  # rows (or documents) per split as read, before any are dropped
    token_counts: dict[str, int] | None = None  # real (non-pad) tokens per split, where the task counts them
    _resume_at: dict | None = None

    def __init__(
        self,
        *,
        splits: dict[str, object],
        hub_name: str | None,
        hub_config: str | None,
        tokenizer: str | PreTrainedTokenizerBase,
        max_length: int,
        batch_size: int,
        val_fraction: float,
        val_split_seed: int,
        num_workers: int,
        pad_to_multiple_of: int | None,
        group_by_length: bool,
        cache_dir: str | None,
        fetch: Callable[[], object] | None,
        seed: int | None = None,
    ) -> None:
        """The ``data`` config's shared keys.  ``splits``: split -> file(s) or hub split name; ``tokenizer``: a name or
        folder (loaded in ``setup``) or a tokenizer; ``seed``: the training order's, ``None`` draws one per process."""
        super().__init__()
        self.splits = {split: source if isinstance(source, str) else list(source) for split, source in splits.items() if source}
        self.hub_name, self.hub_config = hub_name, hub_config
        self.tokenizer = tokenizer if isinstance(tokenizer, PreTrainedTokenizerBase) else None
        self.tokenizer_name = tokenizer if isinstance(tokenizer, str) else None
        self.max_length, self.batch_size = max_length, batch_size
        self.val_fraction, self.val_split_seed = val_fraction, val_split_seed
        self.num_workers, self.pad_to_multiple_of, self.group_by_length = num_workers, pad_to_multiple_of, group_by_length
        self.cache_dir, self.fetch, self.seed = cache_dir, fetch, seed
        self.datasets: dict[str, datasets.Dataset] = {}
        self.split_sizes: dict[str, int] = {}

    @property
    def has_test(self) -> bool:
        return "test" in self.splits

    @property
    def groups_by_length(self) -> bool:
        """Draw training batches of similar length (transformers' ``get_length_grouped_indices``), so padding wastes little."""
        raise NotImplementedError

    def sequence_lengths(self, split: str) -> list[int]:
        """Tokens per row of ``split`` (for length grouping)."""
        return [len(ids) for ids in self.datasets[split]["input_ids"]]

    def collator(self) -> Callable[[list[dict]], dict]:
        raise NotImplementedError

    def check_validation_interval(self) -> None:
        """At the end of ``setup("fit")``, refuse a ``trainer.val_check_interval`` above one epoch's batches (Lightning
        refuses it after the model is built) or inside an optimizer step (a checkpoint there lacks the gradient so far).

        Raises:
            ConfigError: with the number of batches or the accumulation, and the fix.
        """
        trainer = self.trainer
        interval = getattr(trainer, "val_check_interval", None)
        world = trainer.world_size if trainer is not None else 1
        batches = math.ceil(len(self.datasets["train"]) / (self.batch_size * world))  # of one process, per epoch
        if isinstance(interval, int) and not isinstance(interval, bool) and interval > batches:
            raise ConfigError(
                f"trainer.val_check_interval={interval} is more than the {batches} training batches of one epoch "
                f"({len(self.datasets['train'])} sequences / micro-batch {self.batch_size}); "
                f"fix: trainer.val_check_interval={batches}, or 1.0 (once per epoch)"
            )
        accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
        if interval is None or isinstance(interval, bool) or accumulate == 1:
            return
        # Lightning validates after this many micro-batches (a fraction: of the epoch's batches).
        every = interval if isinstance(interval, int) else max(1, int(batches * interval))
        if every % accumulate and every != batches:
            fix = max(accumulate, every // accumulate * accumulate)
            raise ConfigError(
                f"trainer.val_check_interval={interval} validates every {every} micro-batches, inside an optimizer step of "
                f"accumulate_grad_batches={accumulate} micro-batches: a checkpoint saved there cannot be resumed exactly; "
                f"fix: trainer.val_check_interval={fix} (a multiple of {accumulate}), or 1.0 (at the end of each epoch)"
            )

    def hold_out_validation(self, train: datasets.Dataset, unit: str, fix: str) -> tuple[datasets.Dataset, datasets.Dataset]:
        """``(train, validation)``: ``data.val_fraction`` of ``train``'s rows held out, drawn with ``data.val_split_seed``.

        Raises:
            DataError: fewer than two rows.
        """
        if len(train) < 2:
            raise DataError(
                f"data.splits.train={self.splits['train']!r} has {len(train)} {unit}(s), too few to cut a validation split from; fix: {fix}"
            )
        parts = train.train_test_split(test_size=self.val_fraction, seed=self.val_split_seed)
        log.info("No validation split given: took %d %ss of train (seed %d)", len(parts["test"]), unit, self.val_split_seed)
        return parts["train"], parts["test"]

    def prepare_data(self) -> None:
        """Download/convert the data once (Lightning calls this on one process per node)."""
        if self.fetch is not None:
            self.fetch()

    @property
    def order_seed(self) -> int:
        """The seed of the training order: ``seed``, or (``seed: null``) one drawn once per process."""
        if self.seed is None:
            self.seed = int(torch.randint(0, 2**31 - 1, ()).item())
        return self.seed

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the data, saved in checkpoints: ``epoch`` and ``rows_done`` (rows over all processes,
        so a resume may change ``batch.micro_batch_size``)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:  # (validation inside fit saves too)
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        rows = done * self.batch_size * trainer.world_size
        return {"epoch": trainer.current_epoch, "rows_done": rows, "seed": self.order_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Keep the checkpoint's position for the next ``train_dataloader``."""
        self._resume_at = state or None

    def _generator(self) -> torch.Generator:
        # Worker seeds come from the loader's generator, not the global RNG (see the class docstring).
        return torch.Generator().manual_seed(self.order_seed)

    def _loader(self, split: str, sampler: ResumableSampler | EvaluationShardSampler | None = None) -> DataLoader:
        if self.num_workers > 0:
            disable_tokenizer_parallelism()  # before the workers fork (tokenising is done by now)
        return (ResumableDataLoader if isinstance(sampler, ResumableSampler) else DataLoader)(
            self.datasets[split],
            batch_size=self.batch_size,
            sampler=sampler,
            generator=self._generator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collator(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled (or length-grouped) training batches; after a resume, from the saved position."""
        lengths = self.sequence_lengths("train") if self.groups_by_length else None
        trainer = self.trainer
        sampler = ResumableSampler(
            len(self.datasets["train"]),
            self.order_seed,
            lengths,
            self.batch_size,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )
        if self._resume_at:
            sampler.resume_at(self._resume_at["epoch"], self._resume_at["rows_done"])
            self._resume_at = None
        return self._loader("train", sampler)

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader("test")

    def evaluation_order(self, split: str) -> list[int] | None:
        """The rows of ``split`` longest first (little padding; an OOM shows in the sanity check); ``None`` without length
        grouping or for a ``limit_*_batches`` sample.  Metrics are sums over rows, so nothing changes beyond rounding."""
        if not self.groups_by_length:
            return None
        trainer = self.trainer
        limit = getattr(trainer, "limit_test_batches" if split == "test" else "limit_val_batches", 1.0)
        if not (isinstance(limit, float) and limit == 1.0):  # (an int counts batches: 1 is one batch)
            return None
        lengths = self.sequence_lengths(split)
        return sorted(range(len(lengths)), key=lambda row: -lengths[row])

    def _evaluation_loader(self, split: str) -> DataLoader:
        """The split in :meth:`evaluation_order`, each DDP rank its own rows, every row once.  FSDP keeps Lightning's padded
        sampler (every rank must run as many batches: each forward gathers all shards)."""
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if world > 1 and isinstance(trainer.strategy, FSDPStrategy):
            rank_zero_warn(
                f"FSDP: every rank must run as many {split} batches, so {split} metrics count up to "
                f"{trainer.world_size - 1} repeated rows twice; for exact figures, run eval on one device"
            )
            return self._loader(split)
        return self._loader(split, EvaluationShardSampler(len(self.datasets[split]), world, rank, self.evaluation_order(split)))


def data_problems(data: DictConfig) -> list[str]:
    """The keys every data config has; each task checks its own (``Task.data_problems``)."""
    problems = []
    max_length = data.get("max_length")
    if not isinstance(max_length, int) or max_length < 8:
        problems.append(f"data.max_length={max_length!r} must be an integer >= 8 (tokens per sequence); fix: e.g. data.max_length=512")
    fraction = data.get("val_fraction")
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        problems.append(
            f"data.val_fraction={fraction!r} must be in (0, 1), the share of train held out for validation; fix: e.g. data.val_fraction=0.1"
        )
    splits = data.get("splits") or {}
    unknown = sorted(set(splits) - {"train", "validation", "test"})
    if unknown:
        problems.append(f"data.splits has unknown keys {unknown}; allowed: train, validation, test")
    if not splits.get("train"):
        problems.append("data.splits.train is empty; fix: data.splits.train=path/to/train.csv (or a hub split name)")
    return problems
