"""``quantize`` as a user runs it: a trained tiny checkpoint -> variant folders, the report and its
table on stdout, ``plot`` of the report; a second run into the same folder stops with its message alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from ..conftest import TASK
from ..processes import is_png, ok, run_module, subprocess_env

FAST = ["latency.batch_size=4", "latency.sequence_length=16", "latency.warmup=1", "latency.repeats=3"]
VARIANTS = "variants=[fp32,int8_dynamic,onnx_int8]" if TASK == "classification" else "variants=[fp32,int8_dynamic,nf4]"


def test_quantize_writes_the_variants_and_the_report_then_refuses_to_overwrite(single_process_run, cli_base, tmp_path):
    ckpt = single_process_run / "checkpoints" / "last.ckpt"
    args = [*cli_base, *FAST, VARIANTS, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'q'}"]
    result = ok(run_module("quantize", args, cwd=tmp_path))
    out = tmp_path / "q" / "compressed"
    report = json.loads((out / "compress_report.json").read_text())
    names = [v["name"] for v in report["variants"]]
    assert names == VARIANTS.removeprefix("variants=[").removesuffix("]").split(",")
    assert all((out / name).is_dir() for name in names)
    assert "| `fp32` | pytorch-eager-cpu |" in result.stdout and f"Compressed: {out}" in result.stdout
    assert (out / "compress_report.md").read_text().startswith("# Compression report")

    ok(run_module("plot", [str(out)]))
    assert is_png(out / "plots" / "compression.png")

    again = run_module("quantize", [*args, f"output_dir={out}"], cwd=tmp_path)
    assert again.returncode == 1
    assert f"output_dir='{out}' exists; fix: output_dir=<a new path>, or overwrite=true" in again.stderr
    assert "Traceback" not in again.stderr


def test_a_killed_quantize_leaves_no_partial_folder(single_process_run, cli_base, tmp_path):
    ckpt = single_process_run / "checkpoints" / "last.ckpt"
    args = [*cli_base, *FAST, VARIANTS, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'q'}"]
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.quantize", *args]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + 120
    while not list((tmp_path / "q").glob(".quantize-staging-*/*/fp32/*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the first variant is being written
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Stopped by SIGTERM" in stderr
    left = [path.name for path in (tmp_path / "q").iterdir() if path.name.startswith(".quantize-staging") or path.name == "compressed"]
    assert left == []
