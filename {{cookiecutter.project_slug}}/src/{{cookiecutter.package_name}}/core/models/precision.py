"""The one precision -> dtype policy: which dtype weights are stored in and matmuls run in, for
each of Lightning's precision flags.  The task modules (``train``, ``eval``, ``export``) and the
memory planner (``plan``) read it here.

Lightning's flags (``trainer.precision``): ``32-true`` everything fp32; ``bf16-mixed`` /
``16-mixed`` fp32 weights (the master copy the optimizer updates) with matmuls autocast to bf16 /
fp16; ``bf16-true`` weights, gradients and optimizer state all bf16 (Lightning docs,
"N-Bit Precision").
"""

from __future__ import annotations

import torch

# The dtype matmuls run in, per precision flag (absent: fp32).
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16, "16-true": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the matmuls under ``precision``: bf16, fp16 or fp32."""
    return COMPUTE_DTYPES.get(str(precision), torch.float32)


def is_mixed(precision: str) -> bool:
    """Whether ``precision`` keeps fp32 weights and autocasts the matmuls (``*-mixed``)."""
    return str(precision).endswith("-mixed")


def weights_dtype(precision: str, peft_method: str = "none") -> torch.dtype:
    """The dtype to build or load a model's weights in.

    Trained weights stay fp32 (the master copy ``*-mixed`` precision needs) unless the precision
    is ``*-true`` in a half dtype (Lightning casts the whole module to it); the frozen base of a
    LoRA/QLoRA run is stored in the compute dtype, since it only takes part in matmuls (half the
    memory under bf16; QLoRA's 4-bit layers dequantize to it).
    """
    if str(precision).endswith("-true") or peft_method in ("lora", "qlora"):
        return compute_dtype(precision)
    return torch.float32
