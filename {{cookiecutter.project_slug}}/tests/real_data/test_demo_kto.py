"""The real KTO demo, shortened: SmolLM2-135M-Instruct (GGUF from PyPI) KTO-tuned with LoRA on the DPO
demo's VADER pairs unpaired into desirable and undesirable answers.

The full demo (``experiment=demo_kto_sentiment``) is measured in docs/tasks/preference.md; this runs 8
steps of 4 answers and tests on 16 answers, with no samples drawn (the DPO demo's test draws them), so
that it fits CI (about 80 s on 2 CPU cores).  The ``real_data`` tier (``pytest -m real_data``).
"""

from __future__ import annotations

import json
import subprocess
import sys

SHORT = [
    "trainer.max_steps=8",
    "trainer.val_check_interval=8",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=4",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=4",
    "data.sample_prompts=null",
]


def test_kto_separates_desirable_from_undesirable_held_out_answers(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", "experiment=demo_kto_sentiment", *SHORT]
    result = subprocess.run(
        [*command, f"hydra.run.dir={run_dir}", f"paths.cache_dir={shared_cache}"], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(
        f"KTO demo (short): val/loss {metrics['val/loss_start']:.3f} -> {metrics['val/loss']:.3f}, test/reward_margin "
        f"{metrics['test/reward_margin']:.3f}, test/kl {metrics['test/kl']:.4f} on 16 test answers, {metrics['seconds']:.0f} s"
    )
    assert abs(metrics["val/loss_start"] - 0.5) < 1e-3 and metrics["val/kl_start"] < 1e-3  # the starting policy is the reference
    assert metrics["val/loss"] < metrics["val/loss_start"]  # (0.500 -> 0.493 measured: 8 steps of 4 answers)
    assert metrics["test/reward_margin"] > 0 and metrics["test/reward_desirable"] > metrics["test/reward_undesirable"]
    assert "test/positive_share" not in metrics  # (no samples asked for)
