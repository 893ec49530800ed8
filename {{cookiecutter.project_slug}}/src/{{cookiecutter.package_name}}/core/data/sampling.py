"""A training order that a resumed run can re-enter part-way through an epoch.

Exact resume needs the rows of epoch ``e`` in the same order as the uninterrupted run, from the
row the checkpoint stopped at.  So the order is a pure function of ``(seed, epoch)`` (a generator
seeded from both, like torch's ``DistributedSampler``), never of the global RNG, and a resumed
sampler skips the rows the checkpoint's epoch had already trained on.

Where the position lives: :class:`.batching.TokenizedDataModule` saves
``(epoch, rows done)`` in the checkpoint from Lightning's own loop counters (its ``state_dict``
hook) and hands them to the sampler in ``train_dataloader``.  A data loader cannot count this
itself: Lightning fetches one batch ahead, so a loader's count runs one batch past the loop's.

Several processes (DDP): the sampler shards the epoch itself, rank ``r`` of ``W`` taking rows
``r, r + W, r + 2W, ...`` of the order (padded to a multiple of ``W``, as torch's
``DistributedSampler`` does).  It subclasses ``DistributedSampler`` so that Lightning leaves it
alone instead of wrapping it in its ``DistributedSamplerWrapper``, which would neither pass
``set_epoch`` on nor survive a shortened (resumed) epoch.  Positions are global rows, so a resume
continues every rank exactly where it stopped.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler
from transformers.trainer_pt_utils import get_length_grouped_indices


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, epoch)``: the same pair, the same stream, in any process.

    ``hash`` of a tuple of ints does not depend on ``PYTHONHASHSEED`` (only str/bytes hashes do).
    """
    return torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFF_FFFF_FFFF_FFFF)


class ResumableSampler(DistributedSampler):
    """Row indices of one training epoch, shuffled (or length-grouped) as a function of
    ``(seed, epoch)`` only, optionally starting part-way into the epoch; with ``num_replicas``
    processes, this rank's share of them.

    Args:
        num_rows: rows in the training split.
        seed: the run's seed (``seed`` of the train config).
        lengths: tokens per row; given, the order is transformers' ``get_length_grouped_indices``
            (random mega-batches of 50 micro-batches, each sorted by length) for ``batch_size``.
        batch_size: micro-batch size (only used with ``lengths``).
        num_replicas, rank: processes of a distributed run and this one's rank (``trainer.world_size``,
            ``trainer.global_rank``); 1 and 0 on one device.

    ``len()`` is always this rank's whole epoch, ``ceil(num_rows / num_replicas)`` (Lightning
    counts an epoch's batches from it); after :meth:`resume_at` the next ``iter()`` yields only
    the rows not yet trained on.
    """

    def __init__(
        self, num_rows: int, seed: int, lengths: Sequence[int] | None = None, batch_size: int = 1, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # (DistributedSampler's own __init__ would read the process group; nothing of it is used.)
        self.num_rows, self.seed, self.lengths, self.batch_size = num_rows, seed, lengths, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.start = 0  # global rows of the epoch already trained on (all ranks together)

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before each epoch (as for a ``DistributedSampler``)."""
        self.epoch = epoch

    def resume_at(self, epoch: int, rows_done: int) -> None:
        """Make the next ``iter()`` continue ``epoch`` after its first ``rows_done`` rows (all ranks
        together); an epoch that was already finished continues with the next one from its first row."""
        if rows_done >= self.num_rows:
            epoch, rows_done = epoch + 1, 0
        self.epoch, self.start = epoch, rows_done

    def order(self, epoch: int) -> list[int]:
        """Every row index once, in the order of ``epoch``."""
        generator = epoch_generator(self.seed, epoch)
        if self.lengths is not None:
            return get_length_grouped_indices(list(self.lengths), self.batch_size, generator=generator)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        order = self.order(self.epoch)
        if self.num_replicas == 1:
            return iter(order[start:])
        padded = order + order[: len(self) * self.num_replicas - len(order)]  # every rank gets len(self) rows
        return iter(padded[self.rank :: self.num_replicas][start // self.num_replicas :])

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.num_replicas)


class EvaluationShardSampler(DistributedSampler):
    """This rank's share of an evaluation split, in ``order`` and without padding: rank ``r`` of
    ``n`` gets rows ``order[r], order[r + n], order[r + 2n], ...``, so every row is evaluated
    exactly once over all ranks (torch's ``DistributedSampler``, which Lightning puts in by
    default, repeats rows so that every rank gets as many, and they would count twice in the
    metrics).  The metrics add the ranks' sums and counts up (torchmetrics' sync, Lightning's
    ``sync_dist`` means), so a rank with one row fewer changes nothing.

    Args:
        num_rows: rows in the split.
        num_replicas, rank: ``trainer.world_size`` and ``trainer.global_rank``.
        order: every row index of the split once (the data module's ``evaluation_order``);
            ``None``: the split's own order.
    """

    def __init__(self, num_rows: int, num_replicas: int, rank: int, order: Sequence[int] | None = None) -> None:
        # (DistributedSampler's own __init__ would read the process group; nothing of it is used.)
        self.num_rows, self.num_replicas, self.rank = num_rows, num_replicas, rank
        self.order = range(num_rows) if order is None else order

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: evaluation order does not depend on the epoch."""

    def __iter__(self) -> Iterator[int]:
        return iter(self.order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.num_rows, self.num_replicas))


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that Lightning recognises as resumable.

    Its ``state_dict`` is the sampler's seed: a run resumed with another ``seed`` would see
    another order, which :meth:`load_state_dict` warns about.  (The position itself is restored
    by the data module; see the module docstring.)  Lightning may rebuild the loader around
    another sampler (``overfit_batches``: a sequential one); the state is then empty.
    """

    def state_dict(self) -> dict[str, int]:
        seed = getattr(self.sampler, "seed", None)
        return {} if seed is None else {"seed": seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        seed = getattr(self.sampler, "seed", None)
        if seed is not None and state.get("seed", seed) != seed:
            warnings.warn(
                f"resuming with seed={seed}, but the checkpoint was trained with seed={state['seed']}: "
                "the rest of this epoch follows another order (rows may repeat or be skipped); "
                f"fix: seed={state['seed']} to continue exactly",
                stacklevel=2,
            )
