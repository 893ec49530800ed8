"""The project's own tables of what a config, and so a checkpoint, may name by a plain word.

A checkpoint stores the module's settings (the ``model``, ``optimizer``, ... groups) so that eval,
predict, generate, export and quantize can rebuild the model.  A checkpoint is data: it may come
from a stranger.  So the groups a checkpoint stores name what to build by a key of a table below
(``optimizer.name: adamw``, ``model.fetch.kind: wheel_folder``), never by an import path, and the
import paths are this project's constants.  Add your own optimizer here, a model fetcher as a
``MODEL_FETCHER`` declaration in a module of ``core/assets/``.

This module imports nothing of the project's (every layer reads it); :func:`model_fetchers` reads
the declarations of ``core/assets/`` when first called.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

PACKAGE = __package__.split(".")[0]


@functools.cache
def model_fetchers() -> dict[str, str]:
    """``model.fetch.kind`` -> the function that installs the model files (its keyword arguments
    are the node's other keys), as ``.core.assets.<module>.<function>``: declared by each module of
    this package's ``core/assets/`` that has one (``MODEL_FETCHER = (kind, function name)``), so a
    single-task bake lists only the fetchers it has.  Read on first use (the modules are this
    project's own, imported then)."""
    assets = importlib.import_module(f"{PACKAGE}.core.assets")
    found = {}
    for info in sorted(pkgutil.iter_modules(assets.__path__), key=lambda info: info.name):
        declared = getattr(importlib.import_module(f"{assets.__name__}.{info.name}"), "MODEL_FETCHER", None)
        if declared is not None:
            kind, function = declared
            found[kind] = f".core.assets.{info.name}.{function}"
    return found


# optimizer.name -> the optimizer class (its keyword arguments are the group's other keys).
OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW",
    "sgd": "torch.optim.SGD",
    "adamw_8bit": "bitsandbytes.optim.AdamW8bit",  # 8-bit block-wise state (bitsandbytes)
    "paged_adamw_8bit": "bitsandbytes.optim.PagedAdamW8bit",  # the same, in CUDA unified memory
}


def import_path(path: str) -> object:
    """The object at ``path`` (``package.module.name``; a leading ``.`` is this package), imported.

    Raises:
        ImportError: the module or the name is not there (an optional package not installed).
    """
    module_path, _, name = path.rpartition(".")
    module = importlib.import_module(f"{PACKAGE}{module_path}" if module_path.startswith(".") else module_path)
    try:
        return getattr(module, name)
    except AttributeError as error:
        raise ImportError(f"{module.__name__} has no {name}") from error


def class_path_of(table: dict[str, str], name: str) -> str:
    """The absolute dotted path a table entry names (``.core.assets...`` made ``<package>.core.assets...``)."""
    path = table[name]
    return f"{PACKAGE}{path}" if path.startswith(".") else path


def is_8bit_optimizer(name: object) -> bool:
    """Whether ``optimizer.name`` is a bitsandbytes 8-bit optimizer (about 2 bytes of state per parameter)."""
    return OPTIMIZERS.get(str(name), "").startswith("bitsandbytes.")


def is_paged_optimizer(name: object) -> bool:
    """Whether ``optimizer.name`` keeps its state in CUDA unified memory (bitsandbytes' paged optimizers)."""
    return OPTIMIZERS.get(str(name), "").startswith("bitsandbytes.optim.Paged")
