"""One job of a Hydra multirun (a grid or an Optuna sweep): what it returns, and how it fails.

A single run reports failure by its exit code (see ``train``).  Inside a multirun the jobs share
one process, so a job must not exit: a failed job (a bad trial config, a CUDA out-of-memory error,
non-finite losses, any exception) raises :class:`TrialFailed`, which Hydra records on the job and
the sweeper records as a failed trial, and the sweep goes on with the next one.  Two things still
end the sweep: a signal (Ctrl-C, SIGTERM: the user or the scheduler wants it over) and
:class:`MetricNotLogged` (every trial would fail the same way).
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig

from ..errors import ConfigError, DataError, MetricNotLogged, RunStopped, TrialFailed
from .secrets import mask

log = logging.getLogger(__name__)


def is_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun (``-m``, or ``hydra.mode=MULTIRUN``)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def objective(metrics: dict, cfg: DictConfig) -> float | None:
    """The value of ``cfg.optimized_metric`` in a finished run's ``metrics`` (what ``train``
    returns to a sweeper), ``None`` when it is not set.

    Raises:
        MetricNotLogged: in a multirun, when the run did not log ``optimized_metric`` (names the
            metrics it did log).
    """
    name = cfg.get("optimized_metric")
    if name is None:
        return None
    if name not in metrics and is_multirun():
        objectives = sorted(k for k in (cfg.task.get("objectives") or {}) if k in metrics) if "task" in cfg else []
        raise MetricNotLogged(
            f"optimized_metric={name!r} was not logged by this run; of the task's objectives it logged "
            f"{objectives}; fix: optimized_metric=<one of them> (and hydra.sweeper.direction to match)"
        )
    return metrics.get(name)


def release_memory() -> None:
    """Free what a finished job left: Python cycles (trainer <-> module), then CUDA's cached blocks,
    so the next trial starts with the whole GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_multirun_job(work: Callable[[], float | None], job_dir: Path) -> float | None:
    """Run one multirun job: return ``work()``'s value, or raise :class:`TrialFailed` with the
    error's message (the traceback goes to stderr and ``job_dir/error.txt``).  Memory is released
    either way.

    Raises:
        TrialFailed: the job failed (bad config or data, out of memory, non-finite losses, any
            exception).
        MetricNotLogged: ``optimized_metric`` was not logged (the sweep stops).
        SystemExit: a signal stopped the job (exit code ``128 + N``): the sweep stops too.
    """
    message = None
    try:
        value = work()
    except MetricNotLogged:
        raise
    except RunStopped as stop:
        if stop.exit_code >= 128:  # a signal: the user or the scheduler wants the sweep over
            print(f"\n{stop}", file=sys.stderr, flush=True)
            raise SystemExit(stop.exit_code) from None
        message = failure_message(stop, job_dir)
    except Exception as error:  # noqa: BLE001  (any failure of a trial is recorded, not fatal)
        message = failure_message(error, job_dir)
    # Here, outside the except blocks, the exception (and the frames holding the model and the
    # trainer) is gone, no local refers to it: the collection frees them.
    release_memory()
    if message is None:
        return value
    log.error("Trial failed: %s", message)
    raise TrialFailed(message)


def failure_message(error: Exception, job_dir: Path) -> str:
    """One line for a failed job, also written to ``job_dir/error.txt``: a bad-input error's own
    message (it names the field and the fix), else ``Type: message``, with the traceback printed
    and written under it."""
    cause = error.__cause__ if isinstance(error, InstantiationException) else error
    if isinstance(cause, (ConfigError, DataError, RunStopped)):
        message, text = str(cause), str(cause) + "\n"  # says what and how to fix; no traceback needed
    else:
        message = f"{type(error).__name__}: {error}"
        text = "".join(traceback.format_exception(error))
        print(text, file=sys.stderr, flush=True)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "error.txt").write_text(mask(text))
    return message
