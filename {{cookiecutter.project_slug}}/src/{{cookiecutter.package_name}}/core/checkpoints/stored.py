"""What a checkpoint may hold: plain values, never a class path, and file names that stay in
their folder.

A checkpoint is data, and may come from a stranger.  ``torch.load(weights_only=True)`` keeps its
unpickling from running code, but the *values* it holds are read by our code afterwards: a
stored ``_target_`` handed to Hydra's ``instantiate`` would run a function of the file's choice,
and a stored file name joined to a folder would write where the file likes.  So:

- **No class paths.**  The settings a checkpoint stores (``hyper_parameters``: the ``model``,
  ``optimizer``, ``peft``... groups) name what to build by a key of the project's own tables
  (:mod:`..config.named`: ``optimizer.name``, ``model.fetch.kind``).  A key that carries a class or
  function path anywhere in the checkpoint (:data:`CLASS_PATH_KEYS`: Hydra's ``_target_``,
  Lightning's ``_instantiator``/``_class_path``, transformers' ``auto_map``, also inside the stored
  tokenizer files) is refused, naming the key.  Nothing read from a checkpoint is instantiated
  or imported anyway (:func:`.io.load_trained_module`): what to build comes from the
  user's config and these tables.
- **Bare file names.**  The tokenizer is stored as ``{file name: text}``; each name must be a
  bare name (no separator, not ``.``/``..``), checked before anything is written.
- **Checkpoint-callback paths inside their folder.**  Lightning's ``ModelCheckpoint`` restores
  the paths of its best checkpoints on a resume and later deletes the one a new best replaces:
  each stored path must be a ``.ckpt`` file inside the stored ``dirpath``, with no ``..``.

**Migration** (:func:`migrate`): checkpoints written before this format stored the optimizer as
``optimizer._target_`` and the model fetcher as ``model.fetch._target_`` with ``_partial_: true``.
Exactly those nodes, holding exactly the class paths this project shipped (:data:`OLD_OPTIMIZERS`,
:func:`old_fetchers`), are rewritten in memory to the names of today's tables; the file is not
changed.  Any other class path is refused ("re-train").  Settings stored under a config group's
former name (``checkpointing``, before it became ``activation_checkpointing``:
:data:`..config.keys.RENAMED_GROUPS`) are read under the new name, the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import PurePosixPath, PureWindowsPath

from ..config.keys import RENAMED_GROUPS
from ..config.named import OPTIMIZERS, class_path_of, model_fetchers

# Keys whose value names code to import: Hydra's instantiate keys, Lightning's checkpoint
# instantiator (CVE-2026-58659), transformers' remote-code map.
CLASS_PATH_KEYS = frozenset(
    {"_target_", "_partial_", "_args_", "_recursive_", "_convert_", "_instantiator", "_class_path", "class_path", "auto_map"}
)
# Tensors only (parameter and optimizer-state names as keys): not walked.
TENSOR_ENTRIES = ("state_dict", "optimizer_states")
# The class paths the previous checkpoint format stored, and today's name for each (see migrate).
OLD_OPTIMIZERS = {path: name for name, path in OPTIMIZERS.items()}


def old_fetchers() -> dict[str, str]:
    """The previous format's ``model.fetch._target_`` of each fetcher -> its kind today.  That
    format was written when the fetchers lived in ``<package>/assets/`` (now ``core/assets/``),
    so the stored paths are spelled that way."""
    paths = {class_path_of(model_fetchers(), kind): kind for kind in model_fetchers()}
    return {path.replace(".core.assets.", ".assets.", 1): kind for path, kind in paths.items()}


# The ModelCheckpoint state entries that hold checkpoint paths Lightning may later delete.
CALLBACK_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def migrate(checkpoint: dict) -> list[str]:
    """Rewrite, in memory, the nodes of earlier formats to today's (see the module docstring);
    return one line per node rewritten.  Anything else is left for :func:`problems`."""
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
    """Everything in ``checkpoint`` (after :func:`migrate`) that is not plain data we can trust:
    class-path keys anywhere (named by their dotted key), names outside our tables, stored file
    names that are not bare, checkpoint-callback paths outside their folder."""
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
    """A stored tokenizer (``{file name: text}``): bare names, text values, and no class path in
    its JSON files (``auto_map``: remote code)."""
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
    r"""Whether ``name`` is a plain file name: a non-empty string with no path separator (``/``,
    ``\\``), no drive or NUL, not ``.`` or ``..``; joined to a folder it stays in that folder."""
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
