"""Sweeps, tracking and launchers, run the way a user runs them: ``python -m {{ cookiecutter.package_name }}.train -m ...``
in a subprocess (a multirun owns its process; two launches at once need two processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ..conftest import METRIC, SEARCH, TASK, compose_config
from ..processes import TESTS, is_png, ok, run_module
from ..test_sweeps import all_different, study_states, study_trials


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
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):  # block padding
            position += room
            continue
        pending += data[position + 7 : position + 7 + length]
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


# --------------------------------------------------------------------------- Optuna sweeps
def test_optuna_sweep_records_a_failed_trial_goes_on_resumes_and_plots(cli_base, tmp_path):
    sweep = cli_base + [
        f"paths.log_dir={tmp_path / 'logs'}",
        f"hparams_search={SEARCH}",
        "hydra.sweeper.n_trials=3",
        "logger=[csv,wandb]",
        # Trial 1 runs out of memory in its first step (the CPU stand-in for a CUDA OOM).
        "+callbacks.fault._target_=faults.RaiseOOM",
        "+callbacks.fault.steps=[0]",
        "+callbacks.fault.job=1",
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


def test_a_metric_the_task_does_not_log_stops_the_sweep_before_any_trial(cli_base, tmp_path):
    result = run_module(
        "train",
        cli_base + [f"paths.log_dir={tmp_path / 'logs'}", f"hparams_search={SEARCH}", "optimized_metric=val/accuracy", "logger=csv"],
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "optimized_metric='val/accuracy'" in result.stderr and f"'{METRIC}'" in result.stderr
    assert not list((tmp_path / "logs").glob("**/metrics.json"))  # no trial ran


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
    processes = [
        subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(copies)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=400)
        assert process.returncode == 0, stderr[-3000:]


def test_two_identical_optuna_sweeps_started_together_share_the_study_without_collisions(cli_base, tmp_path):
    # Several launches on one study: Optuna's journal file storage (SQLite is unsafe with concurrent writers).
    journal = "hydra.sweeper.storage='journal:${hydra.sweep.dir}/optuna.journal'"
    start_together(
        [*cli_base, f"paths.log_dir={tmp_path / 'logs'}", f"hparams_search={SEARCH}", "hydra.sweeper.n_trials=2", "logger=csv", journal],
        tmp_path,
    )
    (sweep_dir,) = (tmp_path / "logs" / "train" / "sweeps").iterdir()
    assert (sweep_dir / "optuna.journal").is_file() and not (sweep_dir / "optuna.db").exists()
    states = study_states(sweep_dir)  # both worked on one study, each trial in its own folder
    assert 2 <= list(states.values()).count("COMPLETE") <= 3 and "FAIL" not in states.values()
    assert all_different(study_trials(sweep_dir))  # the second launch did not replay the first's suggestions
    assert sorted(int(p.name) for p in sweep_dir.iterdir() if p.name.isdigit()) == sorted(states)
    assert all((sweep_dir / str(number) / "metrics.json").is_file() for number in states)


def test_submitit_local_launcher_runs_a_two_job_multirun(cli_base, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    ok(
        run_module(
            "train",
            ["-m", *cli_base, f"paths.log_dir={tmp_path / 'logs'}", "launcher=local", "optimizer.lr=1e-4,2e-4", "logger=csv"],
            cwd=tmp_path,
            timeout=400,
        )
    )
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert all((sweep_dir / job / "metrics.json").is_file() for job in ("0", "1"))
    assert list((sweep_dir / ".submitit").iterdir())  # the jobs went through submitit
    overrides = [OmegaConf.load(sweep_dir / job / ".hydra" / "overrides.yaml") for job in ("0", "1")]
    assert ["optimizer.lr=0.0001" in o for o in overrides] == [True, False]
    ok(run_module("plot", [str(sweep_dir)], cwd=tmp_path))  # a grid multirun: the objective per job
    assert is_png(sweep_dir / "plots" / "objective.png")


# ------------------------------------------------------------------------------ DDP and FSDP
