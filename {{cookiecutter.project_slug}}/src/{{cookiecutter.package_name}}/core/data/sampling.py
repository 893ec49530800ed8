"""A training order that a resumed run can re-enter part-way through an epoch.

The order is a pure function of ``(seed, epoch)``, never of the global RNG, and a resumed sampler skips the rows
its epoch had trained on. :class:`.batching.TokenizedDataModule` saves ``(epoch, rows done)`` from Lightning's loop
counters (a loader's own count runs one prefetched batch ahead). Under DDP the sampler shards the epoch itself
(rank ``r`` of ``W`` takes rows ``r, r + W, ...``, padded as ``DistributedSampler`` does); it subclasses
``DistributedSampler`` so Lightning does not wrap it (the wrapper neither passes ``set_epoch`` on nor survives
a shortened epoch). Positions are global rows, so every rank resumes where it stopped."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler
from transformers.trainer_pt_utils import get_length_grouped_indices


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, epoch)``, the same in any process (an int tuple's ``hash`` ignores ``PYTHONHASHSEED``)."""
    return torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFF_FFFF_FFFF_FFFF)


class ResumableSampler(DistributedSampler):
    """Row indices of one training epoch, shuffled (or length-grouped) from ``(seed, epoch)`` only, optionally
    from part-way in; with ``num_replicas`` processes (``trainer.world_size``), this ``rank``'s share.

    Args:
        lengths: tokens per row; given, the order is transformers' ``get_length_grouped_indices`` for ``batch_size``
            (random mega-batches of 50 micro-batches, each sorted by length).

    ``len()`` is always this rank's whole epoch (Lightning counts batches from it); after :meth:`resume_at`
    the next ``iter()`` yields only the rows not yet trained on.
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
        """Make the next ``iter()`` continue ``epoch`` after ``rows_done`` rows (all ranks); a finished epoch goes on to the next."""
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
    """This rank's share of an evaluation split, in ``order`` (default: the split's) and unpadded: rank ``r`` of ``n``
    gets ``order[r], order[r + n], ...``, so each row counts once (``DistributedSampler`` pads by repeating rows);
    the metrics sum over ranks, so uneven shares are fine."""

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
    """A ``DataLoader`` over a :class:`ResumableSampler` that Lightning recognises as resumable. Its state is the
    sampler's seed (a resume with another one warns; empty when Lightning swaps the sampler, e.g. ``overfit_batches``);
    the data module restores the position."""

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
