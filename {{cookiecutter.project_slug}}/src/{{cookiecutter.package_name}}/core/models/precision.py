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
from omegaconf import DictConfig, OmegaConf

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


PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")


def machine_precision(accelerator: str = "auto") -> str:
    """``precision=auto``: ``bf16-mixed`` on a CUDA GPU with native bf16 (compute capability 8.0
    and newer: Ampere, Ada, Hopper), ``32-true`` otherwise (the CPU, an older GPU, or
    ``trainer.accelerator=cpu``)."""
    if str(accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 8:
        return "bf16-mixed"
    return "32-true"


def precision_is_auto(cfg: DictConfig) -> bool:
    """Whether ``cfg.trainer.precision`` is the ``precision=auto`` choice (read unresolved)."""
    trainer = cfg.get("trainer")
    return trainer is not None and "machine_precision" in str(OmegaConf.to_container(trainer, resolve=False).get("precision", ""))


def precision_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """``trainer.precision``: one of :data:`PRECISIONS`, bf16 only where the hardware has it, fp16 only on CUDA."""
    from ..run.distributed import uses_cuda

    precision = str(cfg.trainer.get("precision"))
    if precision not in PRECISIONS:
        return [f"trainer.precision={precision!r} is not one of {PRECISIONS}; fix: precision=bf16-mixed"]
    if precision.startswith("bf16") and "hardware" in cfg and not cfg.hardware.bf16:
        return [
            f"precision={precision} on hardware={cfg.hardware.name}, which has no bf16; "
            "fix: precision=16-mixed (fp16 with loss scaling) or 32-true"
        ]
    if precision == "16-mixed" and runs_here and not uses_cuda(cfg):  # Lightning would silently switch to bf16 on the CPU
        return [
            "precision=16-mixed needs a CUDA GPU (fp16 autocast with loss scaling), and none is in use; "
            "fix: precision=bf16-mixed (or 32-true) on the CPU"
        ]
    return []
