"""Smoke tests of ``bench/compress.py``: it runs end to end on tiny models and prints its last line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ..processes import without_output_dir

BENCH = Path(__file__).resolve().parents[2] / "bench" / "compress.py"
QUICK = "latency.warmup=1 latency.repeats=3 latency.sequence_length=16"


def run_bench(*args: str) -> list[str]:
    """Run the bench; returns its stdout lines (fails the test with its stderr if it fails)."""
    result = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def test_the_classifier_bench_prints_the_table_and_its_last_line(tokenizer_dir, toy_data, tmp_path):
    from my_4090_project.train import train

    from ..conftest import compose_config, tiny_overrides

    overrides = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "train")
    metrics = train(compose_config("train", [*overrides, "trainer.max_epochs=1"]))
    passed = " ".join(
        [*without_output_dir(overrides), "variants=[fp32,int8_dynamic,onnx_fp32,onnx_int8]", QUICK]
    )  # (the bench names each run folder)
    checkpoint = metrics["best_checkpoint"]
    lines = run_bench(f"--classifier-ckpt={checkpoint}", "--skip-lm", f"--out={tmp_path / 'bench'}", f"--overrides={passed}")
    assert re.fullmatch(r"int8_acc_delta=[-+]\d+\.\d{4} int8_size_ratio=\d+\.\d{3} int8_latency_ratio=\d+\.\d{3}", lines[-1]), lines[-1]
    assert any(line.startswith("| `onnx_int8` |") for line in lines)


def test_the_causal_lm_bench_prints_the_table_and_its_last_line(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path):
    from ..conftest import lm_overrides

    overrides = lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "run")
    passed = " ".join([*without_output_dir(overrides), "variants=[fp32,int8_weight_only]", QUICK])
    lines = run_bench(f"--lm-dir={pretrained_lm_dir}", "--skip-classifier", f"--out={tmp_path / 'bench'}", f"--overrides={passed}")
    assert re.fullmatch(r"int8_ppl_ratio=\d+\.\d{4} int8_size_ratio=\d+\.\d{3} int8_latency_ratio=\d+\.\d{3}", lines[-1]), lines[-1]
    assert any(line.startswith("| `int8_weight_only` |") for line in lines)
