"""What a run is made of (its *identity*), and what a resume may change of it.

``train`` writes it to ``identity.json`` and every checkpoint: ``config`` (resolved, secrets masked, no ``hydra`` or
class-path keys: :mod:`..checkpoints.stored`) and ``files`` (sha256 of the data, base model and tokenizer files the
config names, :mod:`.hashes`; a Hub name by name).  A resume compares each key (:func:`check_resume_config`), and
:func:`resume_class` sorts a change (table in docs/reliability.md) as **refused** (:data:`REFUSED_ON_RESUME`,
:attr:`..task.Task.identity_keys`: model, tokenizer, labels, data...), **allowed** (:data:`ALLOWED_ON_RESUME`: ``max_steps``,
whose LR schedule stretches, loggers, devices...), **ignored** (:data:`NOT_IDENTITY`), or else needing
``resume.allow_changed=[key, ...]`` (``optimizer.lr``, the seed...).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..checkpoints.stored import CLASS_PATH_KEYS
from ..errors import ConfigError
from ..run.entry import atomic_write_path
from ..run.secrets import mask
from .hashes import combined, file_sha256, folder_sha256

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.json"
VERSION = 1

# Not identity: output/launch/display settings, installers, derived values, paths compared by content.
NOT_IDENTITY = (
    "paths.*",
    "ckpt_path",
    "resume.*",
    "task_name",
    "print_config",
    "plan_before_fit",
    "optimized_metric",
    "model.fetch.*",
    "data.fetch.*",
    "model.architecture.*",
    "model.finetune_lr",  # (what optimizer.lr defaults to: optimizer.lr is compared)
    "model.name_or_path",
    "model.tokenizer",
    "data.tokenizer",
    "data.splits.*",
    "data.cache_dir",
    "data.num_workers",
    "data.batch_size",
    "batch.device_batch_size",
    "batch.accumulate_grad_batches",
    "trainer.accumulate_grad_batches",
    "trainer.default_root_dir",
    "callbacks.*.dirpath",
    "callbacks.*.checkpoint_dir",
)
# Refused on a resume, for every task (a task adds its own: Task.identity_keys).
REFUSED_ON_RESUME = (
    "task.name",
    "task.module",
    "model.*",
    "peft.*",
    "qat.*",
    "data.max_length",
    "data.hub_name",
    "data.hub_config",
    "batch.global_batch_size",
    "trainer.precision",
)
# Changed on a resume without asking.
ALLOWED_ON_RESUME = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.strategy",
    "trainer.strategy.*",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "logger",
    "logger.*",
    "callbacks.progress_bar.*",
    "callbacks.gpu_stats.*",
    "callbacks.throughput.*",
    "callbacks.sample_generation.*",
    "test_after_fit",
    "data.splits.test (content)",  # (the test after the fit is an evaluation: new data is its job)
)
# The suffix of a Hub id's revision change (``model.name_or_path@revision``), allowed by name in resume.allow_changed.
REVISION = "@revision"
# What a schedule's length is read from: logged when a resume changes it.
SCHEDULE_LENGTH = ("trainer.max_steps", "trainer.max_epochs")
# The tokenizer's files in a model folder (the rest are the model's).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_SUFFIXES = (".model", ".tiktoken")


@dataclass(frozen=True)
class Change:
    """One compared key whose value differs: ``old`` (stored) and ``new`` (this launch), as text."""

    key: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.key}: {self.old} -> {self.new}"


def identity_of(config: dict) -> dict:
    """The identity of resolved ``config`` (:func:`plain_config`); call after ``prepare_data`` installed the files it hashes."""
    return {"version": VERSION, "config": config, "files": named_files(config)}


def plain_config(cfg: DictConfig) -> dict:
    """``cfg`` resolved into plain types, secrets masked, without ``hydra`` and class-path keys."""
    plain = {key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key] for key in cfg}
    plain.pop("hydra", None)
    return mask(_without_class_paths(plain))


def named_files(config: dict) -> dict[str, dict]:
    """``{config key: path_entry}`` of the data, model and tokenizer files a resolved config names."""
    files = {}
    data, model = config.get("data") or {}, config.get("model") or {}
    if data.get("hub_name") is None:
        for split, source in (data.get("splits") or {}).items():
            if isinstance(source, list):  # several files (a mix of training files)
                files.update({f"data.splits.{split}[{index}]": path_entry(str(item)) for index, item in enumerate(source)})
            elif source is not None:
                files[f"data.splits.{split}"] = path_entry(str(source))
    if model.get("name_or_path"):
        files["model.name_or_path"] = path_entry(str(model["name_or_path"]), model_files)
    if model.get("tokenizer"):
        files["model.tokenizer"] = path_entry(str(model["tokenizer"]), tokenizer_files)
    return files


def path_entry(given: str, pick=None) -> dict:
    """What is at ``given``: ``{"given", "resolved", "sha256"}`` (file), ``{..., "files": {name: sha256}}`` (folder, names
    filtered by ``pick``), ``{"given", "hub": true, "revision"}`` (a Hub id; the revision when the local cache has it), or
    ``{..., "missing": true}``."""
    path = Path(given).expanduser()
    if not path.exists():
        if is_local_path(given):
            return {"given": given, "resolved": str(path.resolve()), "missing": True}
        revision = hub_revision(given)
        return {"given": given, "hub": True, **({"revision": revision} if revision else {})}
    entry = {"given": given, "resolved": str(path.resolve())}
    if path.is_file():
        entry["sha256"] = file_sha256(path)
    else:
        digests = folder_sha256(path)
        entry["files"] = {name: digest for name, digest in digests.items() if pick is None or pick(name)}
    return entry


def hub_revision(name: str) -> str | None:
    """The commit hash the local Hugging Face cache resolves Hub id ``name`` to (its ``refs/main``), ``None`` when the cache
    lacks it (or ``name`` is no Hub id).  No network: huggingface_hub's ``snapshot_download(local_files_only=True)``."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, local_files_only=True)).name
    except Exception:  # (not cached: LocalEntryNotFoundError; not a repo id: HFValidationError)
        return None


def hub_or_files(name_or_path: str) -> object:
    """What a cache key holds for model weights: the folder's file hashes, or a Hub id with its cached revision (a new
    revision in the cache is another key, never the old table)."""
    if is_local_path(name_or_path) and Path(name_or_path).is_dir():
        return folder_sha256(Path(name_or_path))
    return {"hub": name_or_path, "revision": hub_revision(name_or_path)} if name_or_path else name_or_path


def tokenizer_files(name: str) -> bool:
    """Whether a folder's file ``name`` belongs to the tokenizer."""
    return name in TOKENIZER_FILES or name.endswith(TOKENIZER_SUFFIXES)


def model_files(name: str) -> bool:
    """Whether a model folder's file ``name`` is the model's, not the tokenizer's."""
    return not tokenizer_files(name)


def is_local_path(name: str) -> bool:
    """Whether ``name`` is a path (absolute, ``./``, ``~``, or existing) rather than a Hub id ``org/name``."""
    return os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)


def content_digest(entry: dict | None) -> str | None:
    """One digest of a :func:`path_entry` (``None``: nothing there, or a Hub name)."""
    if not entry:
        return None
    if "sha256" in entry:
        return entry["sha256"]
    if "files" in entry:
        return combined(entry["files"])
    return None


def differing_files(old: dict | None, new: dict | None) -> list[str]:
    """Names whose hash differs (or is on one side only) between two folder entries; ``[]`` unless both are folders."""
    if not (old and new and "files" in old and "files" in new):
        return []
    before, after = old["files"], new["files"]
    return sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))


def describe(entry: dict | None) -> str:
    """An entry as messages name it: ``sha256 <12 hex> of <resolved path>``."""
    if not entry:
        return "(none)"
    if entry.get("hub"):
        at = f" at revision {entry['revision']}" if entry.get("revision") else " (no revision recorded)"
        return f"the Hub name {entry['given']!r}{at}"
    if entry.get("missing"):
        return f"nothing at {entry['resolved']}"
    return f"sha256 {content_digest(entry)[:12]} of {entry['resolved']}"


def write_identity(identity: dict, run_dir: Path) -> Path:
    """``run_dir/identity.json``, written whole (:func:`..run.entry.atomic_write_path`)."""
    path = run_dir / IDENTITY_FILE
    with atomic_write_path(path) as partial:
        partial.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
    return path


def flatten(node: object, prefix: str = "") -> dict[str, object]:
    """``{dotted key: leaf}`` of nested dicts (a list is one leaf)."""
    if not isinstance(node, dict) or (not node and prefix):
        return {prefix: node}
    flat = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def resume_class(key: str, task_keys: tuple[str, ...] = ()) -> str:
    """``ignored`` | ``refused`` | ``allowed`` | ``allow_changed`` for a changed key (module docstring); file content and
    ``labels`` are refused, except the test split's."""
    if key.endswith(REVISION):  # a Hub id's cached revision moved: the user may know it is the same model
        return "allow_changed"
    if key.endswith(" (content)") or key == "labels":
        return "allowed" if key in ALLOWED_ON_RESUME else "refused"
    if any(fnmatch(key, pattern) for pattern in NOT_IDENTITY):
        return "ignored"
    if any(fnmatch(key, pattern) for pattern in (*REFUSED_ON_RESUME, *task_keys)):
        return "refused"
    if any(fnmatch(key, pattern) for pattern in ALLOWED_ON_RESUME):
        return "allowed"
    return "allow_changed"


ABSENT = object()


def config_changes(old: dict, new: dict) -> list[Change]:
    """Keys whose value differs (or is on one side only) between two resolved configs."""
    old_flat, new_flat = flatten(old), flatten(new)
    changes = []
    for key in sorted(set(old_flat) | set(new_flat)):
        before, after = old_flat.get(key, ABSENT), new_flat.get(key, ABSENT)
        if before != after:
            changes.append(Change(key, _text(before), _text(after)))
    return changes


def file_changes(old: dict, new: dict) -> list[Change]:
    """The named files whose content differs (``<key> (content)``); a Hub id's cached revision (``<key>@revision``: a
    resume may take it with ``resume.allow_changed``); an old entry with the name only is warned about."""
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if before and after and before.get("hub") and after.get("hub") and before.get("given") == after.get("given"):
            if before.get("revision") and after.get("revision") and before["revision"] != after["revision"]:
                changes.append(Change(f"{key}{REVISION}", describe(before), describe(after)))
            elif not before.get("revision"):
                log.warning("%s: the run recorded %s: whether its weights changed since cannot be checked", key, describe(before))
            continue
        if content_digest(before) != content_digest(after):
            differ = differing_files(before, after)
            detail = f" (differing files: {', '.join(differ[:5])})" if differ else ""
            changes.append(Change(f"{key} (content)", describe(before), describe(after) + detail))
    return changes


def resume_problems(changes: list[Change], task_keys: tuple[str, ...], allow_changed: list[str], where: str) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of resuming with ``changes``: problems for refused or not-allowed changes; notes for flagged,
    schedule-length and file changes.  ``where`` names the checkpoint in messages (``ckpt_path=...``)."""
    refused, unasked, notes = [], [], []
    for change in changes:
        kind = resume_class(change.key, task_keys)
        if kind == "refused":
            refused.append(str(change))
        elif kind == "allow_changed" and not any(fnmatch(change.key, pattern) for pattern in allow_changed):
            unasked.append(change)
        elif kind == "allow_changed":
            notes.append(f"resuming with {change} (resume.allow_changed)")
        elif change.key in SCHEDULE_LENGTH:
            notes.append(
                f"resuming with {change}: an extended run, not the uninterrupted longer one (from the checkpoint's step on, "
                "the LR schedule and epoch count follow the new length; the steps before followed the old one)"
            )
        elif change.key.endswith(" (content)"):
            notes.append(f"resuming with {change}")
    problems = []
    if refused:
        problems.append(
            f"{where} was trained with other inputs, and resuming it with these is refused (it would be another run "
            f"under the old run's steps): {'; '.join(refused)}; fix: resume with the run's own settings (its "
            f"{IDENTITY_FILE} and .hydra/config.yaml), or start a new run (drop ckpt_path)"
        )
    if unasked:
        keys = ",".join(change.key for change in unasked)
        problems.append(
            f"{where} was trained with other settings: {'; '.join(map(str, unasked))}; a resumed run would report "
            f"steps of both as one run; fix: resume.allow_changed=[{keys}] to continue with the change knowingly, or "
            "drop the override(s)"
        )
    return problems, notes


def check_allow_changed(allow_changed: list[str], task_keys: tuple[str, ...]) -> None:
    """Check that ``resume.allow_changed`` names only keys a resume may change.

    Raises:
        ConfigError: an entry names a refused key.
    """
    for pattern in allow_changed:
        kind = resume_class(str(pattern), task_keys)
        if kind == "refused":
            raise ConfigError(
                f"resume.allow_changed contains {pattern!r}, which a resume never changes (it is part of what the run is "
                "made of: model, tokenizer, labels, peft, architecture, task, data, max_length, global batch, precision); "
                "fix: drop it, and start a new run (drop ckpt_path) to train with another value"
            )


def check_resume_config(cfg: DictConfig, checkpoint: dict, where: str, task_keys: tuple[str, ...]) -> dict[str, list[str]]:
    """Before data or weights load: compare a resume's config with the checkpoint's identity; log allowed changes.
    Returns the run-length changes (``{"trainer.max_steps": [old, new]}``: an extended run, for ``metrics.json``).

    Raises:
        ConfigError: a refused change, a change not in ``resume.allow_changed``, or an entry of it that is refused or
            (without wildcards) names no key.
    """
    allow = [str(key) for key in OmegaConf.select(cfg, "resume.allow_changed", default=None) or []]
    check_allow_changed(allow, task_keys)
    identity = checkpoint.get("identity")
    if not isinstance(identity, dict):
        log.warning("%s was written before checkpoints recorded their run's identity: its config, data and model cannot be checked", where)
        return {}
    config = plain_config(cfg)
    keys = set(flatten(identity.get("config") or {})) | set(flatten(config))
    for pattern in allow:  # (a key that names nothing is a typo; a pattern may match nothing this time)
        if not set("*?[") & set(pattern) and pattern not in keys and not pattern.endswith(REVISION):
            close = difflib.get_close_matches(pattern, sorted(keys), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"resume.allow_changed contains {pattern!r}, which names no key of the run's config; {hint}fix: the dotted "
                "key the refusal names (e.g. resume.allow_changed=[optimizer.lr]; fnmatch patterns such as optimizer.* work)"
            )
    changes = config_changes(identity.get("config") or {}, config)
    problems, notes = resume_problems(changes, task_keys, allow, where)
    if problems:
        raise ConfigError("\n".join(problems))
    for note in notes:
        log.warning(note)
    return {change.key: [change.old, change.new] for change in changes if change.key in SCHEDULE_LENGTH}


def base_problem(entry: dict, name_or_path: str, where: str) -> str | None:
    """Why ``name_or_path`` is not the base an adapter checkpoint was trained on (``entry``): its model files differ
    (message names paths, hashes, differing files); ``None`` when the same (a Hub base: the same name)."""
    now = path_entry(name_or_path, model_files)
    if entry.get("hub") and entry.get("given") == now.get("given"):
        if not (entry.get("revision") and now.get("revision") and entry["revision"] != now["revision"]):
            return None  # (the same revision, or one side unknown: an old checkpoint's name only)
        return (
            f"{where} holds adapters trained on {describe(entry)}, and the local Hugging Face cache now resolves it to "
            f"revision {now['revision']}: the adapters would be applied to another model; fix: put that revision in a folder "
            f"(huggingface-cli download {entry['given']} --revision {entry['revision']} --local-dir DIR) and pass "
            "model.name_or_path=DIR on the command line"
        )
    if not entry.get("hub") and content_digest(now) == content_digest(entry):
        return None
    differ = differing_files(entry, now)
    return (
        f"{where} holds adapters trained on the base {describe(entry)}, and model.name_or_path={name_or_path!r} holds "
        f"{describe(now)} (differing files: {', '.join(differ[:5]) or 'all'}): the adapters would be applied to another "
        "model; fix: model.name_or_path=<the folder the run was trained on> on the command line, or re-train on this base"
    )


def command_line_value(key: str) -> str | None:
    """The value of ``key=...`` on this Hydra app's command line, else ``None``."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    for override in HydraConfig.get().overrides.task:
        name, _, value = override.partition("=")
        if name.lstrip("+~") == key:
            return value
    return None


def _text(value: object) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value) if not isinstance(value, str) else value


def _without_class_paths(node: object) -> object:
    if isinstance(node, dict):
        return {key: _without_class_paths(value) for key, value in node.items() if key not in CLASS_PATH_KEYS}
    if isinstance(node, list):
        return [_without_class_paths(value) for value in node]
    return node
