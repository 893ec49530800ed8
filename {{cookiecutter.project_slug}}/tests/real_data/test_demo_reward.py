"""The real reward-model demo, shortened: SmolLM2-135M-Instruct (GGUF from PyPI) with a scalar head and LoRA, trained on
the DPO demo's VADER pairs, then ``predict`` scoring answers it never saw.

The full demo (``experiment=demo_reward_model``) is measured in docs/tasks/preference.md; this runs 16 steps of 4 pairs and
tests on 32 pairs, so that it fits CI.  The ``real_data`` tier (``pytest -m real_data``).
"""

from __future__ import annotations

import json
import subprocess
import sys

SHORT = [
    "trainer.max_steps=16",
    "trainer.val_check_interval=16",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=8",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=4",
]


def test_the_reward_model_prefers_held_out_chosen_answers_and_predict_scores_new_ones(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}", "train", "experiment=demo_reward_model", *SHORT]
    result = subprocess.run(
        [*command, f"hydra.run.dir={run_dir}", f"paths.cache_dir={shared_cache}"], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(
        f"reward demo (short): val/loss {metrics['val/loss_start']:.3f} -> {metrics['val/loss']:.3f}, test/pair_accuracy "
        f"{metrics['test/pair_accuracy']:.3f}, test/margin {metrics['test/margin']:.3f} on 32 test pairs, {metrics['seconds']:.0f} s"
    )
    assert metrics["val/loss"] < metrics["val/loss_start"]
    assert metrics["test/pair_accuracy"] >= 0.75 and metrics["test/margin"] > 0
    answers = [
        {"prompt": "Write a one-sentence review of a comedy movie.", "completion": text}
        for text in ("A warm, funny and wonderful film that I loved.", "A dull, awful mess: the worst film of the year.")
    ]
    source, output = tmp_path / "answers.jsonl", tmp_path / "rewards.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in answers))
    ckpt = metrics["best_checkpoint"]
    predict = [sys.executable, "-m", "{{ cookiecutter.package_name }}", "predict", "experiment=demo_reward_model", f"ckpt_path={ckpt}"]
    result = subprocess.run(
        [*predict, f"input={source}", f"output={output}", f"hydra.run.dir={tmp_path / 'predict'}", f"paths.cache_dir={shared_cache}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    positive, negative = (json.loads(line) for line in output.read_text().splitlines())
    assert positive["completion"] == answers[0]["completion"] and positive["reward"] > negative["reward"]
