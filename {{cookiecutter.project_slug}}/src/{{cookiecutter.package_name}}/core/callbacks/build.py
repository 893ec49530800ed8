"""The run's callbacks, built from the config (``lr_schedule``, ``pruning``, ``callbacks`` groups)."""

from __future__ import annotations

import logging

import hydra
from lightning.pytorch import Callback
from omegaconf import DictConfig

from ..config.instantiate import instantiate_group
from ..config.resolvers import to_plain
from ..run.distributed import uses_cuda
from .pruning import Pruning

log = logging.getLogger(__name__)


def instantiate_callbacks(cfg: DictConfig) -> list[Callback]:
    """The LR schedule first (it sets the LR others read), then pruning unless ``pruning.method`` is none (its masks
    settle before a guard or the step log writes), then ``callbacks`` less the ``needs_cuda`` ones on a run without CUDA."""
    pruning = []
    if (cfg.get("pruning") or {}).get("method", "none") != "none":
        pruning.append(Pruning(**to_plain(cfg.pruning)))
    callbacks = instantiate_group(cfg.get("callbacks"))
    if not uses_cuda(cfg):
        idle = [callback for callback in callbacks if getattr(callback, "needs_cuda", False)]
        if idle:
            log.info("Not on a CUDA GPU: left out %s (nothing to measure here)", ", ".join(type(c).__name__ for c in idle))
        callbacks = [callback for callback in callbacks if callback not in idle]
    return [hydra.utils.instantiate(cfg.lr_schedule), *pruning, *callbacks]
