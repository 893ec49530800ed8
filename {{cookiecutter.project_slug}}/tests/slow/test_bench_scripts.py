"""Smoke test of ``bench/throughput.py``: it runs end to end at tiny sizes and prints its last line in the
documented form (``bench/gpu_check.py``'s own tests are tests/test_bench_gpu_check.py).  A benchmark
that nothing runs stops running unnoticed; this catches that, not the figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str, timeout: int = 600) -> list[str]:
    """Run ``bench/<script>``; returns its stdout lines (fails the test with its output if it fails)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout.strip().splitlines()


def test_throughput_bench_times_the_train_path_and_prints_its_ratios():
    lines = run_bench("throughput.py", "--steps", "3", "--repeats", "1")
    number = r"\d+\.\d{3}"
    last = rf"vs_loop={number} vs_hf_trainer={number} overhead_vs_loop={number} overhead_vs_hf_trainer={number} overhead_ceiling={number}"
    assert re.fullmatch(last, lines[-1]), lines[-1]
    assert any(re.match(r"\s+train / hf_trainer: \d+\.\d{3} \(95% CI", line) for line in lines)
    assert any(re.match(r"\s+lightning / loop: \d+\.\d{3} \(95% CI", line) for line in lines)  # the ceiling
