"""Random-number-generator states in every checkpoint, restored exactly on resume (Lightning saves none, so a
resumed run would draw other dropout masks)."""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch


def rng_states() -> dict:
    """torch (CPU, every CUDA device), ``random`` and NumPy states as tensors and lists (loadable with ``weights_only=True``)."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt_state), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_states(states: dict) -> None:
    """Restore what :func:`rng_states` returned (CUDA states only when this process has as many GPUs)."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    version, mt_state, gauss = states["python"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class RNGState(L.Callback):
    """Save the RNG states with each checkpoint; on resume restore them just before the first training batch, so
    sanity validation or loading cannot shift them (the loaders draw from their own generators)."""

    def __init__(self) -> None:
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        return rng_states()

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None
