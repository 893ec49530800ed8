"""``train`` as a user runs it, on the tiny BERT: a fast_dev_run from the command line, and a CUDA
out-of-memory error (injected by ``faults.RaiseOOM``) that writes its report, saves and exits 3."""

from __future__ import annotations

import json
import re

import torch

from {{ cookiecutter.package_name }}.core.callbacks.guards import EXIT_OUT_OF_MEMORY

from ..conftest import tiny_overrides
from ..processes import run_train, without_output_dir


def test_cli_fast_dev_run(tokenizer_dir, toy_data, tmp_path):
    result = run_train(tmp_path / "run", ["debug=fdr", *without_output_dir(tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run"))])
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"metrics.json +{re.escape(str(tmp_path / 'run' / 'metrics.json'))}\n", result.stdout)
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_cuda_oom_in_a_step_writes_a_report_saves_and_exits_3(tokenizer_dir, toy_data, tmp_path):
    base = without_output_dir(tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run"))
    run_dir = tmp_path / "run"
    fault = [
        "batch.global_batch_size=16",
        "batch.micro_batch_size=8",
        "+callbacks.fault._target_=faults.RaiseOOM",
        "+callbacks.fault.steps=[2]",
        "callbacks.step_checkpoint.every_n_train_steps=1000",
    ]
    result = run_train(run_dir, base + fault)
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.stderr[-3000:]
    report = json.loads((run_dir / "oom_report.json").read_text())
    assert report["optimizer_step"] == 2 and report["micro_batch_of_step"] == 1 and report["batch_shape"][0] == 8
    assert report["suggested_micro_batch"] == 4 and report["suggested_accumulation"] == 4
    # The error came in the first micro-batch of step 2, before any update: the state is step 2's, saved.
    assert report["checkpoint_step"] == 2
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    text = (run_dir / "oom_report.txt").read_text()
    assert text in result.stderr  # printed too
    assert "CUDA out of memory at optimizer step 2 (epoch 0, batch 4 of the epoch, micro-batch 1 of 2" in text
    assert "fix: batch.micro_batch_size=4 (accumulation 4 keeps the global batch of 16)" in text
