"""Smoke test of ``bench/compress.py``: it runs end to end on a 2-layer BERT and prints its last line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from {{ cookiecutter.package_name }}.train import train

from ..conftest import compose_config, tiny_overrides

BENCH = Path(__file__).resolve().parents[2] / "bench" / "compress.py"
LAST_LINE = re.compile(r"^int8_acc_delta=[-+]\d+\.\d{4} int8_size_ratio=\d+\.\d{3} int8_latency_ratio=\d+\.\d{3}$")


def test_bench_compress_prints_the_table_and_its_last_line(tokenizer_dir, toy_data, tmp_path):
    overrides = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "train")
    metrics = train(compose_config("train", [*overrides, "trainer.max_epochs=1"]))
    quick = "variants=[fp32,int8_dynamic,onnx_fp32,onnx_int8] latency.warmup=1 latency.repeats=3 latency.sequence_length=16"
    # (run_dir-free overrides: the bench sets hydra.run.dir and output_dir itself)
    passed = " ".join(o for o in overrides if not o.startswith("hydra.run.dir")) + " " + quick
    result = subprocess.run(
        [sys.executable, str(BENCH), f"--classifier-ckpt={metrics['best_checkpoint']}", "--skip-lm", f"--out={tmp_path / 'bench'}", f"--overrides={passed}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    assert any(line.startswith("| `onnx_int8` |") for line in lines)
