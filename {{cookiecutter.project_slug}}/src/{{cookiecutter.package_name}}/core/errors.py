"""The project's exception types; a leaf importing nothing of the project.  Messages name the field, value and fix."""

import errno
from pathlib import Path

# Exit codes of a run stopped on purpose (RunStopped.exit_code); a signal N exits 128 + N, the shell's "killed by N".
EXIT_NON_FINITE_LOSS = 4
EXIT_DISK_FULL = 5  # a checkpoint did not fit on its disk (the previous one is intact): free space, resume


class ConfigError(ValueError):
    """A config value is invalid; the message lists every problem found, one per line."""


class DataError(ValueError):
    """The data does not match the data config; the message names the field and the fix."""


class TemplateError(DataError):
    """The chat template cannot be used to find the answer spans (the message says why)."""


class MetricNotLogged(ConfigError):
    """``optimized_metric`` names a metric the run did not log; ends the sweep (every trial would fail the same way)."""

    stops_sweep = True


class TrialFailed(RuntimeError):
    """A multirun job failed (traceback in the job's log); carries no frames, so its model and trainer can be freed."""


class RunStopped(Exception):
    """Training was stopped on purpose; ``exit_code`` says why (see the constants above)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DiskFull(OSError):
    """A checkpoint did not fit on its disk (the previous one is intact).  ``needed``: the tensors' bytes, a lower bound;
    ``free``: bytes free then."""

    def __init__(self, path: Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"no space left on the disk of {path}")
        self.path, self.needed, self.free = path, needed, free


class FetchError(RuntimeError):
    """pip could not download a distribution, or it lacked the expected files."""


class NothingToPlot(ValueError):
    """The folder is neither a run (``csv/version_<n>/metrics.csv``) nor a sweep (``optuna.db`` or job folders)."""
