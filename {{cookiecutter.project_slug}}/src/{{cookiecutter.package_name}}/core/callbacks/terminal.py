"""What a run shows on the terminal: one header, one progress bar that fits, one results table (the rest: train.log)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from ..errors import ConfigError
from ..models.contract import TrainedModule

# The first lines of the results table, in this order; every other metric follows alphabetically.
LEADING = ("test/", "val/", "lm_eval/", "train/")


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar showing only ``metrics`` (``loss=0.693``), so it fits an 80-column terminal.  The training bar
    redraws at most every ``refresh_seconds`` (s): a batch count redraws too often for short steps, too seldom for long.

    Args:
        refresh_rate: validation and test bars redraw every that many batches (as Lightning's).

    Raises:
        ConfigError: ``refresh_seconds`` negative or not a number.
    """

    def __init__(
        self, metrics: list[str] | tuple[str, ...] = ("train/loss",), refresh_rate: int = 10, refresh_seconds: float = 0.5
    ) -> None:
        super().__init__(refresh_rate=refresh_rate)
        if isinstance(refresh_seconds, bool) or not isinstance(refresh_seconds, (int, float)) or not refresh_seconds >= 0:
            raise ConfigError(f"callbacks.progress_bar.refresh_seconds={refresh_seconds!r}; fix: a number of seconds >= 0 (0.5)")
        self.shown = list(dict.fromkeys(metrics))
        self.refresh_seconds = float(refresh_seconds)
        self._drawn_at = -math.inf  # time.monotonic() of the training bar's last redraw

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict[str, float]]:
        # Only the shown names, from prog_bar metrics and the module's step row (one host sync each per redraw).
        metrics = dict(trainer.progress_bar_metrics)
        step_metrics = pl_module.step_metrics if isinstance(pl_module, TrainedModule) else {}
        metrics.update({name: float(step_metrics[name]) for name in self.shown if name in step_metrics})
        return {name.split("/", 1)[-1] if name.startswith("train/") else name: metrics[name] for name in self.shown if name in metrics}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        bar, done, now = self.train_progress_bar, batch_idx + 1, time.monotonic()
        if bar is None or bar.disable or not self.is_enabled or (now - self._drawn_at < self.refresh_seconds and done != bar.total):
            return
        self._drawn_at = now
        bar.n = done
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)  # (one draw: the count and the postfix)


class RunHeader(L.Callback):
    """Prints the run's header once the model and data are set up; ``plan``: the memory plan's peak in GiB, or why none."""

    def __init__(self, run_dir: Path, model: str, batch: str, plan: str, auto_precision: bool = False) -> None:
        self.run_dir, self.model, self.batch, self.plan = run_dir, model, batch, plan
        self.auto_precision = auto_precision
        self.printed = False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.print_once(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.print_once(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.print_once(trainer, pl_module)

    def print_once(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.printed or not trainer.is_global_zero:
            return
        self.printed = True
        total = sum(p.numel() for p in pl_module.parameters())
        trained = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        sizes = getattr(trainer.datamodule, "split_sizes", {}) or {}
        data = ", ".join(f"{split} {count:,}" for split, count in sizes.items()) or "not read yet"
        device = str(trainer.strategy.root_device)
        rows = [
            ("run", str(self.run_dir)),
            ("model", f"{self.model}: {count(total)} parameters, {count(trained)} trained"),
            ("data", f"rows: {data}"),
            ("batch", f"{self.batch}; precision {trainer.precision}{' (auto)' if self.auto_precision else ''} on {device}"),
            ("memory", self.plan),
        ]
        print("\n".join(f"{name:<7} {value}" for name, value in rows), flush=True)


def count(n: int) -> str:
    """``n`` parameters as people write them: 135M, 1.24B, 105K."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def results_lines(metrics: Mapping[str, object], lines: list[tuple[str, str]]) -> list[str]:
    """The run's figures, one per line (with ``<name>_start`` beside), then ``lines``; never wrapped, so paths copy whole."""
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    shown = [k for k in numbers if k.startswith(LEADING) and not k.endswith("_start")]
    order = sorted(shown, key=lambda k: (next(i for i, p in enumerate(LEADING) if k.startswith(p)), k))
    rows = [
        (key, figure(numbers[key]) + (f"  (start {figure(numbers[key + '_start'])})" if key + "_start" in numbers else "")) for key in order
    ]
    if "seconds" in numbers:
        rows.append(("seconds", figure(numbers["seconds"])))
    rows += lines
    width = max(len(name) for name, _ in rows) if rows else 0
    return ["results"] + [f"  {name:<{width}}  {value}" for name, value in rows]


def figure(value: object) -> str:
    """A number to 4 significant digits (an integer, NaN or infinity as Python writes it)."""
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def print_results(metrics: Mapping[str, object], lines: list[tuple[str, str]]) -> None:
    """Print :func:`results_lines` to stdout."""
    print("\n".join(results_lines(metrics, lines)), flush=True)
