"""Sweeps and scale-out, in process: the sweeper's trial loop on a fake launcher, its checks before
the first trial, the DDP child's command line, the sharded sampler, the kept global batch and the
refusals.  The same things run for real in ``e2e/test_sweeps.py`` and ``ddp/test_ddp.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest
import torch
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.core.config.validate import config_warnings
from {{ cookiecutter.package_name }}.core.data.sampling import ResumableSampler
from {{ cookiecutter.package_name }}.core.errors import ConfigError, MetricNotLogged, TrialFailed
from {{ cookiecutter.package_name }}.core.run.distributed import JOB_ENV, ddp_child_argv, rank_exit_code
from {{ cookiecutter.package_name }}.tasks import check_config

from .conftest import METRIC, TASK, compose_config


def study_storage(sweep_dir: Path):
    """The storage of the study in ``sweep_dir``: ``optuna.journal`` if there is one, else ``optuna.db``."""
    journal = sweep_dir / "optuna.journal"
    if journal.is_file():
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    return f"sqlite:///{sweep_dir / 'optuna.db'}"


def study_trials(sweep_dir: Path) -> list:
    storage = study_storage(sweep_dir)
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def study_states(sweep_dir: Path) -> dict[int, str]:
    return {trial.number: trial.state.name for trial in study_trials(sweep_dir)}


def all_different(trials: list) -> bool:
    """No two trials were given the same parameters (a replayed random sequence would)."""
    params = [tuple(sorted(trial.params.items())) for trial in trials]
    return len(set(params)) == len(params)


def test_a_trial_that_did_not_log_the_metric_stops_the_sweep_other_failures_do_not(tmp_path):
    hydra_plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    sweeper = hydra_plugin.ResumableOptunaSweeper(None, "maximize", "sqlite://", "s", n_trials=1, n_jobs=1, max_failure_rate=0.5)
    sweeper.config = OmegaConf.create({"optimized_metric": METRIC})
    study = optuna.create_study()

    def tell(error: Exception | None, value: float | None = None) -> str:
        trial = study.ask()
        job = JobReturn(status=JobStatus.FAILED if error else JobStatus.COMPLETED)
        job.return_value = error if error else value
        sweeper._tell(study, trial, job, tmp_path)
        return study.trials[-1].state.name

    assert tell(None, 0.5) == "COMPLETE"
    assert tell(TrialFailed("CUDA out of memory")) == "FAIL"
    assert tell(None, float("nan")) == "FAIL"
    trial = study.ask()  # a trial whose config did not compose (the launcher raised)
    sweeper._tell(study, trial, hydra_plugin.failed_job(ValueError("Could not load 'trainer/nonexistent'")), tmp_path)
    assert study.trials[-1].state.name == "FAIL"
    with pytest.raises(hydra_plugin.SweepConfigError, match="val/accuracy"):
        tell(MetricNotLogged(f"optimized_metric='val/accuracy' was not logged by this run; the run logged ['{METRIC}']"))
    assert study.trials[-1].state.name == "FAIL"


def test_a_failed_trial_leaves_nothing_of_its_model_behind(tmp_path):
    """The exception a failed job hands to Hydra carries no frames: the model it held is freed
    before the next trial (on a GPU, its memory too: torch.cuda.empty_cache follows)."""
    import weakref

    from {{ cookiecutter.package_name }}.core.run.sweeps import run_multirun_job

    alive = []

    def trial() -> float:
        model = torch.nn.Linear(64, 64)
        alive.append(weakref.ref(model))
        raise RuntimeError("diverged")

    with pytest.raises(TrialFailed, match="RuntimeError: diverged") as failure:
        run_multirun_job(trial, tmp_path / "job")
    assert alive[0]() is None  # collected, although the failure is still being handled
    assert failure.value.__context__ is None and "diverged" in (tmp_path / "job" / "error.txt").read_text()


class FakeLauncher:
    """Stands in for Hydra's launcher: ``outcome(trial number, overrides)`` is a job's value, or
    an exception for a failed job; records the job numbers launched."""

    def __init__(self, outcome):
        self.outcome, self.numbers = outcome, []

    def launch(self, overrides, initial_job_idx):
        jobs = []
        for number, override in enumerate(overrides, start=initial_job_idx):
            self.numbers.append(number)
            result = self.outcome(number, override)
            job = JobReturn(status=JobStatus.FAILED if isinstance(result, Exception) else JobStatus.COMPLETED)
            job.return_value = result
            jobs.append(job)
        return jobs


def fake_sweep(
    tmp_path: Path, outcome, n_trials: int, params: dict | None = None, storage: str | None = None, arguments=(), data: dict | None = None
):
    """The project's sweeper on a study in ``tmp_path`` with a fake launcher: the whole trial loop
    (top-up, numbering, failures, reseeding, best.yaml) in a second, without training."""
    plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    storage = storage or f"sqlite:///{tmp_path / 'optuna.db'}"
    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 1}
    sweeper = plugin.ResumableOptunaSweeper(
        sampler=optuna.samplers.TPESampler(seed=1),
        direction="maximize",
        storage=storage,
        study_name="s",
        n_trials=n_trials,
        n_jobs=1,
        max_failure_rate=0.5,
        params=OmegaConf.create(params or {"optimizer.lr": "interval(0.1, 1.0)"}),
    )
    config = OmegaConf.create(
        {
            "optimized_metric": "val/acc",
            "task": {"objectives": {"val/acc": "max"}},
            "optimizer": {"lr": 0.5},
            **({"data": data} if data is not None else {}),
            "hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {"storage": storage, "sampler": sampler}, "runtime": {"choices": {}}},
        }
    )
    sweeper.config = config
    sweeper.launcher = launcher = FakeLauncher(outcome)
    sweeper.sweep(list(arguments))
    return launcher


def test_the_sweep_loop_tops_up_numbers_trials_reseeds_and_caps_failures_per_launch(tmp_path):
    first = fake_sweep(tmp_path, lambda n, o: TrialFailed("CUDA out of memory") if n == 1 else 0.5, n_trials=3)
    assert first.numbers == [0, 1, 2, 3]  # 3 completed: the failed trial 1 does not count
    again = fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=4)
    assert again.numbers == [4]  # topped up to 4 completed, in the folder of trial 4
    assert fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=4).numbers == []  # reached: nothing runs, best.yaml written
    assert all_different(study_trials(tmp_path)) and OmegaConf.load(tmp_path / "best.yaml").best_trial == 4

    # Every trial fails: the launch stops after more than 0.5 x 4 failures, keeping best.yaml of what completed.
    (tmp_path / "best.yaml").unlink()
    with pytest.raises(SystemExit):
        fake_sweep(tmp_path, lambda n, o: TrialFailed("broken"), n_trials=6)
    assert study_states(tmp_path) == {**{n: "COMPLETE" for n in (0, 2, 3, 4)}, 1: "FAIL", 5: "FAIL", 6: "FAIL", 7: "FAIL", 8: "FAIL"}
    assert (tmp_path / "best.yaml").is_file()
    # The cause fixed, the same command resumes: the old failures do not count against it.
    fixed = fake_sweep(tmp_path, lambda n, o: 0.7, n_trials=6)
    assert fixed.numbers == [9, 10] and list(study_states(tmp_path).values()).count("COMPLETE") == 6


def test_the_sweeper_checks_direction_and_parameters_before_the_first_trial():
    hydra_plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    config = OmegaConf.create(
        {
            "optimized_metric": METRIC,
            "task": {"objectives": {METRIC: "max" if TASK == "classification" else "min"}},
            "optimizer": {"lr": 1e-4},
        }
    )
    wrong = "minimize" if TASK == "classification" else "maximize"
    with pytest.raises(hydra_plugin.SweepConfigError, match=f"hydra.sweeper.direction={wrong}"):
        hydra_plugin.check_objective(config, [wrong])
    hydra_plugin.check_params(config, ["optimizer.lr", "+new.key"])
    with pytest.raises(hydra_plugin.SweepConfigError, match="peft.r"):
        hydra_plugin.check_params(config, ["optimizer.lr", "peft.r"])


def test_ddp_child_of_a_multirun_job_runs_that_job_alone():
    environ = {
        JOB_ENV: json.dumps({"overrides": ["optimizer.lr=0.0002", "trainer=ddp_cpu"], "output_dir": "/x/multiruns/s/1"}),
        "LOCAL_RANK": "1",
    }
    argv = [
        "train.py",
        "-m",
        "--config-dir",
        "extra",
        "optimizer.lr=1e-4,2e-4",
        "trainer=ddp_cpu",
        'hydra.run.dir="/x/runs/r"',
        "hydra.job.name=train_ddp_process_1",
        "hydra.output_subdir=null",
    ]
    assert ddp_child_argv(argv, environ) == [
        "train.py",
        "--config-dir",
        "extra",
        "optimizer.lr=0.0002",
        "trainer=ddp_cpu",
        "hydra.mode=RUN",
        "hydra.run.dir=/x/multiruns/s/1",
        "hydra.output_subdir=null",
        "hydra.job.name=train_ddp_process_1",
    ]
    # The other spellings of Hydra's config flags, as Hydra's own parser reads them.
    spelled = ["train.py", "-m", "-cn=train", "--config-path", "/abs/configs", "-c", "job", "-cd=extra", "optimizer.lr=1e-4,2e-4"]
    assert ddp_child_argv(spelled, environ)[:7] == [
        "train.py",
        "--config-dir",
        "extra",
        "--config-name",
        "train",
        "--config-path",
        "/abs/configs",
    ]
    assert ddp_child_argv(argv, {**environ, "LOCAL_RANK": "0"}) is None  # rank 0 is the job itself
    assert ddp_child_argv(argv, {"LOCAL_RANK": "1"}) is None  # a DDP child of a single run: Lightning's command as is


def test_a_child_rank_stopped_by_an_agreed_signal_exits_0_so_lightnings_observer_leaves_rank_0_alone():
    """The flaky DDP stop test: rank 1 exiting 143 first made Lightning's process observer SIGKILL rank 0 (-9, not 143)."""
    assert rank_exit_code(143, rank=1) == 0 and rank_exit_code(130, rank=3) == 0
    assert rank_exit_code(143, rank=0) == 143  # rank 0's code is the run's
    assert rank_exit_code(3, rank=1) == 3 and rank_exit_code(5, rank=1) == 5  # a stop of its own still brings the others down


def test_the_sampler_shards_an_epoch_over_ranks_and_resumes_each_where_it_stopped():
    order = ResumableSampler(10, seed=3).order(0)
    ranks = [ResumableSampler(10, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    shards = [list(sampler) for sampler in ranks]
    assert [len(s) for s in shards] == [5, 5] and sorted(shards[0] + shards[1]) == sorted(order)
    for rank, sampler in enumerate(ranks):  # 2 rows per rank done = 4 rows of the epoch
        sampler.resume_at(epoch=0, rows_done=4)
        assert list(sampler) == shards[rank][2:]
    odd = [list(ResumableSampler(9, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert [len(s) for s in odd] == [5, 5]  # padded as DistributedSampler pads


def test_the_global_batch_is_kept_on_more_devices():
    cfg = compose_config("train", ["trainer=ddp_cpu", "batch.global_batch_size=32", "batch.micro_batch_size=8"])
    assert (cfg.batch.device_batch_size, cfg.batch.accumulate_grad_batches) == (8, 2)  # 32 = 8 x 2 processes x 2
    assert cfg.data.batch_size == 8
    # A one-GPU recipe (32 = 32 x 1) on 2 processes: micro-batches of 16, said out loud.
    cfg = compose_config("train", ["trainer=ddp_cpu", "batch.global_batch_size=32", "batch.micro_batch_size=32"])
    assert (cfg.batch.device_batch_size, cfg.batch.accumulate_grad_batches, cfg.data.batch_size) == (16, 1, 16)
    check_config(cfg)
    assert any("each process runs micro-batches of 16" in warning for warning in config_warnings(cfg))
    cfg = compose_config("train", ["trainer=ddp_cpu", "batch.global_batch_size=33", "batch.micro_batch_size=11"])
    with pytest.raises(ConfigError, match=r"global_batch_size=33 cannot be split over 2 processes.*multiple of 2"):
        check_config(cfg)


def test_ddp_inside_a_submitit_local_job_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")  # what submitit's local executor sets in its jobs
    cfg = compose_config("train", ["trainer=ddp_cpu"])
    with pytest.raises(ConfigError, match="launcher=local runs each job as one process.*fix: drop launcher=local"):
        check_config(cfg)


def test_fsdp_on_a_machine_without_cuda_is_refused_before_anything_loads():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: trainer=fsdp is allowed here")
    cfg = compose_config("train", ["trainer=fsdp", "precision=32-true"])
    with pytest.raises(ConfigError, match="trainer=fsdp shards the model over CUDA GPUs.*fix: trainer=ddp_cpu"):
        check_config(cfg)


def test_run_and_sweep_folders_carry_the_process_id():
    """Two launches in the same second never share a folder: run and multirun folder names end
    in the process id (``${pid:}``), unique among live processes.  (e2e/test_sweeps.py starts two
    identical sweeps at once for real.)"""
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
        cfg = compose("train", ["paths.log_dir=/logs"], return_hydra_config=True)
    run_dir, sweep_dir = OmegaConf.select(cfg, "hydra.run.dir"), OmegaConf.select(cfg, "hydra.sweep.dir")
    assert run_dir.startswith("/logs/train/runs/") and sweep_dir.startswith("/logs/train/multiruns/")
    for folder in (run_dir, sweep_dir):
        date, time, pid = folder.rsplit("/", 1)[1].split("_")
        assert pid == str(os.getpid()) and len(date) == 10 and len(time) == 8, folder


def test_the_search_space_is_read_with_hydras_override_syntax():
    plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    space, fixed = plugin.search_space([
        "optimizer.lr=tag(log, interval(1e-5, 3e-4))", "batch.micro_batch_size=choice(8, 16, 32)", "+peft.r=range(4, 13, 4)",
        "seed=7", "lr_schedule.decay=choice(linear, cosine)", "batch.micro_batch_size=choice(4, 8)",  # the later line wins
    ])  # fmt: skip
    lr = space["optimizer.lr"]
    assert isinstance(lr, optuna.distributions.FloatDistribution) and (lr.low, lr.high, lr.log) == (1e-5, 3e-4, True)
    assert space["batch.micro_batch_size"].choices == (4, 8) and space["+peft.r"].choices == (4, 8, 12)
    assert space["lr_schedule.decay"].choices == ("linear", "cosine") and fixed == ["seed=7"]
    assert plugin.override("lr_schedule.decay", "cosine") == "lr_schedule.decay='cosine'"
    assert plugin.override("optimizer.lr", 1e-4) == "optimizer.lr=0.0001"
    with pytest.raises(plugin.SweepConfigError, match="hydra.sweeper.params"):
        plugin.search_space(["optimizer.lr=interval(1e-5"])


def test_an_edited_search_space_stops_before_any_trial_naming_the_parameter(tmp_path, capsys):
    fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=2, params={"optimizer.lr": "choice(0.1, 0.2)"})
    with pytest.raises(SystemExit) as stop:
        fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=3, params={"optimizer.lr": "choice(0.1, 0.2, 0.3)"})
    assert stop.value.code == 1
    message = capsys.readouterr().err
    assert "hydra.sweeper.params.optimizer.lr is choice(0.1, 0.2, 0.3) now, but was choice(0.1, 0.2)" in message
    assert "fix: a new study (hydra.sweeper.study_name=<new name>)" in message and "Traceback" not in message
    assert study_states(tmp_path) == {0: "COMPLETE", 1: "COMPLETE"}  # nothing asked, nothing left RUNNING


def test_two_launches_share_a_journal_study(tmp_path):
    """journal:<file> (Optuna's journal file storage, for several launches at once or NFS): a
    second launch tops the same study up, with its own trial numbers and new parameters."""
    storage = f"journal:{tmp_path / 'optuna.journal'}"
    assert fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=2, storage=storage).numbers == [0, 1]
    assert fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=4, storage=storage).numbers == [2, 3]
    assert study_states(tmp_path) == {n: "COMPLETE" for n in range(4)} and all_different(study_trials(tmp_path))


def study_attrs(sweep_dir: Path) -> dict:
    return optuna.load_study(study_name="s", storage=study_storage(sweep_dir)).user_attrs


def test_a_changed_fixed_override_stops_before_any_trial_naming_key_old_new_and_fix(tmp_path, capsys):
    """The bug: another fixed setup on the same study was topped up silently, mixing two setups."""
    fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=2, arguments=["data.max_length=32", "trainer.max_epochs=1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=3, arguments=["data.max_length=16", "trainer.max_epochs=2"])
    assert stop.value.code == 1
    message = capsys.readouterr().err
    assert "data.max_length=16 (was data.max_length=32), trainer.max_epochs=2 (was trainer.max_epochs=1)" in message
    assert f"study 's' (storage sqlite:///{tmp_path / 'optuna.db'})" in message and "Traceback" not in message
    assert "fix: a new study for the new setup (hydra.sweeper.study_name=<new name>)" in message
    assert "re-run with the study's overrides (data.max_length=32 trainer.max_epochs=1)" in message
    assert study_states(tmp_path) == {0: "COMPLETE", 1: "COMPLETE"}  # nothing asked, nothing left RUNNING
    assert study_attrs(tmp_path)["launches"] == 1


def test_the_same_fixed_overrides_in_another_order_top_the_study_up(tmp_path):
    """Compared as key -> value: the order does not matter, nor Hydra's own keys or launcher= (where trials run)."""
    fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=2, arguments=["data.max_length=32", "trainer.max_epochs=1", "+peft.r=8"])
    assert study_attrs(tmp_path)["fixed_overrides"] == ["+peft.r=8", "data.max_length=32", "trainer.max_epochs=1"]
    again = ["trainer.max_epochs=1", "+peft.r=8", "launcher=slurm", "hydra.sweeper.n_jobs=1", "data.max_length=32"]
    seen = []
    assert fake_sweep(tmp_path, lambda n, o: seen.append(o) or 0.6, n_trials=3, arguments=again).numbers == [2]
    assert "data.max_length=32" in seen[0] and "trainer.max_epochs=1" in seen[0]
    assert study_attrs(tmp_path)["fixed_overrides"] == ["+peft.r=8", "data.max_length=32", "trainer.max_epochs=1"]


def test_an_added_or_removed_fixed_override_is_refused(tmp_path, capsys):
    fake_sweep(tmp_path, lambda n, o: 0.5, n_trials=1, arguments=["data.max_length=32"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=2, arguments=["data.max_length=32", "trainer.max_epochs=2"])
    assert "trainer.max_epochs=2 (was not set)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=2)
    assert "data.max_length not set (was data.max_length=32)" in capsys.readouterr().err
    assert study_states(tmp_path) == {0: "COMPLETE"}


def test_a_study_from_before_the_record_gets_its_fixed_overrides_recorded_with_a_warning(tmp_path, caplog):
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}", direction="maximize")
    lr = optuna.distributions.FloatDistribution(0.1, 1.0)
    study.add_trial(optuna.trial.create_trial(params={"optimizer.lr": 0.5}, distributions={"optimizer.lr": lr}, value=0.5))
    with caplog.at_level("WARNING"):
        assert fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=2, arguments=["data.max_length=32"]).numbers == [1]
    (warning,) = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert "setup of its 1 earlier trials cannot be checked" in warning and "data.max_length=32" in warning
    assert study_attrs(tmp_path)["fixed_overrides"] == ["data.max_length=32"]
    with pytest.raises(SystemExit):  # from now on, checked
        fake_sweep(tmp_path, lambda n, o: 0.6, n_trials=3, arguments=["data.max_length=16"])


def test_a_data_file_rewritten_in_place_stops_the_study_and_the_same_content_elsewhere_tops_it_up(tmp_path, capsys, monkeypatch):
    """The study records what its trials read (sha256 of the data, base-model and tokenizer files),
    not the paths as typed: a train file with other rows at the same path is refused, the same
    rows at another path are the same study."""
    monkeypatch.setenv("FILE_HASH_CACHE", str(tmp_path / "file_hashes.json"))
    data, moved, sweep_dir = tmp_path / "train.csv", tmp_path / "moved.csv", tmp_path / "sweep"
    data.write_text("text,label\na good film,positive\n")
    moved.write_text(data.read_text())

    def sweep(path: Path, n_trials: int):
        return fake_sweep(
            sweep_dir, lambda n, o: 0.5, n_trials, arguments=[f"data.splits.train={path}"], data={"splits": {"train": str(path)}}
        )

    assert sweep(data, 1).numbers == [0]
    assert sweep(moved, 2).numbers == [1]  # (the path differs, the content does not)
    data.write_text("text,label\na dull film,negative\n")
    with pytest.raises(SystemExit) as stop:
        sweep(data, 3)
    message = capsys.readouterr().err
    assert stop.value.code == 1 and "data.splits.train (content): sha256 " in message, message
    assert "hydra.sweeper.study_name=<new name>" in message and "Traceback" not in message
    assert len(study_trials(sweep_dir)) == 2
