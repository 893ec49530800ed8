"""The tasks this project trains: one folder each (``tasks/<name>/``), found here by name.

To add a task, copy a task folder, rename it, and add ``configs/task/<name>.yaml`` and its data
config(s): nothing else in the framework names a task (see the README, "Add your own task").
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

import hydra
import lightning as L
from omegaconf import DictConfig

from ..errors import ConfigError
from ..models.inputs import ModelInputs
from ..utils.config import to_plain
from .base import Task


@cache
def tasks() -> dict[str, Task]:
    """Every task folder's ``TASK``, by its name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            task = importlib.import_module(f"{__name__}.{info.name}").TASK
            found[task.name] = task
    return found


def task_of(cfg: DictConfig | str) -> Task:
    """The task a config (``task.name``) or a name selects.

    Raises:
        ConfigError: no task folder has that name.
    """
    name = cfg if isinstance(cfg, str) else cfg.task.name
    known = tasks()
    if name not in known:
        raise ConfigError(f"task.name={name!r} is not one of this project's tasks {sorted(known)}; fix: task={sorted(known)[0]}")
    return known[name]


def module_class(cfg: DictConfig) -> type[L.LightningModule]:
    """The task's LightningModule class, as the user's config names it (``task.module``; never a
    checkpoint's)."""
    return hydra.utils.get_class(cfg.task.module)


def build_module(cfg: DictConfig, **replace: dict) -> L.LightningModule:
    """The task module of a config, as train, plan and eval build it: the class of ``task.module``
    with each group of ``task.module_args`` as a plain dict (``replace``: groups given instead),
    handed the facts the config gives before any data is read (``models.inputs.ModelInputs.before_data``:
    ``trainer.precision``, ``data.max_length``, ``data.batch_size``); the data's follow when it is
    set up (``models.inputs.ConnectData``)."""
    args = {group: to_plain(cfg[group]) for group in cfg.task.module_args}
    module = module_class(cfg)(**{**args, **replace})
    data = cfg.get("data") or {}
    module.connect(ModelInputs.before_data(str(cfg.trainer.precision), data.get("max_length"), int(data.get("batch_size") or 1)))
    return module
