"""Stopping a run on purpose, with a checkpoint to resume from: signals, CUDA out-of-memory, non-finite losses.

Each guard raises :class:`RunStopped` (``train`` exits with its ``exit_code``).  A guard's checkpoint is taken at an
optimizer-step boundary, where step checkpoints are, so a resume from it is as exact as from any other.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from ..checkpoints.io import flush_checkpoints
from ..errors import EXIT_NON_FINITE_LOSS, ConfigError, RunStopped
from ..models.contract import TrainedModule

log = logging.getLogger(__name__)

EXIT_OUT_OF_MEMORY = 3


class _StepBoundary(L.Callback):
    """Knows whether the batch that just ended also ended an optimizer step, and saves ``last.ckpt`` there."""

    def __init__(self, checkpoint_dir: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self._stepped = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        self._stepped = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True

    def save_last(self, trainer: L.Trainer) -> Path:
        path = self.checkpoint_dir / "last.ckpt"
        trainer.save_checkpoint(path)
        flush_checkpoints(trainer)  # the file is complete before the run names it and stops
        return path

    def log_step_and_save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path:
        """Send the step's row to the loggers (the stop skips the module's own delivery), then save: the checkpoint's
        step is also in the logs."""
        if isinstance(pl_module, TrainedModule):
            step, metrics = pl_module.step_row()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()
        return self.save_last(trainer)


class StopOnSignal(_StepBoundary):
    """On SIGTERM, SIGINT or SLURM's warning signal, finish the optimizer step on all ranks, save ``last.ckpt`` and stop
    with exit code ``128 + signal``; a second Ctrl-C stops at once.  A previous handler (Lightning's SLURM requeue on
    ``SIGUSR1``) still runs first: ``#SBATCH --signal=SIGUSR1@90``, then resume with ``ckpt_path=last``.

    Raises:
        ConfigError: an unknown signal name (at construction, before any weights load).
    """

    def __init__(self, checkpoint_dir: str, signals: list[str] = ("SIGTERM", "SIGINT", "SIGUSR1")) -> None:
        super().__init__(checkpoint_dir)
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ConfigError(
                f"callbacks.stop_on_signal.signals has unknown signal names {unknown}; fix: names such as SIGTERM, SIGINT, SIGUSR1"
            )
        self.signals = [getattr(signal, name) for name in signals]
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: do not wait for the step to finish
        self.received = signal.Signals(signum)
        log.warning("%s received: stopping after this optimizer step, with a checkpoint", self.received.name)
        previous = self._previous.get(signum)
        # Lightning's own SIGTERM/SIGINT handling would only stop at the epoch's end; SLURM's requeue on SIGUSR1 is kept.
        if callable(previous) and signum not in (signal.SIGTERM, signal.SIGINT):
            previous(signum, frame)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        if self._stepped and self._agreed_signal(trainer):
            self._stop(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._agreed_signal(trainer):
            self._stop(trainer, pl_module, after_step=False)  # validation runs between optimizer steps: a boundary too

    def _agreed_signal(self, trainer: L.Trainer) -> bool:
        """Whether any process received a signal: one all-reduce per step, since a rank stopping alone would leave the
        others waiting in a collective."""
        if trainer.world_size == 1:
            return self.received is not None
        number = torch.tensor(float(self.received or 0), device=trainer.strategy.root_device)
        number = int(trainer.strategy.reduce(number, reduce_op="max"))
        if number and self.received is None:
            self.received = signal.Signals(number)  # received by another rank: stop for the same reason
        return bool(number)

    def _stop(self, trainer: L.Trainer, pl_module: L.LightningModule, after_step: bool = True) -> None:
        path = self.log_step_and_save(trainer, pl_module) if after_step else self.save_last(trainer)
        name, self.received = self.received.name, None
        raise RunStopped(
            f"Stopped by {name} after optimizer step {trainer.global_step}; checkpoint: {path}\n"
            "resume: the same command with ckpt_path=last (and the same hydra.run.dir)",
            128 + signal.Signals[name],
        )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # Lightning calls ``teardown`` only when fit ends normally: restore on every way out.
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()


@contextmanager
def signals_stop_the_run(stopper: StopOnSignal | None) -> Iterator[None]:
    """Outside the fit, SIGTERM/SIGINT stop ``train`` at once with exit code ``128 + signal`` (Lightning would exit 0 or 1:
    a scheduler would count the run as done or crashed).  Nothing without ``stopper`` or off the main thread.

    Raises:
        RunStopped: on a signal, with the checkpoint folder in its message.
    """
    signals = [signum for signum in (stopper.signals if stopper else []) if signum in (signal.SIGTERM, signal.SIGINT)]
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        raise RunStopped(
            f"Stopped by {name} outside the optimizer steps (a validation, the test or start-up); metrics.json is not written; "
            f"checkpoints so far: {stopper.checkpoint_dir} (last.ckpt: the newest weights)\n"
            "resume an unfinished fit: the same command with ckpt_path=last; test a finished one: eval with ckpt_path=<a checkpoint>",
            128 + signum,
        )

    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class OutOfMemoryGuard(_StepBoundary):
    """Turn a CUDA OOM in a training step into :attr:`report` and a clean stop, saving ``last.ckpt`` when safe: in a step's
    first micro-batch, outside the update, the weights are exactly those after the previous step."""

    def __init__(self, checkpoint_dir: str) -> None:
        super().__init__(checkpoint_dir)
        self.report: dict | None = None
        self._batch: dict = {}
        self._saved_step = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Mapping, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        shape = tuple(batch["input_ids"].shape) if isinstance(batch, Mapping) and "input_ids" in batch else ()
        self._batch = {"epoch": trainer.current_epoch, "batch_idx": batch_idx, "shape": shape}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved_step = checkpoint.get("global_step", trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, torch.OutOfMemoryError) or trainer.state.fn != TrainerFn.FITTING:
            return
        device = trainer.strategy.root_device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        pl_module.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        micro_batch_of_step = self._batch.get("batch_idx", 0) % trainer.accumulate_grad_batches
        safe = not self._stepped and micro_batch_of_step == 0
        if safe and trainer.global_step > self._saved_step:
            self.save_last(trainer)  # on_save_checkpoint above sets _saved_step
        last = self.checkpoint_dir / "last.ckpt"
        checkpoint = str(last) if last.is_file() and self._saved_step >= 0 else None
        self.report = {
            "optimizer_step": trainer.global_step,
            "epoch": self._batch.get("epoch"),
            "batch_idx": self._batch.get("batch_idx"),
            "micro_batch_of_step": micro_batch_of_step + 1,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "batch_shape": list(self._batch.get("shape", ())),
            "in_optimizer_update": self._stepped,
            "peak_allocated_gib": None if peak is None else round(peak / 2**30, 2),
            "device_total_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2) if device.type == "cuda" else None,
            "checkpoint": checkpoint,
            "checkpoint_step": self._saved_step if checkpoint else None,
            "error": str(exception).splitlines()[0][:300],
        }


class NonFiniteLoss(_StepBoundary):
    """Skip the update of a step whose loss is NaN/inf, and (``action: stop``) stop after ``patience`` in a row, with
    ``last.ckpt`` holding the last good weights.  A skip sets the gradients to ``None`` (AdamW and bitsandbytes then leave
    parameters and state untouched) and bumps ``skipped_steps``, so the LR schedule waits.  One host sync per step.

    Raises:
        ConfigError: an unknown ``action`` or ``patience < 1`` (at construction).
    """

    def __init__(self, checkpoint_dir: str, action: str = "stop", patience: int = 3) -> None:
        super().__init__(checkpoint_dir)
        if action not in ("stop", "skip"):
            raise ConfigError(f"callbacks.non_finite_loss.action={action!r}; fix: stop or skip")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"callbacks.non_finite_loss.patience={patience!r}; fix: an integer >= 1")
        self.action, self.patience = action, patience
        self.consecutive = 0
        self._window: list[int] = []
        self._stop_message: str | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        if self._stepped or not self._window:
            self._window = []
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._window.append(batch_idx)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        loss = pl_module.step_loss()
        # All ranks skip together: averaged gradients are non-finite everywhere if the loss is on one rank.
        if not trainer.strategy.reduce_boolean_decision(not bool(torch.isfinite(loss)), all=False):
            self.consecutive = 0
            return
        optimizer.zero_grad(set_to_none=True)  # no update from this step
        pl_module.skipped_steps += 1
        self.consecutive += 1
        where = (
            f"optimizer step {trainer.global_step} (epoch {trainer.current_epoch}, micro-batches "
            f"{self._window[0]}-{self._window[-1]} of the epoch)"
        )
        rank_zero_warn(
            f"train/loss is {float(loss)} at {where}: update skipped ({self.consecutive} in a row, {pl_module.skipped_steps} in this run)"
        )
        if self.action == "stop" and self.consecutive >= self.patience:
            self._stop_message = (
                f"Stopped: train/loss was non-finite for {self.consecutive} optimizer steps in a row, the last at {where}. "
                "Their updates were skipped, so the weights are the last good ones; fix: a lower optimizer.lr, "
                "precision=bf16-mixed instead of 16-mixed, or check those batches; "
                "callbacks.non_finite_loss.action=skip to go on regardless"
            )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        if self._stop_message is not None and self._stepped:
            path = self.log_step_and_save(trainer, pl_module)
            message, self._stop_message = self._stop_message, None
            raise RunStopped(f"{message}\ncheckpoint (last good weights): {path}", EXIT_NON_FINITE_LOSS)
