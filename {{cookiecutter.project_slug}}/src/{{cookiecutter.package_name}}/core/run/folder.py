"""A run folder has one owner: what ``train`` may start or resume in a folder, and its lock.

Rules (``train``; every other entry point checks each file it writes instead, see :mod:`.outputs`):

- A folder **holds a run** when it has ``checkpoints/*.ckpt``, ``metrics.json`` or the lock file
  (``run.lock``, left behind by every launch).  A missing or empty folder holds none.
- ``ckpt_path=null`` (a fresh run) into a folder that holds a run is refused: it would replace that
  run's checkpoints and metrics.  Fix: resume it, or another ``hydra.run.dir``.
- ``ckpt_path=last`` resumes the folder's ``checkpoints/last.ckpt``; with none there it is an error
  naming the folder it looked in (without ``hydra.run.dir`` every launch gets a new folder).
- ``ckpt_path=auto`` resumes ``last.ckpt`` when there is one, else starts (what a requeued SLURM job
  wants: ``launcher=slurm`` sets it).
- ``ckpt_path=<file>`` resumes that checkpoint; into a folder that holds a run only when the file is
  one of that folder's own checkpoints.
- **The lock**: global rank 0 of a launch takes an exclusive kernel lock (``fcntl.flock``) on
  ``run.lock`` for as long as it trains; the kernel releases it when the process ends, however it
  ends, so a lock is never stale.  A second launch on a locked folder is refused, naming the owner
  (pid, host, SLURM job id: what the file records, for the message only).  DDP ranks >= 1 and the
  processes Lightning re-launches for them (rank set in the environment) neither lock nor check:
  their rank 0 has.
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
    """What makes ``folder`` hold a run: its checkpoint files, ``metrics.json``, the lock file
    (paths relative to ``folder``); empty when it holds none."""
    checkpoint_dir = checkpoint_dir or folder / "checkpoints"
    found = sorted(str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path) for path in checkpoint_dir.glob("*.ckpt"))
    found += [name for name in (METRICS_FILE, LOCK_FILE) if (folder / name).exists()]
    return found


def newest_resumable(cfg: DictConfig) -> Path | None:
    """The newest ``runs/*`` folder of this task name with a ``checkpoints/last.ckpt`` (for the fix of
    a ``ckpt_path=last`` that found none), or ``None``."""
    runs = Path(str(cfg.paths.log_dir)) / str(cfg.get("task_name", "train")) / "runs"
    found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda path: path.stat().st_mtime) if runs.is_dir() else []
    return found[-1].parent.parent if found else None


@contextmanager
def owned_run_folder(cfg: DictConfig, last: Path) -> Iterator[Path | None]:
    """Around a ``train`` run: on global rank 0, hold the folder's lock (:func:`run_lock`) and check
    the folder (:func:`resume_checkpoint`); yields the checkpoint to resume from, or ``None``.  The
    other ranks only resolve ``ckpt_path`` the same way (their rank 0 checked the folder).

    Args:
        last: where this run's ``last.ckpt`` lives (the checkpoint callbacks' folder).

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
    """The checkpoint ``ckpt_path`` resumes from (``None``: a fresh start), by the rules of the
    module docstring.  ``held``: what makes the folder hold a run (:func:`run_contents`), or
    ``None`` to skip the folder checks (DDP ranks >= 1).

    Raises:
        ConfigError: a fresh run into a folder that holds a run; ``ckpt_path=last`` with no
            ``last.ckpt``; ``ckpt_path=auto`` in a folder whose checkpoints are not a ``last.ckpt``;
            a checkpoint from elsewhere resumed into a folder that holds another run.
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
    """Hold the exclusive lock of ``run_dir`` (see the module docstring) while the block runs;
    yields whether the lock file was there before (a run was started in this folder already).

    Raises:
        ConfigError: another live process holds the lock (named by what its lock file records).
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
