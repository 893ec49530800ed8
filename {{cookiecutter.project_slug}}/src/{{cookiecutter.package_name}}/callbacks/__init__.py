"""Lightning callbacks: the LR schedule, sample generation (causal LM), and later GPU stats."""

from .lr_schedule import WarmupDecayLR, lr_factor

__all__ = ["WarmupDecayLR", "lr_factor"]
