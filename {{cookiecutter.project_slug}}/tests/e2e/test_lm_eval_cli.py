"""lm-evaluation-harness as its users run it: ``eval model_dir=<export> benchmarks...`` gives exactly the scores of the
``lm_eval`` command line on that folder, and a run with ``callbacks=benchmarks`` killed by SIGKILL and resumed keeps one
``lm_eval/...`` row a step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.export import export
from {{ cookiecutter.package_name }}.tasks.causal_lm.benchmarks import LOCAL_TASKS

from ..conftest import compose_config
from ..processes import read_metrics, without_output_dir
from ..test_benchmarks import KEY, TASK, lora_overrides
from .test_resume import kill_and_resume


def test_eval_of_an_export_equals_the_lm_eval_command_line(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path):
    from {{ cookiecutter.package_name }}.train import train

    overrides = lora_overrides(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path / "run") + ["trainer.max_steps=2"]
    train(compose_config("train", overrides))
    out = tmp_path / "exported"
    export(
        compose_config(
            "export",
            [f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", f"output_dir={out}", f"paths.output_dir={tmp_path / 'x'}"],
        )
    )
    ours = evaluate(
        compose_config(
            "eval",
            [  # as the acceptance runs it: no experiment= (an exported folder is a causal LM whatever the default task)
                f"model_dir={out}",
                f"benchmarks.tasks=[{TASK}]",
                f"benchmarks.include_path={LOCAL_TASKS}",
                "benchmarks.batch_size=8",
                "benchmarks.limit=40",
                f"paths.output_dir={tmp_path / 'e'}",
            ],
        )
    )
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={out}",
        "--device",
        "cpu",
        "--batch_size",
        "8",
        "--include_path",
        str(LOCAL_TASKS),
        "--tasks",
        TASK,
        "--limit",
        "40",
        "--output_path",
        str(tmp_path / "cli"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"][TASK]
    for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert ours[f"lm_eval/{TASK}/{metric}"] == theirs[f"{metric},none"], metric  # exactly: the same requests, the same model


def test_a_killed_run_with_benchmarks_resumes_with_one_row_a_step(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path):
    base = without_output_dir(lora_overrides(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path / "unused")) + [
        "trainer.max_steps=6",
        "callbacks.step_checkpoint.every_n_train_steps=1",
        "callbacks=benchmarks",
        f"benchmarks.tasks=[{TASK}]",
        "callbacks.benchmarks.limit=4",
        "callbacks.benchmarks.max_length=128",
        "logger=csv",
    ]
    fault = ["+callbacks.fault._target_=faults.KillAt", "+callbacks.fault.step=3", "+callbacks.fault.micro_batch=0"]
    run_dir, _ = kill_and_resume(base, tmp_path, fault, expect_code=-signal.SIGKILL)
    rows = read_metrics(run_dir / "csv")
    steps = [row["step"] for row in rows if row.get(KEY, "") != ""]
    assert len(steps) == len(set(steps)) >= 3, steps  # the start and the validations at steps 2, 4 and 6, none twice
    assert steps == [row["step"] for row in rows if row.get("val/loss", "") != ""]
    assert json.loads((run_dir / "metrics.json").read_text())[f"{KEY}_start"] == pytest.approx(float(rows[0][KEY]))
