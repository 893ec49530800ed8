"""What a checkpoint may hold: plain values, no class path, file names that stay in their folder.

A checkpoint may come from a stranger: ``weights_only=True`` stops unpickled code, but a stored ``_target_`` given to
``instantiate`` would run code of the file's choice, and a stored file name could write outside its folder.  So:

- **No class paths** (:data:`CLASS_PATH_KEYS`, also in tokenizer files): builds use :mod:`..config.named` names only.
- **Bare tokenizer file names**; **callback paths inside their folder** (``ModelCheckpoint`` later deletes them).

:func:`migrate` rewrites, in memory, exactly the class paths older checkpoints stored (:data:`OLD_OPTIMIZERS`,
:func:`old_fetchers`) and renamed groups (:data:`..config.keys.RENAMED_GROUPS`); any other class path is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import PurePosixPath, PureWindowsPath

from ..config.keys import RENAMED_GROUPS
from ..config.named import OPTIMIZERS, class_path_of, model_fetchers

# Keys naming code to import: Hydra's instantiate keys, Lightning's instantiator (CVE-2026-58659), transformers' auto_map.
CLASS_PATH_KEYS = frozenset(
    {"_target_", "_partial_", "_args_", "_recursive_", "_convert_", "_instantiator", "_class_path", "class_path", "auto_map"}
)
# Tensors only (parameter and optimizer-state names as keys): not walked.
TENSOR_ENTRIES = ("state_dict", "optimizer_states")
# The previous format's optimizer class paths -> today's names.
OLD_OPTIMIZERS = {path: name for name, path in OPTIMIZERS.items()}


def old_fetchers() -> dict[str, str]:
    """The previous format's ``model.fetch._target_`` -> kind today (the fetchers lived in ``<package>/assets/`` then)."""
    paths = {class_path_of(model_fetchers(), kind): kind for kind in model_fetchers()}
    return {path.replace(".core.assets.", ".assets.", 1): kind for path, kind in paths.items()}


# The ModelCheckpoint state entries that hold checkpoint paths Lightning may later delete.
CALLBACK_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def migrate(checkpoint: dict) -> list[str]:
    """Rewrite earlier formats' nodes in memory (see the module docstring); one note per node.  The rest is for :func:`problems`."""
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict):
        return []
    notes = []
    optimizer = hparams.get("optimizer")
    if isinstance(optimizer, dict) and "name" not in optimizer and optimizer.get("_target_") in OLD_OPTIMIZERS:
        target = optimizer.pop("_target_")
        optimizer["name"] = OLD_OPTIMIZERS[target]
        notes.append(f"hyper_parameters.optimizer._target_={target!r} -> optimizer.name={optimizer['name']!r}")
    for old, new in RENAMED_GROUPS.items():  # module arguments named after their config group
        if old in hparams and new not in hparams:
            hparams[new] = hparams.pop(old)
            notes.append(f"hyper_parameters.{old} -> {new}")
    model = hparams.get("model")
    fetch = model.get("fetch") if isinstance(model, dict) else None
    if isinstance(fetch, dict) and set(fetch) & {"_target_", "_partial_"} and fetch.get("_target_") in old_fetchers():
        if fetch.get("_partial_") is True and not set(fetch) & (CLASS_PATH_KEYS - {"_target_", "_partial_"}):
            target = fetch.pop("_target_")
            fetch.pop("_partial_")
            fetch["kind"] = old_fetchers()[target]
            notes.append(f"hyper_parameters.model.fetch._target_={target!r} -> model.fetch.kind={fetch['kind']!r}")
    return notes


def problems(checkpoint: dict) -> list[str]:
    """What in ``checkpoint`` (after :func:`migrate`) is not trusted plain data, one line each (see the module docstring)."""
    found = [f"{key} holds a class path ({_short(value)})" for key, value in _class_path_keys(checkpoint, "")]
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, dict):
        optimizer = hparams.get("optimizer")
        if isinstance(optimizer, dict) and "name" in optimizer and optimizer["name"] not in OPTIMIZERS:
            found.append(f"hyper_parameters.optimizer.name={_short(optimizer['name'])} is not one of {sorted(OPTIMIZERS)}")
        model = hparams.get("model")
        fetch = model.get("fetch") if isinstance(model, dict) else None
        if isinstance(fetch, dict) and "kind" in fetch and fetch["kind"] not in model_fetchers():
            found.append(f"hyper_parameters.model.fetch.kind={_short(fetch['kind'])} is not one of {sorted(model_fetchers())}")
    inputs = checkpoint.get("model_inputs")
    files = inputs.get("tokenizer_files") if isinstance(inputs, dict) else None
    if files is not None:
        found += tokenizer_file_problems(files, "model_inputs.tokenizer_files")
    callbacks = checkpoint.get("callbacks")
    for name, state in callbacks.items() if isinstance(callbacks, dict) else ():
        if isinstance(state, dict) and "dirpath" in state:
            found += _callback_path_problems(state, f"callbacks[{_short(name, 60)}]")
    return found


def tokenizer_file_problems(files: object, key: str) -> list[str]:
    """Problems of a stored tokenizer: non-bare names, non-text values, class paths in its JSON (``auto_map``: remote code)."""
    if not isinstance(files, dict):
        return [f"{key} is not a mapping of file names to text"]
    found = []
    for name, text in files.items():
        if not is_bare_name(name):
            found.append(f"{key} has the file name {_short(name)}, which is not a bare file name (it would be written outside its folder)")
        elif not isinstance(text, str):
            found.append(f"{key}[{name!r}] is not text")
        elif name.endswith(".json"):
            try:
                content = json.loads(text)
            except ValueError:
                found.append(f"{key}[{name!r}] is not valid JSON")
                continue
            found += [f"{key}[{name!r}].{inner} holds a class path ({_short(value)})" for inner, value in _class_path_keys(content, "")]
    return found


def is_bare_name(name: object) -> bool:
    r"""Whether ``name`` stays in a folder it is joined to: non-empty, no ``/``, ``\\``, drive or NUL, not ``.``/``..``."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(character in name for character in "/\\\0:")
        and PurePosixPath(name).name == name
        and PureWindowsPath(name).name == name
    )


def _callback_path_problems(state: dict, key: str) -> list[str]:
    dirpath = state.get("dirpath")
    paths = [(f"{key}.{entry}", state.get(entry)) for entry in CALLBACK_PATHS]
    best = state.get("best_k_models")
    paths += [(f"{key}.best_k_models", path) for path in (best if isinstance(best, dict) else {})]
    found = []
    for where, path in paths:
        if path in (None, ""):
            continue
        if not isinstance(path, str) or not isinstance(dirpath, str) or not _ckpt_inside(path, dirpath):
            found.append(
                f"{where}={_short(path)} is not a .ckpt file inside its dirpath {_short(dirpath)} (Lightning would delete it later)"
            )
    return found


def _ckpt_inside(path: str, folder: str) -> bool:
    if "://" in path or ".." in PurePosixPath(path).parts or not path.endswith(".ckpt"):
        return False
    folder = os.path.normpath(os.path.abspath(folder))
    return os.path.dirname(os.path.normpath(os.path.abspath(path))) == folder


def _class_path_keys(node: object, path: str) -> Iterator[tuple[str, object]]:
    """``(dotted key, value)`` of every :data:`CLASS_PATH_KEYS` key below ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not path and key in TENSOR_ENTRIES:
                continue
            where = f"{path}.{key}" if path else str(key)
            if key in CLASS_PATH_KEYS:
                yield where, value
            yield from _class_path_keys(value, where)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _class_path_keys(value, f"{path}[{index}]")


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
