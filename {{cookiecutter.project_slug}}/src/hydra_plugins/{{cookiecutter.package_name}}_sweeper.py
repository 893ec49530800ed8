"""Optuna sweeps that resume, survive failed trials and check their objective first.

A Hydra sweeper plugin (Hydra finds plugins in the ``hydra_plugins`` namespace package, hence
this module's place).  It is hydra-optuna-sweeper's ``OptunaSweeper`` (same config fields, same
search-space syntax, same samplers: ``hydra/sweeper: optuna``) with its own trial loop:

- The study lives in ``storage`` (``sqlite:///<sweep dir>/optuna.db`` in ``hparams_search/``);
  the sweep folder is created before the database is opened (the plugin opens it before Hydra
  creates the folder).  Re-running the same command loads the study and **tops it up** to
  ``n_trials`` *completed* trials (the plugin would run ``n_trials`` more).
- Each trial runs in the job folder named by its **trial number** (``hydra.job.num``), so a
  resumed sweep, or a second process working on the same study, never reuses a folder.  Each
  launch reseeds the sampler (``seed + launch number``): a resumed sweep does not replay the
  first launch's suggestions.
- A failed trial (the job raised: bad trial config, out of memory, non-finite loss, ...; or its
  config did not compose) is told to Optuna as ``FAIL`` and the sweep goes on.  The sweep stops with an error once more than
  ``max_failure_rate x n_trials`` trials of this launch have failed (the plugin counts per batch
  of ``n_jobs``, so with ``n_jobs: 1`` any rate below 1 stops at the first failure).
- Before the first trial: ``optimized_metric`` must be one of ``task.objectives`` and
  ``direction`` must agree with it; every parameter must name a key of the config.  A trial
  that raises an error with ``stops_sweep`` (the run did not log ``optimized_metric``) stops
  the sweep at once, as a configuration error, not as one more failed trial.
- The best trial is written to ``<sweep dir>/best.yaml`` (parameters, value, trial number, job
  folder, counts) and printed; ``optimization_results.yaml`` (the plugin's format) too.

Optuna and the plugin are imported when a sweep starts: Hydra imports this module at every
start, also where the ``sweep`` extra is not installed.
"""

from __future__ import annotations

import fcntl
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

BETTER = {"max": "maximize", "min": "minimize"}


class SweepConfigError(ValueError):
    """The sweep cannot start (or go on): the message names the field, the value and the fix."""


class ResumableOptunaSweeper(Sweeper):
    """hydra-optuna-sweeper's ``OptunaSweeper`` with a resumable, failure-tolerant trial loop
    (see the module docstring).  Arguments: those of ``hydra/sweeper: optuna``
    (``hydra_plugins.hydra_optuna_sweeper.config.OptunaSweeperConf``).

    Raises (from :meth:`sweep`):
        SweepConfigError: an objective, direction or parameter that cannot work; more failed
            trials than ``max_failure_rate`` allows; no completed trial at all.
        ImportError: the ``sweep`` extra is not installed.
    """

    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: Any,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        search_space: DictConfig | None = None,
        custom_search_space: str | None = None,
        params: DictConfig | None = None,
    ) -> None:
        try:
            from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
        except ImportError as error:
            raise ImportError(f'{error}; fix: pip install -e ".[sweep]" (Optuna and hydra-optuna-sweeper)') from error
        if not 0.0 <= max_failure_rate <= 1.0:
            raise SweepConfigError(f"hydra.sweeper.max_failure_rate={max_failure_rate} must be in [0, 1]")
        if n_trials < 1:
            raise SweepConfigError(f"hydra.sweeper.n_trials={n_trials} must be at least 1")
        # The plugin's implementation parses the search space and configures trials; the loop is ours.
        self.impl = OptunaSweeperImpl(
            sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, search_space, custom_search_space, params
        )
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config = config

    def sweep(self, arguments: list[str]) -> None:
        """Run the study to ``n_trials`` completed trials.  A :class:`SweepConfigError` is printed
        alone (no traceback: it names the field and the fix) and exits with code 1."""
        try:
            self._sweep(arguments)
        except SweepConfigError as error:
            print(f"Error: {error}", file=sys.stderr, flush=True)
            sys.exit(1)

    def _sweep(self, arguments: list[str]) -> None:
        import optuna
        from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

        impl = self.impl
        directions = impl._get_directions()
        check_objective(self.config, directions)
        impl._process_searchspace_config()
        distributions, fixed = create_params_from_overrides(impl._parse_sweeper_params_config() + list(arguments))
        distributions = {**(impl.search_space_distributions or {}), **distributions}
        for name in fixed:
            distributions.pop(name, None)
        check_params(self.config, list(distributions))
        if not isinstance(impl.sampler, optuna.samplers.BaseSampler):
            raise SweepConfigError(
                "hydra/sweeper/sampler=grid needs the search space when it is built, which this sweeper "
                "does not do; fix: a plain Hydra grid sweep (-m key=a,b,c) or sampler=tpe|random"
            )

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)  # before the SQLite file in it is opened
        # Two launches of one command may open a new database at once: one creates its tables
        # and the study, the other waits and loads them.
        with (sweep_dir / ".study.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            study = optuna.create_study(
                study_name=impl.study_name, storage=impl.storage, sampler=impl.sampler, direction=directions[0], load_if_exists=True
            )
            launch = study.user_attrs.get("launches", 0)  # this launch's number: 0 for the first
            study.set_user_attr("launches", launch + 1)
        study.sampler = reseeded(self.config.hydra.sweeper.sampler, launch) or study.sampler
        log.info(
            "Study %s in %s: %d trials so far, topping up to %d completed (launch %d)",
            study.study_name,
            impl.storage,
            len(study.trials),
            self.n_trials,
            launch,
        )

        failed = 0  # in this launch: a re-run after fixing the cause starts with a clean count
        while (done := count(study, "COMPLETE")) < self.n_trials:
            if failed > self.max_failure_rate * self.n_trials:
                if done:
                    write_best(study, sweep_dir, self.config)
                raise SweepConfigError(
                    f"{failed} trials of this run of study {study.study_name!r} failed, more than hydra.sweeper.max_failure_rate="
                    f"{self.max_failure_rate} x n_trials={self.n_trials} allows; the errors are in the trial folders "
                    f"(error.txt) under {sweep_dir}; fix the cause and run the same command again (the study resumes), "
                    "or raise hydra.sweeper.max_failure_rate"
                )
            trials = [study.ask() for _ in range(min(self.n_jobs, self.n_trials - done))]
            overrides = impl._configure_trials(trials, distributions, fixed)
            try:
                jobs = self._launch(trials, overrides)
            except Exception as error:  # noqa: BLE001  (Hydra could not compose a trial: a value the config refuses)
                jobs = [failed_job(error) for _ in trials]
            for trial, job in zip(trials, jobs):
                failed += not self._tell(study, trial, job, sweep_dir)

        write_best(study, sweep_dir, self.config)

    def _launch(self, trials: list, overrides: list) -> list:
        """Launch the trials' jobs with ``hydra.job.num`` = trial number (their folder names)."""
        numbers = [trial.number for trial in trials]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return list(self.impl.launcher.launch(overrides, initial_job_idx=numbers[0]))
        # Another process asked trials in between: one launch per trial keeps the numbers.
        return [self.impl.launcher.launch([o], initial_job_idx=n)[0] for o, n in zip(overrides, numbers)]

    def _tell(self, study, trial, job, sweep_dir: Path) -> bool:
        """Tell Optuna how ``trial`` ended; return whether it completed.

        Raises:
            SweepConfigError: the job's error says the sweep cannot work (``stops_sweep``).
        """
        import optuna

        error = job._return_value if job.status != JobStatus.COMPLETED else None
        value = None
        if error is None:
            try:
                value = float(job._return_value)
            except (TypeError, ValueError):
                error = ValueError(f"the job returned {job._return_value!r}, not a number")
        if error is None and value == value:  # (NaN != NaN: a NaN objective is a failed trial)
            study.tell(trial, value)
            log.info("Trial %d: %s = %s  %s", trial.number, self.config.optimized_metric, value, trial.params)
            return True
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        reason = error if error is not None else f"{self.config.optimized_metric} is NaN"
        log.warning("Trial %d failed (%s): %s; job folder %s", trial.number, trial.params, reason, sweep_dir / str(trial.number))
        if getattr(error, "stops_sweep", False):
            raise SweepConfigError(str(error))
        return False


def failed_job(error: Exception) -> JobReturn:
    """A job that never ran (its config did not compose), as Hydra reports a failed one."""
    job = JobReturn(status=JobStatus.FAILED)
    job.return_value = error
    return job


def reseeded(sampler: DictConfig, launch: int) -> Any:
    """The sampler of launch ``launch`` (> 0) of a study: the configured one with seed
    ``seed + launch``, or ``None`` to keep it (the first launch, or no seed).  A resumed sweep,
    or a second process on the study, would otherwise replay the first launch's random
    suggestions and repeat its trials; this way each launch is still reproducible."""
    from hydra.utils import instantiate

    seed = sampler.get("seed")
    if not launch or seed is None:
        return None
    return instantiate(sampler, seed=seed + launch)


def count(study, state: str) -> int:
    """Trials of ``study`` in ``state`` (``COMPLETE``, ``FAIL``, ...), all processes together."""
    import optuna

    return len(study.get_trials(deepcopy=False, states=(getattr(optuna.trial.TrialState, state),)))


def check_objective(config: DictConfig, directions: list[str]) -> None:
    """``optimized_metric`` is one of ``task.objectives`` and ``direction`` agrees with it.

    Raises:
        SweepConfigError: naming the metric, the direction and the fix.
    """
    metric = config.get("optimized_metric")
    objectives = OmegaConf.select(config, "task.objectives") or {}
    if len(directions) != 1:
        raise SweepConfigError(
            f"hydra.sweeper.direction={directions}: this sweeper optimises one metric; fix: hydra.sweeper.direction=maximize or minimize"
        )
    if metric not in objectives:
        raise SweepConfigError(
            f"optimized_metric={metric!r} is not a metric this task logs at the end of a run; "
            f"the task logs {sorted(objectives)}; fix: optimized_metric=<one of them>"
        )
    if str(metric).startswith("test/") and not config.get("test_after_fit", True):
        raise SweepConfigError(
            f"optimized_metric={metric} is logged by the test after fit, and test_after_fit=false; "
            f"fix: test_after_fit=true (with a test split), or optimized_metric=val/..."
        )
    better = BETTER[objectives[metric]]
    if directions[0] != better:
        raise SweepConfigError(
            f"hydra.sweeper.direction={directions[0]} for optimized_metric={metric}, which is better "
            f"when {'higher' if better == 'maximize' else 'lower'}; fix: hydra.sweeper.direction={better}"
        )


def check_params(config: DictConfig, names: list[str]) -> None:
    """Every swept key is a key of the config or a config group (``+key`` adds one and is not
    checked), so a typo or a group that is not selected (``peft.r`` with ``peft=none``) fails
    here, not in every trial.

    Raises:
        SweepConfigError: listing the missing keys.
    """
    sentinel = object()
    groups = OmegaConf.select(config, "hydra.runtime.choices") or {}
    missing = [
        name
        for name in names
        if not name.startswith(("+", "~")) and name not in groups and OmegaConf.select(config, name, default=sentinel) is sentinel
    ]
    if missing:
        raise SweepConfigError(
            f"hydra.sweeper.params sweeps {missing}, which this config does not have; "
            "fix: correct the key, select the config group that has it, or add it with +key"
        )


def write_best(study, sweep_dir: Path, config: DictConfig) -> Path:
    """Write ``best.yaml`` (and the plugin's ``optimization_results.yaml``) and print the best trial.

    Raises:
        SweepConfigError: no trial of the study completed.
    """
    import optuna

    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not completed:
        raise SweepConfigError(f"no trial of study {study.study_name!r} completed; the errors are in the job folders under {sweep_dir}")
    best = study.best_trial
    result = {
        "optimized_metric": config.optimized_metric,
        "direction": study.direction.name.lower(),
        "best_value": best.value,
        "best_params": best.params,
        "best_trial": best.number,
        "best_job_dir": str(sweep_dir / str(best.number)),
        "trials": {"completed": len(completed), "failed": count(study, "FAIL"), "total": len(study.trials)},
        "study": {"name": study.study_name, "storage": str(config.hydra.sweeper.storage)},
    }
    path = sweep_dir / "best.yaml"
    OmegaConf.save(OmegaConf.create(result), path)
    OmegaConf.save(
        OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}), sweep_dir / "optimization_results.yaml"
    )
    overrides = " ".join(f"{k}={v}" for k, v in best.params.items())
    print(f"\nBest trial {best.number}: {config.optimized_metric} = {best.value}  ({overrides})\nWritten to {path}", flush=True)
    return path
