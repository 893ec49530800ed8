"""Sweeps, tracking and scale-out, run the way a user runs them: ``python -m {{ cookiecutter.package_name }}.train -m ...``
in a subprocess (a multirun owns its process, and DDP starts its ranks by re-running the command
line, which only a real process shows).  The other tests here run in-process and take a second.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import optuna
import pytest
import torch
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.data.sampling import ResumableSampler
from {{ cookiecutter.package_name }}.utils.config import ConfigError, config_warnings, validate_config
from {{ cookiecutter.package_name }}.utils.distributed import JOB_ENV, ddp_child_argv
from {{ cookiecutter.package_name }}.utils.sweeps import MetricNotLogged, TrialFailed

from .conftest import compose_config

TESTS = Path(__file__).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
{%- if cookiecutter.tasks != "causal_lm" %}
TASK, SEARCH, METRIC = "classification", "classification_optuna", "val/acc"
{%- else %}
TASK, SEARCH, METRIC = "causal_lm", "causal_lm_optuna", "val/loss"
{%- endif %}


def run_module(module: str, args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m {{ cookiecutter.package_name }}.<module> ARGS`` with ``tests/`` importable (faults.py), W&B offline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop(JOB_ENV, None)
    command = [sys.executable, "-m", f"{{ cookiecutter.package_name }}.{module}", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def is_png(path: Path) -> bool:
    """A complete PNG that matplotlib reads back, with pixels."""
    return path.read_bytes()[:8] == PNG_MAGIC and matplotlib.image.imread(path).size > 0


@pytest.fixture(scope="module")
def base(tmp_path_factory, request) -> list[str]:
    """A tiny offline run of the task, one epoch, with no run folder set (Hydra names it)."""
{%- if cookiecutter.tasks != "causal_lm" %}
    from .conftest import tiny_overrides

    tokenizer, data = request.getfixturevalue("tokenizer_dir"), request.getfixturevalue("toy_data")
    overrides = tiny_overrides(tokenizer, data, tmp_path_factory.mktemp("sweep") / "run") + [
        "batch.global_batch_size=32", "test_after_fit=false"]
{%- else %}
    from .conftest import lm_overrides

    tokenizer, text = request.getfixturevalue("lm_tokenizer_dir"), request.getfixturevalue("lm_text")
    overrides = lm_overrides(tokenizer, text, tmp_path_factory.mktemp("sweep") / "run") + [
        "batch.global_batch_size=8", "callbacks.sample_generation=null"]
{%- endif %}
    drop = ("paths.output_dir", "paths.log_dir", "logger=")
    return [o for o in overrides if not o.startswith(drop)] + ["trainer.max_epochs=1", "callbacks.progress_bar=null"]


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``).

    The file is a 7-byte header (``:W&B`` and a version) and then the LevelDB log format: 32 KiB
    blocks of chunks, each ``crc32 (4) | length (2, little-endian) | type (1: whole, 2: first,
    3: middle, 4: last)`` and its bytes; a record is the concatenation of its chunks.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data, position, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    while position + 7 <= len(data):
        room = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):  # block padding
            position += room
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(folder: Path) -> list[dict]:
    """The offline W&B runs under ``folder``: id, group, tags and exit code, from their run files."""
    runs = []
    for path in sorted(folder.glob("**/wandb/offline-run-*/run-*.wandb")):
        run = {"path": path}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, group=record.run.run_group, tags=list(record.run.tags))
            elif kind == "exit":
                run["exit_code"] = record.exit.exit_code
        runs.append(run)
    return runs


def study_trials(sweep_dir: Path) -> list:
    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def study_states(sweep_dir: Path) -> dict[int, str]:
    return {trial.number: trial.state.name for trial in study_trials(sweep_dir)}


def all_different(trials: list) -> bool:
    """No two trials were given the same parameters (a replayed random sequence would)."""
    params = [tuple(sorted(trial.params.items())) for trial in trials]
    return len(set(params)) == len(params)


# --------------------------------------------------------------------------- Optuna sweeps
def test_optuna_sweep_records_a_failed_trial_goes_on_resumes_and_plots(base, tmp_path):
    sweep = base + [
        f"paths.log_dir={tmp_path / 'logs'}", f"hparams_search={SEARCH}", "hydra.sweeper.n_trials=3",
        "logger=[csv,wandb]",
        # Trial 1 runs out of memory in its first step (the CPU stand-in for a CUDA OOM).
        "+callbacks.fault._target_=faults.RaiseOOM", "+callbacks.fault.steps=[0]", "+callbacks.fault.job=1",
    ]
    result = ok(run_module("train", sweep, cwd=tmp_path))
    (sweep_dir,) = (tmp_path / "logs" / "train" / "sweeps").iterdir()
    assert study_states(sweep_dir) == {0: "COMPLETE", 1: "FAIL", 2: "COMPLETE", 3: "COMPLETE"}  # 3 completed
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]  # folder = trial number
    assert "Trial 1 failed" in result.stdout + result.stderr and (sweep_dir / "1" / "oom_report.txt").is_file()
    assert "out of memory" in (sweep_dir / "1" / "error.txt").read_text()
    best = OmegaConf.load(sweep_dir / "best.yaml")
    assert best.optimized_metric == METRIC and best.best_trial in (0, 2, 3) and best.trials.failed == 1
    assert best.best_value == json.loads((sweep_dir / str(best.best_trial) / "metrics.json").read_text())[METRIC]
    assert f"Best trial {best.best_trial}" in result.stdout

    # One W&B run per job, distinct ids, grouped by the sweep, tagged; the failed one exits 1.
    runs = wandb_runs(sweep_dir)
    assert len(runs) == 4 and len({run["id"] for run in runs}) == 4
    assert {run["group"] for run in runs} == {sweep_dir.name}
    assert all(f"task:{TASK}" in run["tags"] and "precision:32-true" in run["tags"] for run in runs)
    assert sorted(run["exit_code"] for run in runs) == [0, 0, 0, 1]
    assert [r["exit_code"] for r in runs if "/1/wandb/" in str(r["path"])] == [1]

    # The same command again, asking for 4: one more trial (number 4, its own folder).
    ok(run_module("train", sweep + ["hydra.sweeper.n_trials=4"], cwd=tmp_path))
    assert study_states(sweep_dir)[4] == "COMPLETE" and len(study_states(sweep_dir)) == 5
    assert (sweep_dir / "4" / "metrics.json").is_file()
    assert all_different(study_trials(sweep_dir))  # the resumed launch suggested new parameters

    # Plots, from the local files only.
    ok(run_module("plot", [str(sweep_dir)], cwd=tmp_path))
    assert is_png(sweep_dir / "plots" / "objective.png") and is_png(sweep_dir / "plots" / "importances.png")
    ok(run_module("plot", [str(sweep_dir / "0")], cwd=tmp_path))
    assert is_png(sweep_dir / "0" / "plots" / "loss.png") and is_png(sweep_dir / "0" / "plots" / "lr.png")


def test_a_metric_the_task_does_not_log_stops_the_sweep_before_any_trial(base, tmp_path):
    result = run_module("train", base + [f"paths.log_dir={tmp_path / 'logs'}", f"hparams_search={SEARCH}",
                                         "optimized_metric=val/accuracy", "logger=csv"], cwd=tmp_path)
    assert result.returncode != 0
    assert "optimized_metric='val/accuracy'" in result.stderr and f"'{METRIC}'" in result.stderr
    assert not list((tmp_path / "logs").glob("**/metrics.json"))  # no trial ran


def test_a_trial_that_did_not_log_the_metric_stops_the_sweep_other_failures_do_not(tmp_path):
    hydra_plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    sweeper = hydra_plugin.ResumableOptunaSweeper.__new__(hydra_plugin.ResumableOptunaSweeper)
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

    from {{ cookiecutter.package_name }}.utils.sweeps import run_multirun_job

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


def fake_sweep(tmp_path: Path, outcome, n_trials: int):
    """The project's sweeper on a study in ``tmp_path`` with a fake launcher: the whole trial loop
    (top-up, numbering, failures, reseeding, best.yaml) in a second, without training."""
    plugin = pytest.importorskip("hydra_plugins.{{ cookiecutter.package_name }}_sweeper")
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 1}
    sweeper = plugin.ResumableOptunaSweeper(
        sampler=optuna.samplers.TPESampler(seed=1), direction="maximize", storage=storage, study_name="s",
        n_trials=n_trials, n_jobs=1, max_failure_rate=0.5, params=OmegaConf.create({"optimizer.lr": "interval(0.1, 1.0)"}))
    config = OmegaConf.create({
        "optimized_metric": "val/acc", "task": {"objectives": {"val/acc": "max"}}, "optimizer": {"lr": 0.5},
        "hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {"storage": storage, "sampler": sampler}, "runtime": {"choices": {}}},
    })
    sweeper.config = sweeper.impl.config = config
    sweeper.impl.launcher = launcher = FakeLauncher(outcome)
    sweeper.sweep([])
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
    config = OmegaConf.create({"optimized_metric": METRIC, "task": {"objectives": {METRIC: "max" if TASK == "classification" else "min"}},
                               "optimizer": {"lr": 1e-4}})
    wrong = "minimize" if TASK == "classification" else "maximize"
    with pytest.raises(hydra_plugin.SweepConfigError, match=f"hydra.sweeper.direction={wrong}"):
        hydra_plugin.check_objective(config, [wrong])
    hydra_plugin.check_params(config, ["optimizer.lr", "+new.key"])
    with pytest.raises(hydra_plugin.SweepConfigError, match="peft.r"):
        hydra_plugin.check_params(config, ["optimizer.lr", "peft.r"])


@pytest.fixture(scope="module")
def single_process_run(base, tmp_path_factory) -> Path:
    """The base run on one process (with its test split where the task has one): the reference."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
{%- if cookiecutter.tasks != "causal_lm" %}
    extra = ["test_after_fit=true"]
{%- else %}
    extra = []
{%- endif %}
    ok(run_module("train", base + extra + [f"hydra.run.dir={run_dir}", "logger=csv"], cwd=run_dir.parent))
    return run_dir


def test_every_objective_of_the_task_is_logged_by_a_run(single_process_run):
    """``task.objectives`` (what the sweeper accepts) must be names a run really logs."""
    metrics = json.loads((single_process_run / "metrics.json").read_text())
    objectives = compose_config("train", [f"task={TASK}"]).task.objectives
    expected = [name for name in objectives if not name.startswith("test/") or "test/loss" in metrics]
    assert [name for name in expected if name not in metrics] == []


# ---------------------------------------------------------------------- folders and launchers
def start_together(args: list[str], cwd: Path, copies: int = 2) -> None:
    """Start ``copies`` identical ``train`` commands at the same moment; all must succeed."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", *args]
    processes = [subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(copies)]
    for process in processes:
        _, stderr = process.communicate(timeout=400)
        assert process.returncode == 0, stderr[-3000:]


def test_two_multiruns_started_in_the_same_second_get_their_own_folders(base, tmp_path):
    start_together(["-m", *base, f"paths.log_dir={tmp_path / 'logs'}", "optimizer.lr=1e-4", "logger=csv"], tmp_path)
    folders = sorted((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert len(folders) == 2, folders
    assert all((folder / "0" / "metrics.json").is_file() for folder in folders)
    ok(run_module("plot", [str(folders[0])], cwd=tmp_path))  # a grid multirun: the objective per job
    assert is_png(folders[0] / "plots" / "objective.png")


def test_two_identical_optuna_sweeps_started_together_share_the_study_without_collisions(base, tmp_path):
    start_together([*base, f"paths.log_dir={tmp_path / 'logs'}", f"hparams_search={SEARCH}", "hydra.sweeper.n_trials=2",
                    "logger=csv"], tmp_path)
    (sweep_dir,) = (tmp_path / "logs" / "train" / "sweeps").iterdir()
    states = study_states(sweep_dir)  # both worked on one study, each trial in its own folder
    assert 2 <= list(states.values()).count("COMPLETE") <= 3 and "FAIL" not in states.values()
    assert all_different(study_trials(sweep_dir))  # the second launch did not replay the first's suggestions
    assert sorted(int(p.name) for p in sweep_dir.iterdir() if p.name.isdigit()) == sorted(states)
    assert all((sweep_dir / str(number) / "metrics.json").is_file() for number in states)


def test_submitit_local_launcher_runs_a_two_job_multirun(base, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    ok(run_module("train", ["-m", *base, f"paths.log_dir={tmp_path / 'logs'}", "launcher=local",
                                   "optimizer.lr=1e-4,2e-4", "logger=csv"], cwd=tmp_path, timeout=400))
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert all((sweep_dir / job / "metrics.json").is_file() for job in ("0", "1"))
    assert list((sweep_dir / ".submitit").iterdir())  # the jobs went through submitit
    overrides = [OmegaConf.load(sweep_dir / job / ".hydra" / "overrides.yaml") for job in ("0", "1")]
    assert ["optimizer.lr=0.0001" in o for o in overrides] == [True, False]


# ------------------------------------------------------------------------------ DDP and FSDP
def test_multirun_with_ddp_leaves_exactly_one_sweep_folder_and_survives_a_failed_job(base, tmp_path):
    result = run_module("train", ["-m", *base, f"paths.log_dir={tmp_path / 'logs'}", "trainer=ddp_cpu", "batch.micro_batch_size=8",
                                  "optimizer.lr=1e-4,2e-4", "logger=csv",
                                  # job 0 runs out of memory on both ranks; job 1 must still run
                                  "+callbacks.fault._target_=faults.RaiseOOM", "+callbacks.fault.steps=[0]", "+callbacks.fault.job=0"],
                        cwd=tmp_path, timeout=500)
    assert result.returncode == 1 and "CUDA out of memory" in result.stderr  # Hydra's grid sweep reports the failed job at the end
    assert [p.name for p in (tmp_path / "logs" / "train").iterdir()] == ["multiruns"]  # no runs/ of a rank-1 process
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep_dir.iterdir() if not p.name.startswith(".")) == ["0", "1", "multirun.yaml"]
    assert (sweep_dir / "0" / "oom_report.txt").is_file() and not (sweep_dir / "0" / "metrics.json").exists()
    assert (sweep_dir / "1" / "metrics.json").is_file()  # the sweep went on after the failed job
    for job in ("0", "1"):
        assert (sweep_dir / job / "train_ddp_process_1.log").is_file()  # rank 1 ran this job, in this folder


def test_ddp_cpu_trains_with_two_processes_which_stop_together_on_a_signal_to_one_and_resume(base, single_process_run, tmp_path):
    run_dir = tmp_path / "run"
    ddp = base + [f"hydra.run.dir={run_dir}", "trainer=ddp_cpu", "batch.micro_batch_size=8", "logger=csv"]
    stopped = run_module("train", ddp + ["+callbacks.fault._target_=faults.KillAt", "+callbacks.fault.step=1",
                                         "+callbacks.fault.signal_name=SIGTERM", "+callbacks.fault.rank=0"], cwd=tmp_path)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in stopped.stdout + stopped.stderr  # a second process joined
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # no rank left waiting: both stopped, rank 0 exits 128 + 15
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2  # the step in progress when SIGTERM came was finished
    ok(run_module("train", ddp + ["ckpt_path=last"], cwd=tmp_path))
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    reference = torch.load(single_process_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    # Each process trained on its share of the epoch at the same global batch (twice the steps if
    # each had gone through all the rows), and the resume started at the right row of the epoch.
    assert final == reference
    with (run_dir / "csv" / "metrics.csv").open() as file:
        steps = [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]
    assert steps == list(range(reference))
    assert not list(tmp_path.glob("logs"))  # the rank-1 process wrote no run folder of its own


def test_ddp_child_of_a_multirun_job_runs_that_job_alone():
    environ = {JOB_ENV: json.dumps({"overrides": ["optimizer.lr=0.0002", "trainer=ddp_cpu"], "output_dir": "/x/multiruns/s/1"}),
               "LOCAL_RANK": "1"}
    argv = ["train.py", "-m", "--config-dir", "extra", "optimizer.lr=1e-4,2e-4", "trainer=ddp_cpu",
            'hydra.run.dir="/x/runs/r"', "hydra.job.name=train_ddp_process_1", "hydra.output_subdir=null"]
    assert ddp_child_argv(argv, environ) == [
        "train.py", "--config-dir", "extra", "optimizer.lr=0.0002", "trainer=ddp_cpu", "hydra.mode=RUN",
        "hydra.run.dir=/x/multiruns/s/1", "hydra.output_subdir=null", "hydra.job.name=train_ddp_process_1"]
    assert ddp_child_argv(argv, {**environ, "LOCAL_RANK": "0"}) is None  # rank 0 is the job itself
    assert ddp_child_argv(argv, {"LOCAL_RANK": "1"}) is None  # a DDP child of a single run: Lightning's command as is


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
    validate_config(cfg)
    assert any("each process runs micro-batches of 16" in warning for warning in config_warnings(cfg))
    cfg = compose_config("train", ["trainer=ddp_cpu", "batch.global_batch_size=33", "batch.micro_batch_size=11"])
    with pytest.raises(ConfigError, match=r"global_batch_size=33 cannot be split over 2 processes.*multiple of 2"):
        validate_config(cfg)


def test_ddp_inside_a_submitit_local_job_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")  # what submitit's local executor sets in its jobs
    cfg = compose_config("train", ["trainer=ddp_cpu"])
    with pytest.raises(ConfigError, match="launcher=local runs each job as one process.*fix: drop launcher=local"):
        validate_config(cfg)


def test_fsdp_on_a_machine_without_cuda_is_refused_before_anything_loads():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: trainer=fsdp is allowed here")
    cfg = compose_config("train", ["trainer=fsdp", "precision=32-true"])
    with pytest.raises(ConfigError, match="trainer=fsdp shards the model over CUDA GPUs.*fix: trainer=ddp_cpu"):
        validate_config(cfg)
