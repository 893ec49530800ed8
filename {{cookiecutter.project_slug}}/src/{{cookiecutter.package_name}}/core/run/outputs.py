"""Nothing overwritten: an entry point's outputs are checked before the first byte is written.

An output is refused when it **is an input** or inside an input folder, or **is a** ``.ckpt`` (always: user data is never
replaced), or **exists** or lies **inside another run's folder** (:func:`.folder.run_contents`; unless ``overwrite=true``).
Paths are compared resolved (symlinks, ``..``).  ``train`` owns its run folder instead (:mod:`.folder`).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig

from ..errors import ConfigError
from .entry import RUN_CONFIG_DIR, RUN_CONFIG_FILES, save_run_config
from .folder import run_contents


def output_problems(
    outputs: dict[str, Path], inputs: dict[str, Path | None], own_run_dir: Path | None, overwrite: bool, fixes: dict[str, str] | None = None
) -> list[str]:
    """One line per output (field -> path) that may not be written, by the module's rules.

    Args:
        inputs: field -> a file or folder the command reads (``None`` skipped).
        fixes: field -> the fix to name (default ``<field>=<a new path>``).
    """
    problems = []
    readers = {field: Path(str(path)).resolve() for field, path in inputs.items() if path is not None}
    own = Path(str(own_run_dir)).resolve() if own_run_dir is not None else None
    for field, path in outputs.items():
        target = Path(str(path)).resolve()
        shown = f"{field}={str(path)!r}"
        fix = (fixes or {}).get(field, f"{field}=<a new path>")
        same = [name for name, source in readers.items() if target == source or source.is_dir() and source in target.parents]
        if same:
            problems.append(
                f"{shown} is the input {same[0]}={str(inputs[same[0]])!r} (or inside it): writing there would replace what "
                f"it reads; fix: {fix}"
            )
        elif target.suffix == ".ckpt":
            problems.append(f"{shown} is a checkpoint file: writing there would destroy it; fix: {fix} (not .ckpt)")
        elif overwrite:
            continue
        elif target.exists():
            problems.append(f"{shown} exists; fix: {fix}, or overwrite=true to replace it")
        else:
            held = next((folder for folder in _run_folders(target.parents) if folder != own), None)
            if held is not None:
                problems.append(
                    f"{shown} is inside another run's folder ({held}): it is that run's; fix: {fix} outside it, or overwrite=true"
                )
    return problems


def check_outputs(
    outputs: dict[str, Path], inputs: dict[str, Path | None], own_run_dir: Path | None, overwrite: bool, fixes: dict[str, str] | None = None
) -> None:
    """:func:`output_problems`, raised.

    Raises:
        ConfigError: every output that may not be written, one per line.
    """
    problems = output_problems(outputs, inputs, own_run_dir, overwrite, fixes)
    if problems:
        raise ConfigError("Refused, nothing was written:\n  - " + "\n  - ".join(problems))


def claim_outputs(
    cfg: DictConfig,
    outputs: dict[str, Path],
    inputs: dict[str, Path | None],
    run_files: tuple[str, ...] = ("config_tree.log",),
    folder_markers: dict[str, str] | None = None,
) -> None:
    """Before a non-train entry point writes: check ``outputs``, its ``run_files`` and ``.hydra/*.yaml``, then write ``.hydra/``.
    ``folder_markers``: output field -> the file its folder holds; even ``overwrite=true`` refuses a folder without it.

    Raises:
        ConfigError: see :func:`check_outputs`.
    """
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(str(cfg.paths.output_dir))
    files = {name: run_dir / name for name in run_files}
    if HydraConfig.initialized():
        files.update({f"{RUN_CONFIG_DIR}/{name}": run_dir / RUN_CONFIG_DIR / name for name in RUN_CONFIG_FILES})
    # The run folder's own files: the fix is another run folder.
    fixes = dict.fromkeys(files, "a new run folder (drop hydra.run.dir, or hydra.run.dir=<a new folder>)")
    overwrite = bool(cfg.get("overwrite"))
    problems = output_problems({**files, **outputs}, inputs, run_dir, overwrite, fixes)
    for field, marker in (folder_markers or {}).items():
        folder = Path(str(outputs[field]))
        if overwrite and folder.exists() and not (folder / marker).is_file():
            problems.append(
                f"{field}={str(folder)!r} exists and is not a folder this command wrote (no {marker}); overwrite=true replaces "
                f"only those; fix: {field}=<a new folder>"
            )
    if problems:
        raise ConfigError("Refused, nothing was written:\n  - " + "\n  - ".join(problems))
    save_run_config(cfg, run_dir)


def replace_folder(staging: Path, target: Path, marker: str) -> None:
    """Move the complete ``staging`` to ``target``; an existing ``target`` is moved aside then deleted (never half old, half
    new), and only if it holds ``marker`` (a folder this command wrote).

    Raises:
        ConfigError: ``target`` exists without ``marker``.
    """
    if target.exists():
        if not (target / marker).is_file():
            raise ConfigError(
                f"{target} exists and is not a folder this command wrote (no {marker}); overwrite=true replaces only those; "
                "fix: another output folder"
            )
        aside = target.with_name(f".{target.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
        shutil.move(str(staging), target)
        shutil.rmtree(aside)
        return
    shutil.move(str(staging), target)


def staging_folder(output: Path, kind: str) -> tempfile.TemporaryDirectory:
    """A temporary ``.<kind>-staging-<host>-<pid>-<random>`` folder next to ``output``; first removes ``kind`` staging
    folders there whose owner on this host is dead (a SIGKILLed export or quantize)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{kind}-staging-{socket.gethostname()}"
    for left in output.parent.glob(f"{glob.escape(prefix)}-*"):
        owner, _, suffix = left.name[len(prefix) + 1 :].partition("-")
        if left.is_dir() and owner.isdigit() and suffix and not _alive(int(owner)):
            shutil.rmtree(left, ignore_errors=True)
    return tempfile.TemporaryDirectory(dir=output.parent, prefix=f"{prefix}-{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _run_folders(folders: Iterable[Path]) -> Iterable[Path]:
    return (folder for folder in folders if folder.is_dir() and run_contents(folder))
