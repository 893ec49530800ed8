"""The real demo, end to end: all-MiniLM-L6-v2 fine-tuned on VADER movie reviews, from PyPI.

Slow (minutes on 2 CPU cores) and needs the package index; the ``real_data``
tier (tests/real_data/): plain ``pytest`` leaves it out, ``pytest -m real_data`` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_fetches_model_and_data_and_reaches_80_percent(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"  # a fresh cache: the fetch is exercised too
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "{{ cookiecutter.package_name }}.train",
            "experiment=demo_classification",
            f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={cache}",
            "callbacks.progress_bar.refresh_rate=50",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"demo: test/acc={metrics['test/acc']:.4f} in {metrics['seconds']:.0f} s (fit + test)")
    assert metrics["test/acc"] >= 0.80
    assert metrics["rows"] == {"train": 8454, "validation": 1056, "test": 1058}
    assert (cache / "models" / "all-MiniLM-L6-v2" / "model.safetensors").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "the W&B offline run was not written"
