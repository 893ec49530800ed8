"""One job of a Hydra multirun (a grid or an Optuna sweep): what it returns, and how it fails.

Jobs share one process, so a failed job must not exit: it raises :class:`TrialFailed` (a failed trial) and the sweep
goes on.  A signal or :class:`MetricNotLogged` (every trial would fail the same way) ends the sweep.
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
    """Whether this process runs a Hydra multirun job."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def objective(metrics: dict, cfg: DictConfig) -> float | None:
    """``metrics[cfg.optimized_metric]`` (what ``train`` returns to a sweeper), ``None`` when not set.

    Raises:
        MetricNotLogged: in a multirun, when the run did not log ``optimized_metric``.
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
    """Free a finished job's cycles (trainer <-> module), then CUDA's cached blocks, so the next trial gets the whole GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_multirun_job(work: Callable[[], float | None], job_dir: Path) -> float | None:
    """Return ``work()``'s value; memory is released either way.

    Raises:
        TrialFailed: any exception of the job (:func:`failure_message`).
        MetricNotLogged: ``optimized_metric`` was not logged (the sweep stops).
        SystemExit: a signal stopped the job (exit code ``128 + N``; the sweep stops).
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
    # Outside the except blocks no local holds the exception's frames (model, trainer), so they can be freed.
    release_memory()
    if message is None:
        return value
    log.error("Trial failed: %s", message)
    raise TrialFailed(message)


def failure_message(error: Exception, job_dir: Path) -> str:
    """One line for a failed job (a bad-input error's message, else ``Type: message`` plus the printed traceback), also
    written to ``job_dir/error.txt``."""
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
