"""Run the entry points the way a user does (``python -m {{ cookiecutter.package_name }}.<entry>`` in
a subprocess) and read what they leave behind.  Shared by the e2e and ddp tiers; ``tests/`` is on
the subprocess's PYTHONPATH so that ``faults.py`` can be loaded by ``_target_`` overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import torch

from {{ cookiecutter.package_name }}.utils.distributed import JOB_ENV
from {{ cookiecutter.package_name }}.utils.metrics_csv import read_metrics

TESTS = Path(__file__).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def subprocess_env() -> dict[str, str]:
    """This environment with ``tests/`` importable, W&B offline and quiet, no multirun job of ours."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    env.pop(JOB_ENV, None)
    return env


def run_module(module: str, args: list[str], cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m {{ cookiecutter.package_name }}.<module> ARGS``; returns the finished process (output captured)."""
    command = [sys.executable, "-m", f"{{ cookiecutter.package_name }}.{module}", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def run_train(run_dir: Path, overrides: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m {{ cookiecutter.package_name }}.train hydra.run.dir=RUN_DIR OVERRIDES``."""
    return run_module("train", [f"hydra.run.dir={run_dir}", *overrides], timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``result``, after checking that it exited 0 (else the output's tail is the failure message)."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def is_png(path: Path) -> bool:
    """A complete PNG that matplotlib reads back, with pixels."""
    return path.read_bytes()[:8] == PNG_MAGIC and matplotlib.image.imread(path).size > 0


def step_losses(run_dir: Path) -> dict[int, float]:
    """``step -> train/loss`` from the run's CSV log (its launches merged); each step must appear once."""
    rows = [row for row in read_metrics(run_dir / "csv") if row.get("train/loss")]
    steps = [int(row["step"]) for row in rows]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {sorted(steps)}"
    return {int(row["step"]): float(row["train/loss"]) for row in rows}


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was saved at (it must load with ``weights_only=True``)."""
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def without_output_dir(overrides: list[str]) -> list[str]:
    """``overrides`` less ``paths.output_dir=...`` (a subprocess gets ``hydra.run.dir`` instead)."""
    return [o for o in overrides if not o.startswith("paths.output_dir")]
