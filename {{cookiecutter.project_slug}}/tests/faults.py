"""Fault injection for the reliability tests, loaded into real training runs by ``_target_``
overrides with this folder on ``PYTHONPATH`` (nothing here ships in the package):

    PYTHONPATH=tests python -m {{ cookiecutter.package_name }}.train ... +callbacks.fault._target_=faults.KillAt +callbacks.fault.step=3
"""

from __future__ import annotations

import os
import signal
import time

import lightning as L
import torch

from {{ cookiecutter.package_name }}.core.checkpoints.io import AtomicCheckpointIO


def _micro_batch_of_step(trainer: L.Trainer, batch_idx: int) -> int:
    return batch_idx % trainer.accumulate_grad_batches


class KillAt(L.Callback):
    """SIGKILL this process just before micro-batch ``micro_batch`` (0-based) of optimizer step
    ``step`` (0-based): ``micro_batch: 0`` is a step boundary, ``>= 1`` is between the micro-batches
    of one step.  ``signal_name`` sends another signal instead (e.g. ``SIGTERM``); ``rank``: only
    in that process of a DDP run."""

    def __init__(self, step: int, micro_batch: int = 0, signal_name: str = "SIGKILL", rank: int | None = None) -> None:
        self.step, self.micro_batch, self.signum = step, micro_batch, getattr(signal, signal_name)
        self.rank = rank
        self.sent = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if not self.sent and trainer.global_step == self.step and _micro_batch_of_step(trainer, batch_idx) == self.micro_batch:
            self.sent = True
            os.kill(os.getpid(), self.signum)


class WaitForFile(L.Callback):
    """Hold the run at the start of its first training batch until ``path`` exists (at most
    ``timeout_s``): a test can act on a run that is known to be in progress."""

    def __init__(self, path: str, timeout_s: float = 240.0) -> None:
        self.path, self.timeout_s = path, timeout_s

    def on_train_start(self, trainer, pl_module) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.05)


class SignalWhileTesting(L.Callback):
    """Send ``signal_name`` to this process once, at the first test batch (the test after the fit)."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        self.signum, self.sent = getattr(signal, signal_name), False

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


class KillDuringSave(AtomicCheckpointIO):
    """Checkpoint IO that SIGKILLs the process half-way through writing its ``save``-th checkpoint
    (1-based), after the first half of the bytes is on disk.  ``background`` as the shipped IO:
    the kill then comes from the writer thread, in the middle of a background write (it says
    which thread on stderr first)."""

    def __init__(self, save: int, background: bool = True) -> None:
        super().__init__(background=background)
        self.save, self.saves = save, 0

    def write(self, checkpoint, file) -> None:
        self.saves += 1
        if self.saves < self.save:
            return super().write(checkpoint, file)
        import io
        import sys
        import threading

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        file.write(data[: len(data) // 2])
        file.flush()
        print(f"faults.KillDuringSave: SIGKILL in thread {threading.current_thread().name}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class KillAfterSave(AtomicCheckpointIO):
    """Checkpoint IO that SIGKILLs the process right after its ``save``-th checkpoint is complete
    and in place (its background write waited for): before Lightning would have logged that step."""

    def __init__(self, save: int, background: bool = True) -> None:
        super().__init__(background=background)
        self.save, self.saves = save, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saves += 1
        if self.saves == self.save:
            self.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class _OnSteps(L.Callback):
    """Base: act on the model's forward pass during the given optimizer steps (of the multirun
    job numbered ``job`` only, when given: one failing trial of a sweep; read from the job's
    folder name, which the DDP ranks of a job share)."""

    def __init__(self, steps: list[int], job: int | None = None) -> None:
        self.steps = set(steps)
        self.job = job
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.job is not None:
            from hydra.core.hydra_config import HydraConfig

            if os.path.basename(HydraConfig.get().runtime.output_dir) != str(self.job):
                return
        if trainer.global_step in self.steps:
            self._handle = self.hook(pl_module.model)

    def hook(self, model: torch.nn.Module):
        raise NotImplementedError


class RaiseOOM(_OnSteps):
    """Raise ``torch.OutOfMemoryError`` from inside the forward pass of the given steps: the
    CPU stand-in for a CUDA OOM in a training step."""

    def hook(self, model):
        def raise_oom(module, args, kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated by tests/faults.py)")

        return model.register_forward_pre_hook(raise_oom, with_kwargs=True)


class NaNLogits(_OnSteps):
    """Make the logits NaN in the forward passes of the given steps (a diverged step)."""

    def hook(self, model):
        def poison(module, args, output):
            output.logits = output.logits * float("nan")
            return output

        return model.register_forward_hook(poison)
