"""Lightning's DDP on the CPU (``trainer=ddp_cpu``, gloo): two real processes, started the way a
user starts them (Lightning starts the second rank by re-running the command line, which only a
real process shows)."""

from __future__ import annotations

import json
import os

{% if cookiecutter.tasks != "causal_lm" %}import pytest
{% endif %}import torch

from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics

{% if cookiecutter.tasks != "causal_lm" %}from ..conftest import toy_rows, write_csv
{% endif %}from ..processes import WITHOUT_FAULT, ok, run_module


def test_multirun_with_ddp_leaves_exactly_one_sweep_folder_and_survives_a_failed_job(cli_base, tmp_path):
    result = run_module(
        "train",
        [
            "-m",
            *cli_base,
            f"paths.log_dir={tmp_path / 'logs'}",
            "trainer=ddp_cpu",
            "batch.micro_batch_size=8",
            "optimizer.lr=1e-4,2e-4",
            "logger=csv",
            # job 0 runs out of memory on both ranks; job 1 must still run
            "+callbacks.fault._target_=faults.RaiseOOM",
            "+callbacks.fault.steps=[0]",
            "+callbacks.fault.job=0",
        ],
        cwd=tmp_path,
        timeout=500,
    )
    assert result.returncode == 1 and "CUDA out of memory" in result.stderr  # Hydra's grid sweep reports the failed job at the end
    assert [p.name for p in (tmp_path / "logs" / "train").iterdir()] == ["multiruns"]  # no runs/ of a rank-1 process
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep_dir.iterdir() if not p.name.startswith(".")) == ["0", "1", "multirun.yaml"]
    assert (sweep_dir / "0" / "oom_report.txt").is_file() and not (sweep_dir / "0" / "metrics.json").exists()
    assert (sweep_dir / "1" / "metrics.json").is_file()  # the sweep went on after the failed job
    for job in ("0", "1"):
        assert (sweep_dir / job / "train_ddp_process_1.log").is_file()  # rank 1 ran this job, in this folder


def test_ddp_cpu_trains_with_two_processes_which_stop_together_on_a_signal_to_one_and_resume(cli_base, single_process_run, tmp_path):
    run_dir = tmp_path / "run"
    ddp = cli_base + [f"hydra.run.dir={run_dir}", "trainer=ddp_cpu", "batch.micro_batch_size=8", "logger=csv"]
    stopped = run_module(
        "train",
        ddp
        + [
            "+callbacks.fault._target_=faults.KillAt",
            "+callbacks.fault.step=1",
            "+callbacks.fault.signal_name=SIGTERM",
            "+callbacks.fault.rank=0",
        ],
        cwd=tmp_path,
    )
    logs = "".join(path.read_text() for path in run_dir.glob("*.log"))  # Lightning's notices: the run's log files
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in stopped.stdout + stopped.stderr + logs  # a second process joined
    # Rank 0 took the run folder's lock; rank 1, started by Lightning with the same command, neither
    # locked nor refused the folder (it holds rank 0's run).
    assert json.loads((run_dir / "run.lock").read_text())["pid"] not in (None, os.getpid())
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # no rank left waiting: both stopped, rank 0 exits 128 + 15
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2  # the step in progress when SIGTERM came was finished
{%- if cookiecutter.tasks != "causal_lm" %}
    # An odd test split: two ranks must still test every row once, as one process does.
    odd_test = write_csv(tmp_path / "test41.csv", toy_rows(41, seed=7))
    ok(run_module("train", ddp + ["ckpt_path=last", WITHOUT_FAULT, "test_after_fit=true", f"data.splits.test={odd_test}"], cwd=tmp_path))
    trained = json.loads((run_dir / "metrics.json").read_text())
    evaluated = tmp_path / "eval"
    eval_args = [f"ckpt_path={trained['best_checkpoint']}", f"data.splits.test={odd_test}", f"hydra.run.dir={evaluated}"]
    ok(run_module("eval", [*cli_base, *eval_args]))
    one_process = json.loads((evaluated / "metrics.json").read_text())
    assert trained["rows"]["test"] == one_process["rows"]["test"] == 41
    assert trained["test/acc"] * 41 == pytest.approx(round(trained["test/acc"] * 41))  # a count of right rows out of 41
    assert trained["test/acc"] == pytest.approx(one_process["test/acc"]) and trained["test/loss"] == pytest.approx(one_process["test/loss"])
{%- else %}
    ok(run_module("train", ddp + ["ckpt_path=last", WITHOUT_FAULT], cwd=tmp_path))
{%- endif %}
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    reference = torch.load(single_process_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    # Each process trained on its share of the epoch at the same global batch (twice the steps if
    # each had gone through all the rows), and the resume started at the right row of the epoch.
    assert final == reference
    steps = [int(row["step"]) for row in read_metrics(run_dir / "csv") if row.get("train/loss")]
    assert steps == list(range(reference))
    assert not list(tmp_path.glob("logs"))  # the rank-1 process wrote no run folder of its own
