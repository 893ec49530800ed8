"""Predict the time of one optimizer step from its kernels, without running it: a roofline.

Each kernel (counted by :class:`.tracer.OpCounter`) takes ``max(FLOPs / peak FLOP/s, bytes / memory bandwidth)``
(Williams, Waterman and Patterson, "Roofline", CACM 2009) plus a launch overhead: ``max(compute, memory, overhead)`` on a
GPU (the CPU issues while kernels run), ``max(compute, memory) + overhead`` on a CPU.  An optimizer step is
``accumulation x micro-step + optimizer step + hardware.step_overhead_ms``.

Peaks are the ``hardware`` group's: RTX 4090, 165.2 TFLOP/s dense bf16 and 1,008 GB/s (NVIDIA Ada whitepaper,
Appendix A); a CPU, :func:`measure_peaks`.  Left out: kernels below peak, caches, data loading, and of ``compile`` all
but the fused pointwise launches (docs/memory.md, "plan.mode").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ..errors import ConfigError

PEAK_KEYS = ("peak_tflops", "peak_tflops_fp32", "memory_gbps", "op_overhead_us")


def has_peaks(hardware: DictConfig) -> bool:
    """Whether ``hardware`` gives every peak the step-time model needs."""
    return all(hardware.get(key) is not None for key in PEAK_KEYS)


@dataclass(frozen=True)
class Peaks:
    """A device's peaks: ``tflops`` (dense 16-bit matmul, TFLOP/s), ``tflops_fp32`` (TFLOP/s), ``memory_gbps`` (GB/s,
    1e9 bytes), ``op_overhead_us`` (µs per kernel), ``step_overhead_ms`` (ms per optimizer step), ``overlaps`` (a GPU)."""

    tflops: float
    tflops_fp32: float
    memory_gbps: float
    op_overhead_us: float
    step_overhead_ms: float = 0.0
    overlaps: bool = True
    pcie_gbps: float | None = None

    @classmethod
    def of(cls, hardware: DictConfig) -> Peaks:
        """The peaks of a ``hardware`` config.

        Raises:
            ConfigError: a peak is unset (``hardware=cpu`` ships none: ``doctor --measure`` prints them).
        """
        missing = [key for key in PEAK_KEYS if hardware.get(key) is None]
        if missing:
            raise ConfigError(
                f"the step-time model needs hardware.{', hardware.'.join(missing)} (unset for hardware={hardware.name}); "
                "fix: plan for a card (hardware=rtx4090_24gb), or pass this machine's figures, which "
                "`python -m <package>.doctor --measure` prints as overrides"
            )
        return cls(
            tflops=float(hardware.peak_tflops),
            tflops_fp32=float(hardware.peak_tflops_fp32),
            memory_gbps=float(hardware.memory_gbps),
            op_overhead_us=float(hardware.op_overhead_us),
            step_overhead_ms=float(hardware.get("step_overhead_ms") or 0.0),
            overlaps=bool(hardware.get("kernels_overlap", True)),
            pcie_gbps=hardware.get("pcie_gbps"),
        )


@dataclass
class StepCost:
    """The kernels of one micro-step (forward + backward: ``micro``) and of one optimizer step
    (``optimizer``) at ``micro_batch`` sequences, each ``(flops, bytes, pointwise, low_precision)``."""

    micro_batch: int
    micro: list[tuple[int, int, bool, bool]]
    optimizer: list[tuple[int, int, bool, bool]]
    host_bytes: int = 0  # activation offloading: bytes copied to host memory and back per micro-step

    @property
    def flops(self) -> int:
        """FLOPs of one micro-step."""
        return sum(op[0] for op in self.micro)

    def scaled(self, micro_batch: int) -> StepCost:
        """Estimate at another micro-batch: micro-step FLOPs and bytes in proportion (bytes an upper bound: weights are
        read once per kernel); the optimizer step unchanged."""
        ratio = micro_batch / self.micro_batch
        micro = [(int(f * ratio), int(b * ratio), p, low) for f, b, p, low in self.micro]
        return StepCost(micro_batch, micro, self.optimizer, int(self.host_bytes * ratio))


@dataclass
class StepTime:
    """A predicted optimizer step in ms: ``total`` and its parts (``compute``/``memory``: kernels bound by FLOPs/bytes,
    ``overhead``: launches and per-step), ``flops`` per step and ``tokens_per_s``."""

    total_ms: float
    compute_ms: float
    memory_ms: float
    overhead_ms: float
    flops: int
    tokens_per_s: float

    @property
    def bound(self) -> str:
        """What most of the time is: ``compute``, ``memory`` or ``overhead``."""
        parts = {"compute": self.compute_ms, "memory": self.memory_ms, "overhead": self.overhead_ms}
        return max(parts, key=parts.get)


def _kernels_ms(ops: list[tuple[int, int, bool, bool]], peaks: Peaks, compiled: bool) -> tuple[float, float, float]:
    """(compute, memory, overhead) ms of ``ops``; each kernel's time goes to what bounds it."""
    compute = memory = overhead = 0.0
    launch = peaks.op_overhead_us * 1e-3
    for flops, moved, pointwise, low in ops:
        c = flops / ((peaks.tflops if low else peaks.tflops_fp32) * 1e9)  # ms
        m = moved / (peaks.memory_gbps * 1e6)
        o = 0.0 if compiled and pointwise else launch
        if peaks.overlaps:
            if o >= max(c, m):
                overhead += o
            elif c >= m:
                compute += c
            else:
                memory += m
        else:
            compute, memory, overhead = (compute + c, memory, overhead + o) if c >= m else (compute, memory + m, overhead + o)
    return compute, memory, overhead


def predict(cost: StepCost, peaks: Peaks, accumulate: int, tokens_per_micro_batch: int, compiled: bool = False) -> StepTime:
    """One optimizer step: ``accumulate`` micro-steps of ``cost``, the optimizer step and ``peaks.step_overhead_ms``.
    ``compiled``: pointwise kernels launch nothing (Inductor fuses them; their bytes count).  Offloaded activations come
    back over PCIe at ``peaks.pcie_gbps``, not overlapped: memory time."""
    micro = _kernels_ms(cost.micro, peaks, compiled)
    opt = _kernels_ms(cost.optimizer, peaks, compiled)
    compute, memory, overhead = (accumulate * a + b for a, b in zip(micro, opt))
    if cost.host_bytes and peaks.pcie_gbps:
        memory += accumulate * cost.host_bytes / (peaks.pcie_gbps * 1e6)
    overhead += peaks.step_overhead_ms
    total = compute + memory + overhead
    return StepTime(
        total_ms=total,
        compute_ms=compute,
        memory_ms=memory,
        overhead_ms=overhead,
        flops=accumulate * cost.flops + sum(op[0] for op in cost.optimizer),
        tokens_per_s=accumulate * tokens_per_micro_batch / (total / 1e3),
    )


def measure_peaks(device: str = "cpu", seconds: float = 0.5) -> dict[str, float]:
    """This machine's sustained peaks as ``hardware.*`` values, each the median rate over about ``seconds``: matmul
    TFLOP/s (fp32; bf16 on CUDA), GB/s of the triad ``a = b + s * c`` on 256 MiB vectors (McCalpin's STREAM benchmark),
    and µs per kernel of a tiny training step."""

    def rate(fn, work: float) -> float:
        fn()  # warm-up
        rates, start = [], time.perf_counter()
        while not rates or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            rates.append(work / (time.perf_counter() - t0))
        return statistics.median(rates)

    n = 8192 if device == "cuda" else 2048
    peaks = {}
    for key, dtype in (("peak_tflops_fp32", torch.float32), ("peak_tflops", torch.bfloat16 if device == "cuda" else torch.float32)):
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        peaks[key] = round(rate(lambda: a @ b, 2 * n**3) / 1e12, 4)
    b, c = (torch.ones(2**26, device=device) for _ in range(2))  # 256 MiB of fp32 each
    a = torch.empty_like(b)
    peaks["memory_gbps"] = round(rate(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * a.numel() * 4) / 1e9, 2)
    # Per-kernel overhead: forward + backward through eight 8 x 8 Linears (all overhead), over the kernels OpCounter counts.
    from .tracer import OpCounter

    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8, device=device) for _ in range(8)])
    x = torch.randn(4, 8, device=device)

    def step():
        layers(x).sum().backward()

    with OpCounter() as counter:
        step()
    kernels = len(counter.ops["micro"])
    peaks["op_overhead_us"] = round(1e6 / rate(step, kernels), 2)
    return peaks
