"""The real instruction-tuning demo, shortened: SmolLM2-135M-Instruct (GGUF from PyPI)
LoRA-tuned to answer `positive`/`negative` for the VADER movie snippets (from PyPI).

The full demo (``experiment=demo_sft_sentiment``: 40 steps, the whole test split) is measured in
docs/tasks/causal_lm.md; this runs fewer steps, validates and tests on a part of the splits, and scores the
greedy answers to the first 100 test prompts.  Slow (minutes on 2 CPU cores) and needs the
package index: the ``real_data`` tier (``pytest -m real_data``).
"""

from __future__ import annotations

import json
import subprocess
import sys

SHORT = [
    "trainer.max_steps=24",
    "trainer.val_check_interval=24",
    "trainer.limit_val_batches=8",
    "trainer.limit_test_batches=8",
    "data.answer_rows=100",
]


def test_instruction_tuning_teaches_the_answer(tmp_path, shared_cache):
    run_dir, cache = tmp_path / "run", shared_cache
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", "experiment=demo_sft_sentiment", *SHORT]
    result = subprocess.run([*command, f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(
        f"SFT demo (short): test/exact_match {metrics['test/exact_match_start']:.3f} -> {metrics['test/exact_match']:.3f} "
        f"on 100 test prompts, val/ppl {metrics['val/ppl_start']:.2f} -> {metrics['val/ppl']:.2f}, {metrics['seconds']:.0f} s"
    )
    assert metrics["test/exact_match"] >= 0.70
    assert metrics["test/exact_match"] >= metrics["test/exact_match_start"] + 0.30
    predictions = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 100 and {p["reference"] for p in predictions} == {"positive", "negative"}
