"""``bench/gpu_check.py`` without a GPU: its table arithmetic, its results file, and its one-line
refusal on a machine without CUDA (the GPU cases themselves run only where a GPU is lent)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


def test_error_is_signed_and_relative_to_the_measurement():
    assert gpu_check.error_pct(11.0, 10.0) == pytest.approx(10.0)
    assert gpu_check.error_pct(9.0, 10.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="measured=0"):
        gpu_check.error_pct(1.0, 0.0)


def test_mfu_is_achieved_flops_over_the_peak():
    # 10,000 tokens/s x 6 x 124M FLOPs/token = 7.44 TFLOP/s of a 989.4 TFLOP/s peak.
    assert gpu_check.mfu(10_000, 6 * 124e6, 989.4) == pytest.approx(7.44e12 / 989.4e12)
    assert gpu_check.mfu(10_000, 6 * 124e6, None) is None


def test_a_row_carries_its_ratio_and_a_not_run_row_says_why():
    row = gpu_check.row("throughput", "shape", 90.0, "tokens/s", 100.0, note="n")
    assert row["ratio"] == pytest.approx(0.9) and row["status"] == "ok" and row["note"] == "n"
    assert gpu_check.row("host_syncs", "x", 2.0, "syncs/step")["ratio"] is None
    assert gpu_check.not_run("flash_varlen", "flash_attn missing")["status"] == "not run: flash_attn missing"


def test_the_markdown_table_has_one_line_per_row_with_rounded_numbers():
    rows = [
        gpu_check.row("planner", "lm_llama32_1b_full", 12.3456, "GiB predicted", 12.0),
        gpu_check.row("throughput", "gpt2", 123456.7, "tokens/s", 130000.0),
        gpu_check.not_run("int4_nf4", "bitsandbytes missing"),
    ]
    lines = gpu_check.markdown_table(rows).strip().splitlines()
    assert lines[0] == "| case | item | value | unit | reference | ratio | status | note |" and len(lines) == 2 + len(rows)
    assert lines[2] == "| planner | lm_llama32_1b_full | 12.3 | GiB predicted | 12 | 1.03 | ok |  |"
    assert "| 123,457 |" in lines[3] and "| 0.95 |" in lines[3]
    assert lines[4].endswith("| not run: bitsandbytes missing |  |")


def test_results_are_appended_to_the_json_list(tmp_path):
    path = tmp_path / "gpu_check.json"
    gpu_check.append_results(path, [{"case": "a"}])
    gpu_check.append_results(path, [{"case": "b"}, {"case": "c"}])
    assert [r["case"] for r in json.loads(path.read_text())] == ["a", "b", "c"]
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_a_case_whose_package_is_missing_is_reported_not_run(tmp_path, monkeypatch):
    def needs_flash_attn(name):
        import flash_attn_not_installed_here  # noqa: F401

    monkeypatch.setitem(gpu_check.CASE_FUNCTIONS, "flash_varlen", needs_flash_attn)
    gpu_check.run_case_here("flash_varlen", tmp_path / "rows.json")
    [row] = json.loads((tmp_path / "rows.json").read_text())
    assert row["status"] == "not run: flash_attn_not_installed_here missing"


def test_it_refuses_to_start_without_a_gpu_in_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), f"--out={tmp_path / 'out.json'}"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [gpu_check.CUDA_ONLY_LINE] and result.stdout == ""
    assert not (tmp_path / "out.json").exists()
