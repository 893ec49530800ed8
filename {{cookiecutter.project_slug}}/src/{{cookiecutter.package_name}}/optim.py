"""The optimizer factory shared by every task: AdamW-style param groups from a config dict."""

from __future__ import annotations

import hydra
import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Matrices (linear and embedding weights, ``ndim >= 2``) are decayed; biases and
    normalisation weights (``ndim < 2``) are not, since shrinking them toward zero only fights
    the normalisation (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019;
    the same rule as nanoGPT's ``configure_optimizers``).  Frozen parameters are left out.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, optimizer_cfg: dict) -> torch.optim.Optimizer:
    """Instantiate ``optimizer_cfg`` (a plain dict with ``_target_``, ``lr``, ``weight_decay``, ...)
    over :func:`param_groups` of ``model``.  The LR it holds is the peak LR; the schedule
    callback scales it each optimizer step.
    """
    options = {key: value for key, value in optimizer_cfg.items() if key != "_target_"}
    optimizer_class = hydra.utils.get_class(optimizer_cfg["_target_"])
    # Called directly, not through hydra.utils.instantiate, which would wrap the tensors in a config.
    return optimizer_class(param_groups(model, options["weight_decay"]), **options)
