"""Lightning callbacks: the LR schedule, GPU stats, throughput/MFU, and sample generation (causal LM)."""

from .gpu_stats import GPUStats
from .lr_schedule import WarmupDecayLR, lr_factor
from .throughput import TokenThroughput

__all__ = ["GPUStats", "TokenThroughput", "WarmupDecayLR", "lr_factor"]
