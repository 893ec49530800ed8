"""Checkpoint files that survive a kill, and finding the one to resume from.

Lightning's ``TorchCheckpointIO`` writes over the target, so a kill mid-write leaves a truncated ``last.ckpt``.
:class:`AtomicCheckpointIO` writes a hidden ``.last.ckpt.partial``, flushes it and renames it into place (``os.replace``:
atomic on POSIX and Windows), so ``last.ckpt`` is always a complete checkpoint.  With ``background=True`` (shipped) writes
run on a thread (:mod:`.writer`); :class:`AtomicCheckpointIO` says how repeated saves become hard links.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, DiskFull
from ..identity.fingerprint import command_line_value, is_local_path
from ..run.entry import atomic_write_path
from . import stored
from .writer import HOST_RESERVE, BackgroundWriter, Stager, fingerprint, host_available, link_into_place, unique_tensors

log = logging.getLogger(__name__)

# A write that found no room: a full disk (ENOSPC) or quota (EDQUOT).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def checkpoint_bytes(checkpoint: object) -> int:
    """Bytes of every tensor in ``checkpoint`` (nested dicts and lists walked; a shared storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in unique_tensors(checkpoint).values()}
    return sum(storages.values())


def ran_out_of_space(error: BaseException) -> bool:
    """Whether a failed write found no room: an ENOSPC/EDQUOT ``OSError`` in ``error`` or its chain (torch's zip writer reports
    one as ``RuntimeError: [enforce fail ...] unexpected pos``, with the file's ``OSError`` as its context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with all-or-nothing saves (:func:`..run.entry.atomic_write_path`); remote paths use Lightning's.

    A full disk raises :class:`DiskFull` (size, free bytes; the previous file intact).  With ``background``, saves are
    staged to host memory and written on a thread (:mod:`.writer`; synchronously if host memory less a 2 GiB reserve is
    short; ``pin_memory=None``: pinned with CUDA); a save of the same state to another file of the folder (``last.ckpt``
    after ``best-*.ckpt``) is a hard link; a write's error is raised at the next save, :meth:`flush` or ``teardown``.
    ``hold_saves`` (:class:`..callbacks.checkpoint_writes.HoldStepCheckpoint`) holds a staged checkpoint until
    :meth:`release`: a save of the same ``global_step`` before then replaces it, and the held name becomes a link.
    """

    def __init__(self, background: bool = False, pin_memory: bool | None = None) -> None:
        super().__init__()
        self.background = background
        self.stager = Stager(pin_memory)
        self.writer = BackgroundWriter()
        self._previous: tuple[Path, object] | None = None  # (file, fingerprint) of the last save queued
        self._linked: set[Path] = set()  # files already linked to the previous save's
        self._held: tuple[Path, dict, object] | None = None  # (file, staged checkpoint, global_step) not yet queued
        self.hold_saves = False
        self.last_saved: tuple[Path, object, int] | None = None  # (file, global_step, number) of the last save asked for
        self._warned = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        self.last_saved = (Path(path), checkpoint.get("global_step"), (self.last_saved or (None, None, 0))[2] + 1)
        if not isinstance(get_filesystem(path), type(get_filesystem("."))):
            self.flush()
            super().save_checkpoint(checkpoint, path)
            return
        path = Path(path)
        if not self.background:
            self._write_file(checkpoint, path)
            return
        self.writer.raise_failure()
        state = fingerprint(checkpoint)
        previous, self._previous = self._previous, (path, state)
        if previous is not None and previous[1] == state and previous[0] != path and previous[0].parent == path.parent:
            self._previous = previous
            if path not in self._linked:
                self._link(previous[0], path)
            return
        superseded = self._supersede(path, checkpoint.get("global_step"))
        self._linked = set()
        self.flush()  # one checkpoint staged at a time; its buffers are free again
        needed, available = self.stager.bytes_to_allocate(checkpoint), host_available()
        if available is not None and needed > available - HOST_RESERVE:
            if not self._warned:
                self._warned = True
                log.warning(
                    "checkpoint %s: staging it for the background write needs %.2f GiB of host memory and %.2f GiB is available "
                    "(less a %.0f GiB reserve): written synchronously instead",
                    path,
                    needed / 2**30,
                    available / 2**30,
                    HOST_RESERVE / 2**30,
                )
            self._previous = None
            self._write_file(checkpoint, path)
            if superseded is not None:
                link_into_place(path, superseded)
            return
        staged = self.stager.stage(checkpoint)
        if superseded is not None:
            self._queue_write(staged, path)
            self._link(path, superseded)
        elif self.hold_saves:
            self._held = (path, staged, checkpoint.get("global_step"))
        else:
            self._queue_write(staged, path)

    def _queue_write(self, staged: dict, path: Path) -> None:
        def write() -> None:
            try:
                self._write_file(staged, path)
            finally:
                self.stager.release(staged)

        self.writer.submit(write)

    def _link(self, source: Path, target: Path) -> None:
        """Queue ``target`` as a second name of ``source`` (after ``source``'s write)."""
        self.release()
        self._linked.add(target)
        self.writer.submit(lambda: link_into_place(source, target))

    def _supersede(self, path: Path, step: object) -> Path | None:
        """Before a full save at ``step``: drop a held checkpoint of that step and folder and return its file (to link to
        ``path``; ``None`` if it is ``path``); queue any other held one."""
        if self._held is not None and step is not None and self._held[2] == step and self._held[0].parent == path.parent:
            held_path, staged, _ = self._held
            self._held = None
            self.stager.release(staged)
            return None if held_path == path else held_path
        self.release()
        return None

    def release(self) -> None:
        """Queue the held checkpoint's write, if one is held."""
        if self._held is not None:
            path, staged, _ = self._held
            self._held = None
            self._queue_write(staged, path)

    def _write_file(self, checkpoint: dict[str, Any], path: Path) -> None:
        try:
            with atomic_write_path(path) as partial, partial.open("wb") as file:
                self.write(checkpoint, file)
        except Exception as error:
            if not ran_out_of_space(error):
                raise
            raise DiskFull(path, checkpoint_bytes(checkpoint), shutil.disk_usage(path.parent).free) from error

    def flush(self) -> None:
        """Write the held checkpoint and wait for all queued writes; raises a failed write's error (:class:`DiskFull`...)."""
        self.release()
        self.writer.flush()

    def wait(self) -> None:
        """:meth:`flush` without raising a write's error (kept for the next :meth:`flush`)."""
        self.release()
        self.writer.wait()

    def remove_checkpoint(self, path: str | Path) -> None:
        """Lightning's remove; with ``background`` queued after earlier writes (which may write or link that file)."""
        if not self.background:
            super().remove_checkpoint(path)
            return
        self.release()
        remove = super().remove_checkpoint
        self.writer.submit(lambda: remove(path))

    def teardown(self) -> None:
        """End of a fit/validate/test, also after an error: wait for queued writes.  Their error waits for the next
        :meth:`flush` (raised here it would replace the error that ended the fit)."""
        self.wait()

    def load_checkpoint(self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, always ``weights_only=True`` (a resume unpickles no code; train checked it: :func:`trained_checkpoint`)."""
        self.flush()
        placement = {} if map_location is None else {"map_location": map_location}  # (else Lightning's default)
        return super().load_checkpoint(path, weights_only=True, **placement)

    def write(self, checkpoint: dict[str, Any], file: Any) -> None:
        """Serialise ``checkpoint`` into the open temporary ``file`` (a seam for fault-injection tests)."""
        torch.save(checkpoint, file)


def flush_checkpoints(trainer: L.Trainer | None, raise_error: bool = True) -> None:
    """Wait for ``trainer``'s background checkpoint writes; raises a failed one's error unless ``raise_error`` is false
    (a run already failing).  No-op for other IOs."""
    io = trainer.strategy.checkpoint_io if trainer is not None else None
    if isinstance(io, AtomicCheckpointIO):
        io.flush() if raise_error else io.wait()


def last_checkpoint(cfg: DictConfig) -> Path:
    """This run's ``last.ckpt``: in the folder of the checkpoint callback that keeps it."""
    for callback in (cfg.get("callbacks") or {}).values():
        if callback is not None and callback.get("save_last") and callback.get("dirpath"):
            return Path(callback.dirpath) / "last.ckpt"
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def save_final_checkpoint(trainer: L.Trainer) -> Path | None:
    """Write ``last.ckpt`` of the fit's final weights unless it holds them (``ModelCheckpoint`` saves it every
    ``every_n_train_steps``); returns its path, ``None`` if no callback keeps one.  Every rank calls it (DDP save is collective)."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            flush_checkpoints(trainer)
            if not path.is_file() or read_checkpoint(path, "global_step") != trainer.global_step:
                trainer.save_checkpoint(path)
                flush_checkpoints(trainer)  # on disk when its path is returned
            return path
    return None


def best_checkpoint(trainer: L.Trainer) -> str:
    """The best checkpoint the first checkpoint callback tracks, in that callback's folder (``""``: none).  A checkpoint copied
    from another run folder and resumed restores Lightning's ``best_model_path`` of that folder, another run's file: the file
    of that name in this folder stands for it if there is one, else there is no best."""
    callback = trainer.checkpoint_callback
    best, folder = getattr(callback, "best_model_path", "") or "", getattr(callback, "dirpath", None)
    if best and folder and Path(best).resolve().parent != Path(folder).resolve():
        here = Path(folder) / Path(best).name
        best = str(here) if here.is_file() else ""
    return best


def read_checkpoint(path: Path, key: str) -> Any:
    """One top-level entry of a checkpoint, read with ``mmap=True`` (not read whole) and ``weights_only=True`` (no pickled code).

    Raises:
        ConfigError: not a complete checkpoint (e.g. cut short by a full disk).
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
    """A ``train`` checkpoint, read mmap'd with ``weights_only=True``, migrated and checked as data (:mod:`.stored`).

    Raises:
        ConfigError: not a readable torch checkpoint; not one of ``train``'s (no ``state_dict``, ``hyper_parameters`` or
            ``model_inputs``); or it holds what a checkpoint may not (one line naming every key).
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
    for note in stored.migrate(checkpoint):
        log.info("ckpt_path=%s, written by an earlier version of this project: read as %s", path, note)
    found = stored.problems(checkpoint)
    if found:
        raise ConfigError(
            f"ckpt_path={str(path)!r} is refused: {'; '.join(found)}. A checkpoint holds plain values only, and this one would "
            "make us import code or write files outside their folder; nothing was loaded or written. "
            "fix: a checkpoint written by this project's train (re-train if it came from elsewhere)"
        )
    return checkpoint


def load_trained_module(module_class: type[L.LightningModule], cfg: DictConfig, path: str | Path, **overrides: object) -> L.LightningModule:
    """The module of a ``train`` checkpoint, built without instantiating anything the checkpoint names.

    Arguments: the checked stored groups plus ``overrides``.  The stored ``model.fetch`` never runs: the config's replaces
    it if it installs the same ``model.name_or_path`` (an adapter's base is re-read there).  Then as ``load_from_checkpoint``.

    Raises:
        ConfigError: see :func:`trained_checkpoint`; another task's checkpoint; an adapter whose base folder is missing and
            not installed by the config, or differs from the run's (:func:`..identity.fingerprint.base_problem`); weights
            that do not fit (including an adapter checkpoint lacking a weight the base would draw at random).
    """
    checkpoint = trained_checkpoint(path)
    parameters = inspect.signature(module_class.__init__).parameters
    task, wanted = checkpoint.get("task"), getattr(module_class, "TASK_NAME", "")
    foreign = sorted(set(checkpoint["hyper_parameters"]) - set(parameters))  # (a checkpoint from before "task" was stored)
    if task is not None and task != wanted and task == (cfg.get("task") or {}).get("name"):  # the config is right: the verb is not
        raise ConfigError(
            f"ckpt_path={str(path)!r} holds a model of task={task}, and this command loads task={wanted} models only (generate, "
            f"chat and serve write text with a causal LM); fix: eval (or predict) for a task={task} model"
        )
    if (task is not None and task != wanted) or (task is None and foreign):
        raise ConfigError(
            f"ckpt_path={str(path)!r} holds a model of task={task or 'another task'} (its stored settings "
            f"{'name that task' if task else 'include ' + ', '.join(foreign)}), and this config runs task={wanted}; "
            f"fix: {'task=' + task if task else 'the task'} and the experiment it was trained with (e.g. experiment=...)"
        )
    stored = {key: value for key, value in checkpoint["hyper_parameters"].items() if key in parameters}
    model = dict(stored.get("model") or {})
    model["fetch"] = fetch_of_same_base(cfg, model)
    peft = overrides.get("peft", stored.get("peft")) or {}
    identity = checkpoint.get("identity")
    if not isinstance(identity, dict):
        log.warning("ckpt_path=%s was written before checkpoints recorded their run's identity: its base model cannot be checked", path)
    entry = ((identity or {}).get("files") or {}).get("model.name_or_path")
    if peft.get("method", "none") != "none" and model.get("name_or_path"):  # an adapter checkpoint: its frozen base is re-read
        model["name_or_path"] = adapter_base(str(model["name_or_path"]), entry)
    base = model.get("name_or_path")
    if peft.get("method", "none") != "none" and model["fetch"] is None and is_local_path(str(base)) and not Path(str(base)).exists():
        raise ConfigError(
            f"ckpt_path={str(path)!r} holds LoRA adapters whose frozen base model.name_or_path={base!r} (stored in the checkpoint) "
            "is not on this machine, and the config does not install it; fix: model.name_or_path=<the folder it is in now> "
            "on the command line (its files are compared with the run's), the model/experiment config the checkpoint was "
            "trained with (its model.fetch installs the base), or put the base model folder back there"
        )
    module = module_class(**{**stored, "model": model, **overrides})
    module.restores_weights = True  # the checkpoint sets the weights: no PiSSA/OLoRA initialisation first
    module.trained_config = (identity or {}).get("config") or {}  # the run's resolved config (data_kwargs reads it)
    if entry is not None and peft.get("method", "none") != "none":
        module.expected_base = (entry, f"ckpt_path={str(path)!r}")  # checked once the base is installed (HFModule.prepare_data)
    module.configure_model()
    module.on_load_checkpoint(checkpoint)
    try:
        module.load_state_dict(checkpoint["state_dict"], strict=True)
    except RuntimeError as error:  # torch's size/key mismatch, or an adapter checkpoint's (core/models/base.py)
        first = " ".join(line.strip() for line in str(error).strip().splitlines()[:2])[:800]
        raise ConfigError(
            f"ckpt_path={str(path)!r}: its weights do not fit the model this config builds ({first}); fix: the task, model "
            "and experiment it was trained with"
        ) from error
    return module


def adapter_base(stored: str, entry: dict | None) -> str:
    """Where an adapter checkpoint's frozen base is read: ``model.name_or_path`` on the command line, else the run's resolved
    folder if still there (so a relative path works from any directory), else the stored path."""
    given = command_line_value("model.name_or_path")
    if given is not None:
        return given
    resolved = (entry or {}).get("resolved")
    if resolved and Path(resolved).exists():
        return resolved
    return stored


def fetch_of_same_base(cfg: DictConfig, stored_model: dict) -> dict | None:
    """The user's ``model.fetch`` (plain) when their ``model.name_or_path`` is the stored one (after resolving), else ``None``."""
    if cfg.get("model") is None or not cfg.model.get("fetch"):
        return None
    mine, theirs = cfg.model.get("name_or_path"), stored_model.get("name_or_path")
    if mine is None or theirs is None:
        return None
    same = str(mine) == str(theirs) or (
        is_local_path(str(mine)) and is_local_path(str(theirs)) and Path(str(mine)).resolve() == Path(str(theirs)).resolve()
    )
    return OmegaConf.to_container(cfg.model.fetch, resolve=True) if same else None


def data_kwargs(cfg: DictConfig, module: L.LightningModule, shaping_keys: tuple[str, ...]) -> dict:
    """What eval/predict/quantize/export hand the data module of a trained checkpoint: :meth:`datamodule_kwargs` (tokenizer,
    labels) and the settings that shape what the model sees (``shaping_keys``, :attr:`..task.Task.shaping_keys`:
    ``data.max_length``...) as the checkpoint's run had them.  A differing value given on the command line is used, and
    said; else the checkpoint's, said where the config's differs.  Called from Python (no Hydra command line), the config's
    values count as given.  Keys the config's data group lacks (another data module) are left alone."""
    from hydra.core.hydra_config import HydraConfig

    kwargs, data = module.datamodule_kwargs(), OmegaConf.to_container(cfg.data, resolve=True)
    trained = (getattr(module, "trained_config", None) or {}).get("data") or {}
    for key in shaping_keys:
        name = key.removeprefix("data.")
        if name not in data or name not in trained:
            continue
        stored, configured = trained[name], data[name]
        if configured == stored:
            continue
        if not HydraConfig.initialized() or command_line_value(key) is not None:
            log.warning("%s=%s as given; the checkpoint was trained with %s=%s", key, json.dumps(configured), key, json.dumps(stored))
        else:
            kwargs[name] = stored
            log.warning(
                "%s=%s, as the checkpoint was trained (the config says %s; give %s=... on the command line to use another)",
                key,
                json.dumps(stored),
                json.dumps(configured),
                key,
            )
    return kwargs
