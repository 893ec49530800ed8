"""An exponential moving average (EMA) of the trainable parameters, validated, tested and exported
in place of the raw weights.

After each optimizer step ``ema = decay * ema + (1 - decay) * weight`` for every trained parameter
(torch's ``swa_utils.get_ema_multi_avg_fn``; with LoRA the adapter only), on its device, in fp32
(in bf16 most updates round away).  Validation, the best checkpoint and early stopping judge the
average; every checkpoint holds it as the model's weights (eval, predict, export, generate use it),
the raw weights in the callback's state (``callbacks["EMA"]["raw"]``), so a resume continues both
exactly.  Swapping the two sets for a validation exchanges tensor references (no copy).
"""

from __future__ import annotations

import lightning as L
import torch
from omegaconf import DictConfig
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ..run.distributed import is_fsdp


class EMA(L.Callback):
    """Keep, validate and checkpoint an EMA of the trainable parameters (module docstring).

    Args:
        decay: the weight of the old average per optimizer step, in (0, 1); 0.999 averages over
            about the last 1,000 steps (``1 / (1 - decay)``).

    Raises:
        ValueError: ``decay`` outside (0, 1) (``callbacks.ema.decay``).
    """

    def __init__(self, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ValueError(f"callbacks.ema.decay={decay!r} must be in (0, 1); fix: callbacks.ema.decay=0.999")
        self.decay = float(decay)
        self._update = get_ema_multi_avg_fn(self.decay)
        self.averaged: dict[str, torch.Tensor] | None = None
        self._raw_from_checkpoint: dict[str, torch.Tensor] | None = None
        # Whether the model holds the average; while it does, ``self.averaged`` holds the raw weights (swapped).
        self._holding_average = False
        self._step = -1

    @staticmethod
    def trained(pl_module: L.LightningModule) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

    def _ready(self, pl_module: L.LightningModule) -> None:
        """Start the average from the model's weights: the starting weights, or after a resume the
        checkpoint's (the average), the raw ones then put back from the callback's state."""
        if self.averaged is not None:
            return
        params = self.trained(pl_module)
        if self._raw_from_checkpoint is not None and set(self._raw_from_checkpoint) != set(params):
            raise ValueError(
                f"the checkpoint's EMA state holds {len(self._raw_from_checkpoint)} trained tensors, this model trains "
                f"{len(params)}: not the same run; fix: resume the run that wrote it, or start a new one"
            )
        self.averaged = {name: p.detach().clone() for name, p in params.items()}
        if self._raw_from_checkpoint is not None:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self._raw_from_checkpoint[name])
            self._raw_from_checkpoint = None
        self._step = pl_module.trainer.global_step

    def _swap(self, pl_module: L.LightningModule) -> None:
        """Exchange the model's weights and the average (references only)."""
        for name, p in self.trained(pl_module).items():
            p.data, self.averaged[name] = self.averaged[name], p.data

    def _hold_average(self, pl_module: L.LightningModule) -> None:
        if not self._holding_average:
            self._swap(pl_module)
            self._holding_average = True

    def _hold_raw(self, pl_module: L.LightningModule) -> None:
        if self._holding_average:
            self._swap(pl_module)
            self._holding_average = False

    # ------------------------------------------------------------------------------ hooks
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        self._ready(pl_module)
        self._hold_raw(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        if trainer.global_step != self._step:  # an optimizer step happened (not every micro-batch is one)
            params = self.trained(pl_module)
            self._update(list(self.averaged.values()), [params[name].detach() for name in self.averaged], None)
            self._step = trainer.global_step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ready(pl_module)
        self._hold_average(pl_module)  # (the next training batch puts the raw weights back)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaged is not None:
            self._hold_average(pl_module)  # the fit's result is the average (test, export)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """The checkpoint's model weights become the average; the raw ones go in the callback state."""
        self._ready(pl_module)
        in_model = {name: p.detach() for name, p in self.trained(pl_module).items()}
        average, raw = (in_model, self.averaged) if self._holding_average else (self.averaged, in_model)
        canonical = {id(p): name for name, p in self.trained(pl_module).items()}
        for name, p in pl_module.named_parameters(remove_duplicate=False):  # tied weights: every name of the tensor
            if id(p) in canonical and name in checkpoint["state_dict"]:
                checkpoint["state_dict"][name] = average[canonical[id(p)]].clone()
        checkpoint["callbacks"][self.state_key] = {"decay": self.decay, "raw": {name: t.clone() for name, t in raw.items()}}

    def state_dict(self) -> dict:
        return {}  # (written by on_save_checkpoint, which sees the model)

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("raw") is not None:
            self._raw_from_checkpoint = dict(state_dict["raw"])


def ema_problems(cfg: DictConfig, ema: DictConfig) -> list[str]:
    """``callbacks=ema``: its decay, and the settings it cannot average under."""
    problems = []
    decay = ema.get("decay")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        problems.append(f"callbacks.ema.decay={decay!r} must be in (0, 1); fix: callbacks.ema.decay=0.999")
    precision = str(cfg.trainer.get("precision", "")) if "trainer" in cfg else ""
    if precision in ("bf16-true", "16-true"):
        problems.append(
            f"callbacks=ema with precision={precision}: the trained weights are half precision, where (1 - decay) x (weight - "
            "average) mostly rounds to nothing; fix: precision=bf16-mixed (fp32 trained weights), or callbacks=default"
        )
    if (cfg.get("optimizer") or {}).get("step_in_backward"):
        problems.append(
            "callbacks=ema with optimizer.step_in_backward=true: stepping in backward is for runs whose full gradients do not "
            "fit, where an fp32 copy of every trained weight fits even less; fix: optimizer.step_in_backward=false, or callbacks=default"
        )

    if "trainer" in cfg and is_fsdp(cfg.trainer):
        problems.append(
            "callbacks=ema with trainer=fsdp: each rank holds a shard of every flattened parameter, and the average is kept "
            "and checkpointed per unsharded parameter name; fix: trainer=ddp (or one GPU), or callbacks=default"
        )
    if (cfg.get("pruning") or {}).get("method", "none") != "none":
        problems.append(
            f"callbacks=ema with pruning={cfg.pruning.method}: the average of the weights before and after each pruning step "
            "puts pruned weights back; fix: pruning=none, or callbacks=default"
        )
    return problems
