"""Checkpoint writes off the training path: a checkpoint is staged (copied) to host memory on the
training thread, then serialised and written by one background thread, while training goes on.

Used by :class:`.io.AtomicCheckpointIO` (``background=True``, the shipped
``trainer.plugins``).  Why not Lightning's ``AsyncCheckpointIO``: it clones every tensor on its
device (a full fine-tune's weights and optimizer state a second time on the GPU: an
out-of-memory), and it needs a private base class to wrap another IO.  ``torch.distributed.checkpoint``
writes folders, which nothing else of the project reads.

Staging:

- Every tensor of the checkpoint is copied into a host buffer (pinned when CUDA is available, so
  the GPU-to-host copy is a DMA; PyTorch's caching host allocator rounds each pinned block up to
  a power of two, as the planner counts it: ``plan.json`` ``host_staging``).  A tensor that is
  already on the host is copied too: training changes it in place while the writer reads.
- The buffers are kept and reused by the next save of the same shapes (one checkpoint's worth of
  host memory for the whole run, not a new allocation per save).
- Tensors that share a storage and a place in it (tied embeddings) are staged once, so the file
  keeps them tied, as ``torch.save`` of the live checkpoint would.
- Other values are deep-copied (loop counters, RNG states, callback states).

The writer runs one job at a time, in the order queued: two writes never interleave, and a file
is replaced only by the whole new one (the IO's atomic write).  A job's error is kept and raised
on the training thread at the next save, :meth:`BackgroundWriter.flush` or the end of the fit.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

THREAD_NAME = "checkpoint-writer"

# Host memory left free when deciding whether a checkpoint can be staged (the OS, the data loader
# workers, the page cache the write itself goes through).
HOST_RESERVE = 2 * 2**30


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same data: their storage, place in it, shape, strides and dtype."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def unique_tensors(checkpoint: object) -> dict[tuple, torch.Tensor]:
    """The checkpoint's tensors (nested dicts, lists and tuples walked), one per :func:`tensor_key`."""
    found, stack = {}, [checkpoint]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.setdefault(tensor_key(node), node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return found


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (numel x element size)."""
    return tensor.numel() * tensor.element_size()


def host_available() -> int | None:
    """Bytes of host memory available now (psutil's ``available``; else Linux's ``MemAvailable``;
    ``None`` when neither can be read)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Stager:
    """Copies checkpoints into reusable host buffers (see the module docstring).

    Args:
        pin_memory: allocate pinned (page-locked) buffers; ``None``: when CUDA is available.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._spare: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def _shape_key(tensor: torch.Tensor) -> tuple:
        return (tuple(tensor.shape), tensor.dtype)

    def bytes_to_allocate(self, checkpoint: object) -> int:
        """Bytes of host buffers staging ``checkpoint`` would allocate (those the spare buffers do not cover)."""
        spare = {key: len(buffers) for key, buffers in self._spare.items()}
        total = 0
        for tensor in unique_tensors(checkpoint).values():
            key = self._shape_key(tensor)
            if spare.get(key):
                spare[key] -= 1
            else:
                total += tensor_bytes(tensor)
        return total

    def stage(self, checkpoint: dict) -> dict:
        """A copy of ``checkpoint`` whose tensors are host buffers holding the same values (same
        shapes and dtypes, contiguous); returns once every copy is complete."""
        staged: dict[tuple, torch.Tensor] = {}
        from_cuda = False

        def copy_of(node: Any) -> Any:
            nonlocal from_cuda
            if isinstance(node, torch.Tensor):
                key = tensor_key(node)
                if key not in staged:
                    buffers = self._spare.get(self._shape_key(node))
                    buffer = (
                        buffers.pop() if buffers else torch.empty(node.shape, dtype=node.dtype, device="cpu", pin_memory=self.pin_memory)
                    )
                    from_cuda |= node.is_cuda
                    buffer.copy_(node.detach(), non_blocking=node.is_cuda and self.pin_memory)
                    staged[key] = buffer
                return staged[key]
            if isinstance(node, dict):
                out = copy.copy(node)  # (the same mapping type: OrderedDict, Lightning's AttributeDict)
                for name, value in node.items():
                    out[name] = copy_of(value)
                return out
            if isinstance(node, list):
                return [copy_of(value) for value in node]
            if isinstance(node, tuple):
                items = [copy_of(value) for value in node]
                return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
            return copy.deepcopy(node)

        result = copy_of(checkpoint)
        if from_cuda:
            torch.cuda.synchronize()  # the non-blocking copies are complete before the writer reads
        return result

    def release(self, staged: dict) -> None:
        """Give the buffers of a written checkpoint back for the next save."""
        for tensor in unique_tensors(staged).values():
            self._spare.setdefault(self._shape_key(tensor), []).append(tensor)

    def held_sizes(self) -> list[int]:
        """Bytes of each spare buffer kept for the next save."""
        return [tensor_bytes(t) for buffers in self._spare.values() for t in buffers]

    def held_bytes(self) -> int:
        """Bytes of the spare buffers kept for the next save."""
        return sum(self.held_sizes())


# Tensors up to this size are compared by their values in a fingerprint (a state read anew for each
# save, such as an RNG state, is a new tensor every time); larger ones by storage.
BY_VALUE_BYTES = 4096


def fingerprint(checkpoint: dict) -> object:
    """What identifies the training state a checkpoint holds, apart from the callbacks' own state:
    every other entry, with each tensor as its :func:`tensor_key` (up to 4 KiB: its values) and
    each numpy array as its values.  Two saves with equal fingerprints were taken at the same
    point of the loop (its progress counters are in ``loops``) of the same weights (no optimizer
    step runs without moving those counters), so they differ only in the callbacks' bookkeeping
    (a ``ModelCheckpoint`` records the file it is saving)."""

    def plain(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            if tensor_bytes(node) <= BY_VALUE_BYTES and node.device.type == "cpu":
                return ("values", node.dtype, tuple(node.shape), node.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            return ("tensor", tensor_key(node))
        if isinstance(node, np.ndarray):
            return ("ndarray", node.dtype.str, node.shape, node.tobytes())
        if isinstance(node, dict):
            return tuple((repr(key), plain(value)) for key, value in node.items())
        if isinstance(node, (list, tuple)):
            return tuple(plain(value) for value in node)
        return repr(node)

    return plain({key: value for key, value in checkpoint.items() if key != "callbacks"})


def link_into_place(source: Path, target: Path) -> None:
    """Make ``target`` a second name of the complete file ``source``, kill-safe: a hard link to a
    temporary sibling (``.<name>.partial``), then ``os.replace`` onto ``target``; so ``target`` is
    the old file or the new one at every moment (Lightning's ``save_last="link"`` removes the old
    file first).  Where hard links are not supported, the bytes are copied into the temporary
    file (flushed to disk) instead."""
    partial = target.with_name(f".{target.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(source, partial)
    except OSError:  # a file system without hard links (some FUSE, FAT): copy
        shutil.copyfile(source, partial)
        with partial.open("rb+") as file:
            os.fsync(file.fileno())
    try:
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


class BackgroundWriter:
    """One daemon thread running jobs (callables) in the order submitted; the first job that
    raises is kept, the jobs queued after it are dropped (a link to a file that failed would
    be wrong), and the error is raised by :meth:`raise_failure` (the next :meth:`submit` and
    :meth:`flush` call it)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._count_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; raises the error of an earlier job first, if there was one."""
        self.raise_failure()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        with self._count_lock:
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as error:  # kept for the training thread
                self._error = error
            finally:
                with self._count_lock:
                    self._pending -= 1
                self._jobs.task_done()

    def wait(self) -> None:
        """Wait until every queued job has run (an error stays kept)."""
        self._jobs.join()

    def flush(self) -> None:
        """Wait until every queued job has run; then raise the first error of one, if any."""
        self.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise (once) the error of a job that failed."""
        error, self._error = self._error, None
        if error is not None:
            raise error
