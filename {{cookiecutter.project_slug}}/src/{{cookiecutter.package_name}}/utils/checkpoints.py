"""Checkpoint files that survive a kill, and finding the one to resume from.

Lightning's ``TorchCheckpointIO`` serialises a checkpoint in memory and then writes it over the
target path: a kill during that write leaves a truncated ``last.ckpt``, and the run can no longer
resume.  :class:`AtomicCheckpointIO` writes to a hidden temporary file next to the target
(``.last.ckpt.partial``), flushes it to disk and renames it into place (``os.replace``: atomic on POSIX and Windows file
systems), so ``last.ckpt`` is always either the previous complete checkpoint or the new one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig

from .config import ConfigError
from .run import atomic_write_path

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are all-or-nothing (see the module docstring): written
    through :func:`.run.atomic_write_path`.  Set through ``trainer.plugins``; remote paths
    (``s3://``...) fall back to Lightning's save.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        if not isinstance(get_filesystem(path), type(get_filesystem("."))):
            super().save_checkpoint(checkpoint, path)
            return
        with atomic_write_path(Path(path)) as partial, partial.open("wb") as file:
            self.write(checkpoint, file)

    def write(self, checkpoint: dict[str, Any], file: Any) -> None:
        """Serialise ``checkpoint`` into the open temporary ``file`` (a seam for fault-injection tests)."""
        torch.save(checkpoint, file)


def last_checkpoint(cfg: DictConfig) -> Path:
    """Where ``last.ckpt`` of this run lives: the folder of the checkpoint callback that keeps it."""
    for callback in (cfg.get("callbacks") or {}).values():
        if callback is not None and callback.get("save_last") and callback.get("dirpath"):
            return Path(callback.dirpath) / "last.ckpt"
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def save_final_checkpoint(trainer: L.Trainer) -> Path | None:
    """Write ``last.ckpt`` of the weights a finished fit ended with, unless it holds them already;
    returns its path (``None`` when no checkpoint callback keeps a ``last.ckpt``).

    ``ModelCheckpoint`` saves ``last.ckpt`` every ``every_n_train_steps``, and at an epoch's end
    only if it saved in that step, so after the fit it can be up to that many steps old; ``eval``,
    ``export`` and ``quantize`` of ``last.ckpt`` then read the final weights (and a resume with
    a larger ``trainer.max_steps`` continues from them).  Every rank calls it (a DDP save is collective).
    """
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            if not path.is_file() or read_checkpoint(path, "global_step") != trainer.global_step:
                trainer.save_checkpoint(path)
            return path
    return None


def resolve_ckpt_path(cfg: DictConfig) -> Path | None:
    """The checkpoint ``ckpt_path`` names: ``null`` -> none; ``last`` -> this run's ``last.ckpt``,
    or none (a fresh start, logged) when the run has not saved one yet; else that file
    (``validate_config`` has checked that it exists; :func:`read_checkpoint` checks that it is
    readable)."""
    value = cfg.get("ckpt_path")
    if value is None:
        return None
    path = last_checkpoint(cfg) if str(value) == "last" else Path(str(value))
    if str(value) == "last" and not path.is_file():
        log.warning("ckpt_path=last: no %s yet, so training starts from scratch", path)
        return None
    return path


def read_checkpoint(path: Path, key: str) -> Any:
    """One top-level entry of a checkpoint, read memory-mapped with ``weights_only=True`` (so a
    multi-GB checkpoint is not read whole, and no pickled code runs).

    Raises:
        ConfigError: the file is not a complete checkpoint (e.g. cut short by a full disk).
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # torch raises RuntimeError/UnpicklingError/EOFError for damaged files
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a readable checkpoint ({type(error).__name__}: {error}); "
            "fix: resume from another checkpoint of the run (RUN/checkpoints/*.ckpt)"
        ) from error
    return checkpoint.get(key)


def trained_checkpoint(path: str | Path) -> dict:
    """A checkpoint ``train`` wrote, checked before eval, predict, generate, export or quantize
    load it: read memory-mapped with ``weights_only=True`` (the weights are not read here).

    Raises:
        ConfigError: the file is not a readable torch checkpoint (a CSV, a safetensors file, one
            cut short), or not one of ``train``'s (no ``state_dict``, ``hyper_parameters`` or
            ``model_inputs``: e.g. a checkpoint of another Lightning project).
    """
    fix = "fix: ckpt_path=RUN/checkpoints/last.ckpt (or a best-*.ckpt next to it) of a run of this project's train"
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # RuntimeError/UnpicklingError/EOFError/ValueError for what is not a checkpoint
        raise ConfigError(f"ckpt_path={str(path)!r} is not a readable checkpoint ({type(error).__name__}: {error}); {fix}") from error
    missing = [
        key for key in ("state_dict", "hyper_parameters", "model_inputs") if not isinstance(checkpoint, dict) or key not in checkpoint
    ]
    if missing:
        raise ConfigError(f"ckpt_path={str(path)!r} is not a checkpoint written by train (no {', '.join(missing)}); {fix}")
    return checkpoint
