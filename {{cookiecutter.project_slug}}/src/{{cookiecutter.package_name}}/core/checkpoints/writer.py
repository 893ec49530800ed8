"""Checkpoint writes off the training path: staged (copied) to host memory, then written by one background thread.

Not Lightning's ``AsyncCheckpointIO``: it clones tensors on their device (a full fine-tune's state twice on the GPU: out of
memory) and needs a private base class; ``torch.distributed.checkpoint`` writes folders, which nothing here reads.

Staging copies every tensor into a host buffer, pinned with CUDA (PyTorch's caching host allocator rounds each pinned
block up to a power of two, as ``plan.json`` ``host_staging`` counts); host tensors too, as training changes them in
place.  Buffers are reused by the next save; tied tensors are staged once so the file keeps them tied; other values are
deep-copied.  Jobs run one at a time in order; a job's error is raised on the training thread at the next save or flush.
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

# Host memory (bytes) left free when staging: the OS, data loader workers, the write's page cache.
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
    """Bytes of host memory available (psutil's ``available``, else Linux's ``MemAvailable``, else ``None``)."""
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
    """Copies checkpoints into reusable host buffers; ``pin_memory=None``: pinned when CUDA is available."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._spare: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def _shape_key(tensor: torch.Tensor) -> tuple:
        return (tuple(tensor.shape), tensor.dtype)

    def bytes_to_allocate(self, checkpoint: object) -> int:
        """Bytes of new host buffers staging ``checkpoint`` would allocate (beyond the spare ones)."""
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
        """A copy of ``checkpoint`` with tensors in contiguous host buffers; returns once every copy is complete."""
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


# Fingerprint tensors up to this many bytes by value (an RNG state is a new tensor per save), larger by storage.
BY_VALUE_BYTES = 4096


def fingerprint(checkpoint: dict) -> object:
    """The training state a checkpoint holds, callbacks' state aside: tensors as :func:`tensor_key` (up to 4 KiB: values).

    Equal fingerprints mean the same loop point (``loops`` counters) and weights, differing only in callback bookkeeping.
    """

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
    """Make ``target`` a second name of ``source``, kill-safe: hard-link ``.<name>.partial`` then ``os.replace`` it (unlike
    Lightning's ``save_last="link"``, which removes the old file first).  Without hard links, copies and fsyncs instead."""
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
    """One daemon thread running jobs in order.  After a job raises, later jobs are dropped (a link to a failed file would be
    wrong); the error is raised by :meth:`raise_failure` (called by :meth:`submit` and :meth:`flush`)."""

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
        """Queue ``job``; raises an earlier job's error first."""
        self.raise_failure()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        with self._count_lock:
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:
                    job()
            except BaseException as error:  # kept for the training thread
                self._error = error
            finally:
                job = None  # (the staged checkpoint it holds is freed now, not at the next job)
                with self._count_lock:
                    self._pending -= 1
                self._jobs.task_done()
        self._jobs.task_done()

    def wait(self) -> None:
        """Wait until every queued job has run (an error stays kept), then end the thread: a run that is
        over holds no thread and no staged copy (a later :meth:`submit` starts another)."""
        self._jobs.join()
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._thread = None

    def flush(self) -> None:
        """:meth:`wait`, then raise the first job error, if any."""
        self.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise (once) the error of a job that failed."""
        error, self._error = self._error, None
        if error is not None:
            raise error
