"""Optuna sweeps that resume, survive failed trials and check their objective first.

A Hydra ``Sweeper`` plugin (Hydra finds plugins in the ``hydra_plugins`` namespace package) on Optuna's public API
(``create_study(load_if_exists=True)``, ``ask``/``tell``); the search space is read with Hydra's override parser.

- The study lives in ``storage`` (``sqlite:///...``, or ``journal:<file>`` for concurrent launches or NFS, where SQLite is
  unsafe); re-running the command **tops it up** to ``n_trials`` completed trials.
- Trials run in folders named by trial number, and each launch reseeds the sampler: nothing is reused or replayed.
- A failed trial is told as ``FAIL``; the sweep stops past ``max_failure_rate x n_trials`` failures in this launch.
- Before the first trial, objective, params, search space, fixed overrides and file contents are checked (``check_*``).
- Optuna is imported only when a sweep starts: Hydra imports this module at every start, also without the ``sweep`` extra.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

BETTER = {"max": "maximize", "min": "minimize"}
JOURNAL = "journal:"  # storage prefix: Optuna's journal file storage at the path that follows
LAUNCH_ONLY = ("launcher",)  # config groups that choose where trials run, not what they are
# Overrides naming files: compared by the files' content (check_study_files), not as typed.
FILE_KEYS = ("data.splits.", "model.name_or_path", "model.tokenizer")


class SweepConfigError(ValueError):
    """The sweep cannot start (or go on): the message names the field, the value and the fix."""


class ResumableOptunaSweeper(Sweeper):
    """A resumable, failure-tolerant Optuna sweep (see the module docstring).

    Args:
        n_trials: completed trials to reach (failed ones do not count).
        n_jobs: trials launched at a time (1 on one GPU; more with ``launcher=slurm``).
        params: ``{key: sweep}`` in Hydra's override syntax.

    Raises (from :meth:`sweep`, printed alone with exit code 1):
        SweepConfigError: an objective, direction, parameter, search space or fixed overrides that cannot work; more
            failed trials than ``max_failure_rate`` allows; no completed trial at all.
    """

    def __init__(
        self,
        sampler: Any,
        direction: str,
        storage: str,
        study_name: str,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None = None,
    ) -> None:
        if not 0.0 <= max_failure_rate <= 1.0:
            raise SweepConfigError(f"hydra.sweeper.max_failure_rate={max_failure_rate} must be in [0, 1]")
        if n_trials < 1 or n_jobs < 1:
            raise SweepConfigError(f"hydra.sweeper.n_trials={n_trials} and n_jobs={n_jobs} must be at least 1")
        self.sampler, self.direction, self.storage, self.study_name = sampler, str(direction), str(storage), str(study_name)
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.params = {str(key): str(value) for key, value in (params or {}).items()}
        self.config: DictConfig | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        """Run the study to ``n_trials`` completed trials; a :class:`SweepConfigError` is printed alone and exits 1."""
        try:
            self._sweep(arguments)
        except SweepConfigError as error:
            print(f"Error: {error}", file=sys.stderr, flush=True)
            sys.exit(1)

    def _sweep(self, arguments: list[str]) -> None:
        try:
            import optuna
        except ImportError as error:
            raise SweepConfigError(f'{error}; fix: pip install -e ".[sweep]" (Optuna)') from error

        secrets = project_secrets()
        typed = secrets.credential_problems(OmegaConf.create({"hydra": {"sweeper": OmegaConf.to_container(self.config.hydra.sweeper)}}))
        if typed:
            raise SweepConfigError("; ".join(typed))
        check_objective(self.config, [self.direction])
        distributions, fixed = search_space([f"{key}={value}" for key, value in self.params.items()] + list(arguments))
        check_params(self.config, list(distributions))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)  # before the storage file in it is opened
        # Two launches may open a new study at once: one creates it and records its setup, the other waits and loads it.
        with (sweep_dir / ".study.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            study = optuna.create_study(
                study_name=self.study_name, storage=open_storage(self.storage), sampler=self.sampler, direction=self.direction,
                load_if_exists=True,
            )  # fmt: skip
            check_search_space(study, distributions)
            check_fixed_overrides(study, fixed_setup(fixed, secrets.mask), secrets.mask(self.storage))
            check_study_files(study, study_files(self.config), secrets.mask(self.storage))
            launch = study.user_attrs.get("launches", 0)  # this launch's number: 0 for the first
            study.set_user_attr("launches", launch + 1)
        study.sampler = reseeded(self.config.hydra.sweeper.sampler, launch) or study.sampler
        log.info("Study %s in %s: %d trials so far, topping up to %d completed (launch %d)",
                 study.study_name, secrets.mask(self.storage), len(study.trials), self.n_trials, launch)  # fmt: skip

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
            trials = [study.ask(distributions) for _ in range(min(self.n_jobs, self.n_trials - done))]
            overrides = [[*fixed, *(override(name, value) for name, value in trial.params.items())] for trial in trials]
            try:
                jobs = self._launch(trials, overrides)
            except Exception as error:  # noqa: BLE001  (Hydra could not compose a trial: a value the config refuses)
                jobs = [failed_job(error) for _ in trials]
            for trial, job in zip(trials, jobs):
                failed += not self._tell(study, trial, job, sweep_dir)

        write_best(study, sweep_dir, self.config)

    def _launch(self, trials: list, overrides: list[list[str]]) -> list[JobReturn]:
        """Launch the trials' jobs with ``hydra.job.num`` = trial number (their folder names)."""
        numbers = [trial.number for trial in trials]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return list(self.launcher.launch(overrides, initial_job_idx=numbers[0]))
        # Another process asked trials in between: one launch per trial keeps the numbers.
        return [self.launcher.launch([o], initial_job_idx=n)[0] for o, n in zip(overrides, numbers)]

    def _tell(self, study, trial, job: JobReturn, sweep_dir: Path) -> bool:
        """Tell Optuna how ``trial`` ended; return whether it completed.

        Raises:
            SweepConfigError: the job's error says the sweep cannot work (``stops_sweep``).
        """
        import optuna

        error, value = job_outcome(job)
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


def job_outcome(job: JobReturn) -> tuple[BaseException | None, float | None]:
    """``(error, objective)`` of a finished job (``JobReturn.return_value`` raises a failed job's exception)."""
    try:
        value = job.return_value
    except Exception as error:  # noqa: BLE001  (the trial's own failure, whatever it is)
        return error, None
    try:
        return None, float(value)
    except (TypeError, ValueError):
        return ValueError(f"the job returned {value!r}, not a number"), None


def failed_job(error: Exception) -> JobReturn:
    """A job that never ran (its config did not compose), as Hydra reports a failed one."""
    job = JobReturn(status=JobStatus.FAILED)
    job.return_value = error
    return job


def search_space(lines: list[str]) -> tuple[dict, list[str]]:
    """``({name: Optuna distribution}, [fixed overrides])`` of Hydra override lines; a later line for a key wins.
    ``choice``/``range`` are categorical, ``interval`` a float range (log with ``tag(log, ...)``), ``key=value`` fixed.

    Raises:
        SweepConfigError: a line Hydra's parser refuses, or a sweep this sweeper cannot search.
    """
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    try:
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception as error:  # noqa: BLE001  (Hydra's OverrideParseException and friends)
        raise SweepConfigError(f"hydra.sweeper.params: {error}") from error
    distributions, fixed = {}, {}
    for item in parsed:
        name, value = item.get_key_element(), item.value()
        distributions.pop(name, None)
        fixed.pop(name, None)
        if isinstance(value, IntervalSweep):
            distributions[name] = FloatDistribution(float(value.start), float(value.end), log="log" in value.tags)
        elif isinstance(value, (ChoiceSweep, RangeSweep)):
            distributions[name] = CategoricalDistribution(list(item.sweep_iterator()))
        elif item.is_sweep_override():
            raise SweepConfigError(f"hydra.sweeper.params: {item.input_line!r} is not a sweep Optuna can search; "
                                   "fix: choice(...), range(...), interval(lo, hi) or tag(log, interval(lo, hi))")  # fmt: skip
        else:
            fixed[name] = item.input_line
    return distributions, list(fixed.values())


def override(name: str, value: Any) -> str:
    """The Hydra override that sets ``name`` to a sampled ``value`` (strings quoted)."""
    if isinstance(value, str):
        return f"{name}='{value}'" if "'" not in value else f'{name}="{value}"'
    return f"{name}={value}"


def project_module(name: str) -> Any:
    """A module of this project (``core.run.secrets``...), found from this file's name (``<package>_sweeper.py``)."""
    return importlib.import_module(f"{__name__.rsplit('.', 1)[-1].removesuffix('_sweeper')}.{name}")


def project_secrets() -> Any:
    """This project's :mod:`core.run.secrets` (credentials refused, secrets masked)."""
    return project_module("core.run.secrets")


def study_files(config: DictConfig) -> dict[str, str]:
    """``{key: sha256}`` of the data, base-model and tokenizer files the config names and that exist now
    (``core.identity.fingerprint.named_files``); a Hub name as ``hub:<name>``."""
    identity = project_module("core.identity.fingerprint")

    def pick(key: str) -> Any:
        node = OmegaConf.select(config, key, default=None)
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    plain = {
        "data": {"hub_name": pick("data.hub_name"), "splits": pick("data.splits")},
        "model": {"name_or_path": pick("model.name_or_path"), "tokenizer": pick("model.tokenizer")},
    }
    found = {}
    for key, entry in identity.named_files(plain).items():
        digest = identity.content_digest(entry) or (f"hub:{entry['given']}" if entry.get("hub") else None)
        if digest:
            found[key] = digest
    return found


def check_study_files(study, files: dict[str, str], storage: str) -> None:
    """Record the trials' file contents (:func:`study_files`) in the study; later launches must match (paths may differ).

    Raises:
        SweepConfigError: a file's content differs.
    """
    recorded = study.user_attrs.get("files") or {}
    changed = [
        f"{key} (content): sha256 {recorded[key].removeprefix('hub:')[:12]} -> {files[key].removeprefix('hub:')[:12]}"
        for key in sorted(set(recorded) & set(files))
        if recorded[key] != files[key]
    ]
    if changed:
        raise SweepConfigError(
            f"the files study {study.study_name!r} (storage {storage}) ran its trials on have changed: {'; '.join(changed)}; "
            "one study cannot mix trials on two data sets or models; fix: a new study for the new files "
            "(hydra.sweeper.study_name=<new name>), or put the files back"
        )
    if set(files) - set(recorded):
        study.set_user_attr("files", {**recorded, **files})


def open_storage(storage: str) -> Any:
    """``hydra.sweeper.storage`` for Optuna: an RDB URL as is, ``journal:<file>`` as a journal file storage (multi-process, NFS)."""
    if not storage.startswith(JOURNAL):
        return storage
    import optuna

    path = Path(storage[len(JOURNAL) :])
    path.parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def check_search_space(study, distributions: dict) -> None:
    """Record the search space in the study; later launches must sweep the same (Optuna cannot mix two spaces).

    Raises:
        SweepConfigError: a parameter's space differs.
    """
    from optuna.distributions import distribution_to_json

    space = {name: json.loads(distribution_to_json(d)) for name, d in sorted(distributions.items())}
    recorded = study.user_attrs.get("search_space")
    if recorded is None:
        study.set_user_attr("search_space", space)
        return
    for name in sorted(set(space) | set(recorded)):
        if space.get(name) != recorded.get(name):
            raise SweepConfigError(
                f"hydra.sweeper.params.{name} is {describe(space.get(name))} now, but was {describe(recorded.get(name))} when "
                f"study {study.study_name!r} began, and one study cannot mix two search spaces; fix: a new study "
                f"(hydra.sweeper.study_name=<new name>), or the old search space"
            )


def fixed_setup(lines: list[str], mask: Any = str) -> dict[str, str | None]:
    """``{key: masked value as typed}`` of the fixed overrides defining a study's trials (``~key``: ``None``), less Hydra's
    own, :data:`LAUNCH_ONLY` (where trials run, not what they are) and :data:`FILE_KEYS` (compared by content)."""
    setup = {}
    for item in OverridesParser.create().parse_overrides(lines):
        if item.is_hydra_override() or item.key_or_group in ("hydra", *LAUNCH_ONLY):
            continue
        if item.get_key_element().lstrip("+~").startswith(FILE_KEYS):
            continue
        setup[item.get_key_element()] = mask(item.input_line.split("=", 1)[1].strip()) if "=" in item.input_line else None
    return setup


def check_fixed_overrides(study, setup: dict[str, str | None], storage: str) -> None:
    """Record the fixed overrides (:func:`fixed_setup`) in the study; later launches must match, in any order.

    Raises:
        SweepConfigError: a key was changed, added or removed.
    """
    lines = sorted(setup_line(key, value) for key, value in setup.items())
    recorded = study.user_attrs.get("fixed_overrides")
    if recorded is None:
        study.set_user_attr("fixed_overrides", lines)
        if study.trials:
            log.warning("Study %s in %s began before its fixed overrides were recorded: the setup of its %d earlier trials "
                        "cannot be checked; recorded this launch's, %s", study.study_name, storage, len(study.trials), lines or "none")  # fmt: skip
        return
    old = {key: value if sep else None for key, sep, value in (line.partition("=") for line in recorded)}
    if old == setup:
        return
    changes = [
        f"{setup_line(key, setup[key])} (was {setup_line(key, old[key])})" if key in setup and key in old
        else f"{setup_line(key, setup[key])} (was not set)" if key in setup
        else f"{key} not set (was {setup_line(key, old[key])})"
        for key in sorted(set(setup) | set(old))
        if (key in setup, setup.get(key)) != (key in old, old.get(key))
    ]  # fmt: skip
    raise SweepConfigError(
        f"the fixed overrides differ from those study {study.study_name!r} (storage {storage}) began with: "
        f"{', '.join(changes)}; one study cannot mix trials of two setups; fix: a new study for the new setup "
        f"(hydra.sweeper.study_name=<new name>), or re-run with the study's overrides ({' '.join(recorded) or 'none'})"
    )


def setup_line(key: str, value: str | None) -> str:
    """A fixed override as recorded: ``key=value``, or ``key`` alone (``~key``)."""
    return key if value is None else f"{key}={value}"


def describe(distribution: dict | None) -> str:
    """A distribution's JSON (``distribution_to_json``) in a few words."""
    if distribution is None:
        return "not swept"
    attributes = distribution["attributes"]
    if "choices" in attributes:
        return f"choice{tuple(attributes['choices'])}"
    scale = "log " if attributes.get("log") else ""
    return f"{scale}interval({attributes.get('low')}, {attributes.get('high')})"


def reseeded(sampler: DictConfig, launch: int) -> Any:
    """The configured sampler with seed ``seed + launch`` (``None``: first launch or no seed), so a resumed sweep does not
    replay the first launch's suggestions yet stays reproducible."""
    from hydra.utils import instantiate

    seed = sampler.get("seed")
    if not launch or seed is None:
        return None
    return instantiate(sampler, seed=seed + launch)


def count(study, state: str) -> int:
    """Trials of ``study`` in ``state`` (``COMPLETE``, ``FAIL``...), all processes together."""
    import optuna

    return len(study.get_trials(deepcopy=False, states=(getattr(optuna.trial.TrialState, state),)))


def check_objective(config: DictConfig, directions: list[str]) -> None:
    """Check ``optimized_metric`` is one of ``task.objectives`` (logged, for ``test/``) and ``direction`` agrees.

    Raises:
        SweepConfigError: they do not.
    """
    metric = config.get("optimized_metric")
    objectives = OmegaConf.select(config, "task.objectives") or {}
    if len(directions) != 1 or directions[0] not in BETTER.values():
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
    """Check every swept key (not ``+key``) is in the config or a group, so a typo fails here, not in every trial.

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
    """Write ``best.yaml`` (and ``optimization_results.yaml``) and print the best trial.

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
        "study": {"name": study.study_name, "storage": project_secrets().mask(str(config.hydra.sweeper.storage))},
    }
    path = sweep_dir / "best.yaml"
    OmegaConf.save(OmegaConf.create(result), path)
    OmegaConf.save(
        OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}), sweep_dir / "optimization_results.yaml"
    )
    overrides = " ".join(f"{k}={v}" for k, v in best.params.items())
    print(f"\nBest trial {best.number}: {config.optimized_metric} = {best.value}  ({overrides})\nWritten to {path}", flush=True)
    return path
