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

from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics
from {{ cookiecutter.package_name }}.core.run.distributed import JOB_ENV

TESTS = Path(__file__).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# What a resume after an injected fault adds: the fault callback (or checkpoint plugin) is gone from
# its config, a change a resume makes only when asked (docs/reliability.md, "Run identity").
WITHOUT_FAULT = "resume.allow_changed=[callbacks.fault.*,trainer.plugins]"


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


def run_in_terminal(module: str, args: list[str], columns: int = 120, rows: int = 40, timeout: int = 300) -> tuple[int, str]:
    """``python -m {{ cookiecutter.package_name }}.<module> ARGS`` on a real pseudo-terminal of
    ``columns`` x ``rows`` (what progress bars and rich see on a user's screen); returns the exit
    code and everything written to it (stdout and stderr, with the terminal's ``\\r\\n``)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {key: value for key, value in subprocess_env().items() if key not in ("WANDB_SILENT", "COLUMNS", "LINES")}
    command = [sys.executable, "-m", f"{{ cookiecutter.package_name }}.{module}", *args]
    process = subprocess.Popen(
        command, stdin=follower, stdout=follower, stderr=follower, env={**env, "TERM": "xterm-256color"}, close_fds=True
    )
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the process closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    else:
        process.kill()
    os.close(leader)
    return process.wait(timeout=30), b"".join(chunks).decode("utf-8", errors="replace")


def screen_lines(output: str, columns: int = 120) -> list[str]:
    """The lines ``output`` leaves on a terminal ``columns`` wide (a minimal emulator): text
    overwrites from the cursor and wraps at the edge, ``\\r`` returns to the line's start,
    ``\\n`` goes down one line, ``ESC[nA``/``ESC[nB`` move up/down (tqdm's bars below the main
    one), ``ESC[K``/``ESC[2K`` clear the line (a finished bar erasing itself); other escapes
    (colours) change nothing.  Trailing blank lines are dropped."""
    import re

    lines: list[list[str]] = [[]]
    row = col = 0
    escape = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
    index = 0
    while index < len(output):
        char = output[index]
        if char == "\x1b":
            match = escape.match(output, index)
            if match:
                argument, command = match.groups()
                count = int(argument) if argument.isdigit() else 1
                while len(lines) <= row:
                    lines.append([])
                if command == "A":
                    row = max(0, row - count)
                elif command == "B":
                    row += count
                elif command == "K":
                    lines[row] = [] if argument == "2" else lines[row][:col]
                elif command == "G":
                    col = count - 1
                index = match.end()
                continue
        elif char == "\r":
            col = 0
        elif char == "\n":
            row += 1
        elif char == "\b":
            col = max(0, col - 1)
        elif char >= " ":
            if col >= columns:
                row, col = row + 1, 0
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1
        index += 1
    text = ["".join(line).rstrip() for line in lines]
    while text and not text[-1]:
        text.pop()
    return text


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
