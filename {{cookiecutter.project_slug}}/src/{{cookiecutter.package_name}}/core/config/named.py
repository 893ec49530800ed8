"""The project's own tables of what a config, and so a checkpoint, may name by a plain word.

A checkpoint is data: it may come from a stranger.  So its stored groups name what to build by a key of a table here
(``optimizer.name: adamw``), never by an import path.  Add an optimizer here, a model fetcher as a ``MODEL_FETCHER``
in a module of ``core/assets/``.  Imports nothing of the project's (every layer reads it).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

PACKAGE = __package__.split(".")[0]


@functools.cache
def model_fetchers() -> dict[str, str]:
    """``model.fetch.kind`` -> ``.core.assets.<module>.<function>``, from each ``core/assets/`` module's
    ``MODEL_FETCHER = (kind, function name)``; read on first use."""
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
