"""Lightning callbacks: the LR schedule (and, later, GPU stats and throughput)."""

from .lr_schedule import WarmupDecayLR, lr_factor

__all__ = ["WarmupDecayLR", "lr_factor"]
