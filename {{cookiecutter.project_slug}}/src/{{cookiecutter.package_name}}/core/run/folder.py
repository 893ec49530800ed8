"""A run folder has one owner: what ``train`` may start or resume in a folder, and its lock (other entry points: :mod:`.outputs`).

- A folder **holds a run** when it has ``checkpoints/*.ckpt``, ``metrics.json`` or ``run.lock``.
- ``ckpt_path=null`` there is refused (it would replace that run's files); ``<file>`` only if one of its own checkpoints.
- ``ckpt_path=last`` resumes ``checkpoints/last.ckpt``, an error if none; ``auto`` resumes it or starts (requeued SLURM jobs).
- **The lock**: global rank 0 holds ``fcntl.flock`` on ``run.lock`` while it trains; the kernel releases it however the
  process ends, so it is never stale.  A second launch is refused, naming the owner recorded in the file.  Ranks >= 1
  neither lock nor check.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from ..errors import ConfigError

try:  # POSIX; on Windows runs are not locked (said once)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.json"
# ckpt_path values that name this run's last.ckpt.
RESUME_LAST, RESUME_AUTO = "last", "auto"


def run_contents(folder: Path, checkpoint_dir: Path | None = None) -> list[str]:
    """What makes ``folder`` hold a run (checkpoints, ``metrics.json``, lock file; relative paths); empty if none."""
    checkpoint_dir = checkpoint_dir or folder / "checkpoints"
    found = sorted(str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path) for path in checkpoint_dir.glob("*.ckpt"))
    found += [name for name in (METRICS_FILE, LOCK_FILE) if (folder / name).exists()]
    return found


def newest_resumable(cfg: DictConfig) -> Path | None:
    """The newest ``runs/*`` folder of this task name with a ``checkpoints/last.ckpt``, or ``None``."""
    runs = Path(str(cfg.paths.log_dir)) / str(cfg.get("task_name", "train")) / "runs"
    found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda path: path.stat().st_mtime) if runs.is_dir() else []
    return found[-1].parent.parent if found else None


@contextmanager
def owned_run_folder(cfg: DictConfig, last: Path) -> Iterator[Path | None]:
    """Around ``train``: rank 0 holds :func:`run_lock` and checks the folder; yields the checkpoint to resume, or ``None``.

    Raises:
        ConfigError: see :func:`run_lock` and :func:`resume_checkpoint` (before anything is written).
    """
    run_dir = Path(str(cfg.paths.output_dir))
    if rank_zero_only.rank != 0:
        yield resume_checkpoint(cfg, run_dir, last, held=None)
        return
    with run_lock(run_dir) as existed:
        held = [item for item in run_contents(run_dir, last.parent) if item != LOCK_FILE or existed]
        yield resume_checkpoint(cfg, run_dir, last, held)


def resume_checkpoint(cfg: DictConfig, run_dir: Path, last: Path, held: list[str] | None) -> Path | None:
    """The checkpoint to resume (``None``: fresh start) by the module's rules; ``held=None`` skips folder checks (ranks >= 1).

    Raises:
        ConfigError: a fresh run into a folder that holds a run; ``last`` with no ``last.ckpt``; ``auto`` with checkpoints
            but no ``last.ckpt``; a checkpoint from elsewhere into a folder that holds another run.
    """
    value = cfg.get("ckpt_path")
    checks, held = held is not None, held or []
    where = f"hydra.run.dir={str(run_dir)!r}"
    if value is None:
        if held:
            raise ConfigError(
                f"{where} holds a run ({', '.join(held[:4])}): a fresh train would replace its files; fix: resume it with "
                f"ckpt_path=last {where}, or start a new run in another folder (drop hydra.run.dir, or hydra.run.dir=<a new folder>)"
            )
        return None
    if str(value) in (RESUME_LAST, RESUME_AUTO):
        if last.is_file():
            return last
        if str(value) == RESUME_AUTO and not [item for item in held if item != LOCK_FILE]:
            return None  # nothing to resume yet (a requeued job killed before its first checkpoint): start
        newest = newest_resumable(cfg)
        hint = f" (the newest run with one: hydra.run.dir={str(newest)!r})" if newest is not None else ""
        if str(value) == RESUME_AUTO and checks:
            raise ConfigError(
                f"ckpt_path=auto: {where} holds {', '.join(held)} but no {last.name} to resume; fix: ckpt_path=<one of its "
                "checkpoints>, or another hydra.run.dir"
            )
        raise ConfigError(
            f"ckpt_path=last: no run to resume in {where} (no {last}); without hydra.run.dir every launch gets a new "
            f"folder; fix: hydra.run.dir=<the folder of the run to resume> ckpt_path=last{hint}, or ckpt_path=auto to "
            "resume when there is a run and start when there is none"
        )
    path = Path(str(value))
    if held and path.resolve().parent != last.parent.resolve():
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a checkpoint of the run in {where} ({', '.join(held[:4])}), and resuming it "
            "there would replace that run's files; fix: drop hydra.run.dir (a new folder), or ckpt_path=last to resume "
            "the run that is there"
        )
    return path


@contextmanager
def run_lock(run_dir: Path) -> Iterator[bool]:
    """Hold ``run_dir``'s exclusive lock during the block; yields whether the lock file existed before.

    Raises:
        ConfigError: another live process holds the lock.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    existed = path.exists()
    if fcntl is None:  # pragma: no cover - Windows
        yield existed
        return
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            owner = _read_owner(descriptor)
            raise ConfigError(
                f"hydra.run.dir={str(run_dir)!r} is in use by another launch ({owner}): two runs in one folder would "
                "replace each other's checkpoints; fix: wait for it to end, or start this one in another folder "
                "(drop hydra.run.dir, or hydra.run.dir=<a new folder>)"
            ) from error
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started": time.time()}
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(owner) + "\n").encode(), 0)
        yield existed
    finally:
        os.close(descriptor)  # (releases the lock; the file stays: the folder holds a run)


def _read_owner(descriptor: int) -> str:
    try:
        owner = json.loads(os.pread(descriptor, 4096, 0) or b"{}")
    except ValueError:
        return "owner unknown"
    job = f", SLURM job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}{job}"
