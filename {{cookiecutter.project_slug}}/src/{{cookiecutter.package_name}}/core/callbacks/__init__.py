"""Lightning callbacks: the LR schedule, GPU stats, throughput/MFU, sample generation (causal LM),
RNG states for exact resume, and the guards that stop a run on purpose (signals, OOM, NaN)."""

from ..errors import RunStopped
from .gpu_stats import GPUStats
from .guards import NonFiniteLoss, OutOfMemoryGuard, StopOnSignal
from .lr_schedule import WarmupDecayLR, lr_factor
from .rng_state import RNGState
from .throughput import TokenThroughput

__all__ = [
    "GPUStats",
    "NonFiniteLoss",
    "OutOfMemoryGuard",
    "RNGState",
    "RunStopped",
    "StopOnSignal",
    "TokenThroughput",
    "WarmupDecayLR",
    "lr_factor",
]
