"""The project's exception types: the one leaf module that every other module may import and
that imports nothing of the project (tests/test_imports.py keeps it so).

Each message names the field (a config key, a data column, a file), the value and the fix, one
problem per line; the entry points print it in one line, without a traceback
(``core/run/entry.hydra_main``).
"""

import errno
from pathlib import Path

# Exit codes of a run stopped on purpose (RunStopped.exit_code).  A stop on signal N exits with
# 128 + N (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1): the shell's convention for "killed
# by N", which SLURM and job scripts already read that way.
EXIT_NON_FINITE_LOSS = 4
EXIT_DISK_FULL = 5  # a checkpoint did not fit on its disk (the previous one is intact): free space, resume


class ConfigError(ValueError):
    """A config value is invalid; the message lists every problem found, one per line."""


class DataError(ValueError):
    """The data does not match the data config; the message names the field and the fix."""


class TemplateError(DataError):
    """The chat template cannot be used to find the answer spans (the message says why)."""


class MetricNotLogged(ConfigError):
    """``optimized_metric`` names a metric the run did not log.  Ends the whole sweep (the
    sweeper checks ``stops_sweep``): every other trial would fail the same way."""

    stops_sweep = True


class TrialFailed(RuntimeError):
    """A multirun job failed; the message is the original error's (its traceback is in the job's
    log).  Carries no traceback frames, so the failed job's model and trainer can be freed."""


class RunStopped(Exception):
    """Training was stopped on purpose; ``exit_code`` says why (see the constants above)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DiskFull(OSError):
    """A checkpoint did not fit on its disk.  ``path``: the checkpoint; ``needed``: its size in
    bytes (the tensors' bytes, a lower bound of the file); ``free``: bytes free on that disk then.
    The checkpoint that was there before is intact (the write went to a temporary file)."""

    def __init__(self, path: Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"no space left on the disk of {path}")
        self.path, self.needed, self.free = path, needed, free


class FetchError(RuntimeError):
    """pip could not download a distribution, or it lacked the expected files."""


class NothingToPlot(ValueError):
    """The folder is neither a run (``csv/version_<n>/metrics.csv``) nor a sweep (``optuna.db`` or job folders)."""
