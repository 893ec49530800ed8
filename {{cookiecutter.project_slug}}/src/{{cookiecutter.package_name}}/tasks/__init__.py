"""The tasks this project trains: one folder each (``tasks/<name>/``), found here by name.  To add one, copy a task
folder, rename it, and add ``configs/task/<name>.yaml`` and its data config(s) (README, "Add your own task")."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from omegaconf import DictConfig

from ..core.config.validate import validate_config
from ..core.errors import ConfigError
from ..core.task import Task


@cache
def tasks() -> dict[str, Task]:
    """Every task folder's ``TASK``, by its name (a folder without one, e.g. helpers the tasks share, is not a task)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        task = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None) if info.ispkg else None
        if task is not None:
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


def check_config(cfg: DictConfig, **options: object) -> Task:
    """The config's task, once the whole config passed :func:`..core.config.validate.validate_config`; every entry point starts here.

    Raises:
        ConfigError: an unknown task, or every problem of the config, one per line.
    """
    task = task_of(cfg)
    validate_config(cfg, task, **options)
    return task
