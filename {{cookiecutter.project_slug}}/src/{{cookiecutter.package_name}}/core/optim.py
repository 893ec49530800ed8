"""The optimizer factory shared by every task: AdamW-style param groups from a config dict, the
fused / 8-bit variants, and the optimizer step inside backward."""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch import nn

from .config.keys import OWN_KEYS
from .config.named import OPTIMIZERS, import_path, is_8bit_optimizer
from .config.resolvers import accumulate_grad_batches, batch_problem, world_size
from .errors import ConfigError


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None, loraplus_lr_ratio: float | None = None) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Matrices (linear and embedding weights, ``ndim >= 2``) are decayed; biases and
    normalisation weights (``ndim < 2``) are not, since shrinking them toward zero only fights
    the normalisation (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019;
    the same rule as nanoGPT's ``configure_optimizers``).  Frozen parameters are left out.

    With ``loraplus_lr_ratio`` (LoRA+, Hayou et al. 2024, their Algorithm 1: ``eta_B = ratio *
    eta_A``) the LoRA ``B`` matrices (peft's ``lora_B`` / ``lora_embedding_B`` parameters) form a
    third group at ``lr * ratio``, decayed like the other matrices.  (peft's
    ``create_loraplus_optimizer`` builds the optimizer itself, without the fused / for-each choice
    or :class:`StepInBackward`, and moves every 1-D parameter to the ``B`` learning rate.)
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    is_b = (lambda name: ".lora_B." in name or ".lora_embedding_B." in name) if loraplus_lr_ratio else (lambda name: False)
    groups = [
        {"params": [p for name, p in trainable if p.ndim >= 2 and not is_b(name)], "weight_decay": weight_decay},
        {"params": [p for name, p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    if loraplus_lr_ratio:
        if lr is None:
            raise ValueError("param_groups: loraplus_lr_ratio needs lr")
        groups.append(
            {
                "params": [p for name, p in trainable if p.ndim >= 2 and is_b(name)],
                "weight_decay": weight_decay,
                "lr": lr * loraplus_lr_ratio,
            }
        )
    return groups


def lightning_allows_fused(precision: str, gradient_clip_val: float | None) -> bool:
    """Whether Lightning accepts a fused optimizer for this run: not when it clips gradients under
    ``*-mixed`` precision (its mixed-precision plugin refuses to clip for an optimizer that
    unscales gradients itself, bf16 included)."""
    return not (str(precision).endswith("-mixed") and bool(gradient_clip_val))


def optimizer_class(name: object) -> type:
    """The optimizer class ``optimizer.name`` names in :data:`.config.named.OPTIMIZERS`.

    Raises:
        ConfigError: a name not in the table, or its package (bitsandbytes) not installed.
    """
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name={name!r} is not one of this project's optimizers {sorted(OPTIMIZERS)}; fix: optimizer=adamw "
            "(or add yours to OPTIMIZERS in core/config/named.py)"
        )
    path = OPTIMIZERS[name]
    if path.startswith("bitsandbytes.") and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"optimizer.name={name} needs bitsandbytes; fix: pip install 'bitsandbytes>=0.45' (CUDA; the CPU from 0.45), or optimizer=adamw"
        )
    return import_path(path)


def optimizer_factory(optimizer_cfg: dict, device_type: str, fused_allowed: bool = True) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function ``groups -> optimizer`` for the ``optimizer`` config group (a plain dict: ``name``
    from :data:`.config.named.OPTIMIZERS`, the class's keyword arguments, and our own keys).

    ``fused: null`` means torch's fused kernel on CUDA and on the CPU (one kernel per parameter
    tensor, no temporaries) when ``fused_allowed``, else the for-each kernels (torch's default on CUDA).  ``fused_allowed`` is false where Lightning refuses a
    fused optimizer: gradient clipping under ``*-mixed`` precision (its mixed-precision plugin
    takes any optimizer that unscales gradients itself for one it cannot clip, also in bf16).
    bitsandbytes classes take no ``fused``.

    Raises:
        ConfigError: see :func:`optimizer_class`.
    """
    name = optimizer_cfg.get("name")
    cls = optimizer_class(name)
    options = {key: value for key, value in optimizer_cfg.items() if key not in OWN_KEYS["optimizer"]}
    if OPTIMIZERS[name].startswith("torch.optim.") and "fused" in inspect.signature(cls).parameters:
        fused = optimizer_cfg.get("fused")
        options["fused"] = (device_type in ("cuda", "cpu") and fused_allowed) if fused is None else fused
        if not options["fused"] and fused is None and device_type in ("cuda", "cpu"):
            options["foreach"] = True
    # Called directly, not through hydra.utils.instantiate, which would wrap the tensors in a config.
    return lambda groups: cls(groups, **options)


def build_optimizer(
    model: nn.Module, optimizer_cfg: dict, device_type: str = "cpu", fused_allowed: bool = True, loraplus_lr_ratio: float | None = None
) -> torch.optim.Optimizer:
    """The optimizer of ``optimizer_cfg`` (``name``, ``lr``, ``weight_decay``, ...) over
    :func:`param_groups` of ``model`` whose parameters live on ``device_type`` (``fused_allowed``:
    see :func:`optimizer_factory`; ``loraplus_lr_ratio``: the LoRA+ group of :func:`param_groups`).

    With ``step_in_backward: true`` it is a :class:`StepInBackward` (each parameter stepped as
    soon as its gradient is complete).  The LR it holds is the peak LR; the schedule callback
    scales it each optimizer step, whichever of the two is returned.

    Raises:
        ConfigError: see :func:`optimizer_factory`.
    """
    make = optimizer_factory(optimizer_cfg, device_type, fused_allowed)
    groups = param_groups(model, optimizer_cfg["weight_decay"], optimizer_cfg["lr"], loraplus_lr_ratio)
    if optimizer_cfg.get("step_in_backward"):
        return StepInBackward([{"lr": optimizer_cfg["lr"], **group} for group in groups], make)
    return make(groups)


class StepInBackward(torch.optim.Optimizer):
    """Step each parameter inside ``backward``, the moment its gradient is complete, then free
    that gradient: the gradients of the whole model never exist at once (peak gradient memory is
    about one tensor instead of one per parameter).  The mechanism is PyTorch's
    ``register_post_accumulate_grad_hook`` (tutorial "How to save memory by fusing the optimizer
    step into the backward pass"); torchtune's ``optimizer_in_bwd`` is the same idea.

    One inner optimizer per parameter does the real work.  This object is what Lightning sees:
    ``param_groups`` are the usual two (decayed / not), whose ``lr`` the schedule callback sets
    and each inner optimizer copies before its step; ``step()`` only runs Lightning's closure
    (hooks, step counting), since the updates already happened in backward.  Use it under
    manual optimization (``manual_backward`` then ``optimizer.step()``).

    Costs: no gradient accumulation (a gradient is consumed by the step at once) and no clipping
    by the global norm (it is unknown until every gradient exists); ``validate_config`` refuses
    both combinations.

    Args:
        groups: :func:`param_groups` output.
        make: ``groups -> optimizer`` (:func:`optimizer_factory`), called once per parameter.
    """

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        super().__init__(groups, defaults={})
        self.inner: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._group_of: dict[nn.Parameter, dict] = {}
        for group in self.param_groups:
            for param in group["params"]:
                self.inner[param] = make([{"params": [param], "weight_decay": group["weight_decay"]}])
                self._group_of[param] = group
        self._hooks = [param.register_post_accumulate_grad_hook(self._step_parameter) for param in self.inner]

    def _step_parameter(self, param: nn.Parameter) -> None:
        optimizer = self.inner[param]
        optimizer.param_groups[0]["lr"] = self._group_of[param]["lr"]  # the schedule's current LR
        optimizer.step()
        param.grad = None  # free it now: the point of this optimizer

    @torch.no_grad()
    def step(self, closure: Callable[[], object] | None = None) -> object:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.inner:
            param.grad = None

    def state_dict(self) -> dict:
        """The groups' scalars (``lr``, ``peak_lr``...) and each inner optimizer's state, in
        parameter order: plain tensors and numbers, so checkpoints load with ``weights_only=True``."""
        return {
            "groups": [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups],
            "per_parameter": [optimizer.state_dict() for optimizer in self.inner.values()],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if len(state_dict["per_parameter"]) != len(self.inner):
            raise ValueError(f"optimizer state of {len(state_dict['per_parameter'])} parameters, the model trains {len(self.inner)}")
        for group, saved in zip(self.param_groups, state_dict["groups"]):
            group.update(saved)
        for optimizer, saved in zip(self.inner.values(), state_dict["per_parameter"]):
            optimizer.load_state_dict(saved)

    def remove_hooks(self) -> None:
        """Detach from the parameters (the planner's trace, tests)."""
        for handle in self._hooks:
            handle.remove()


def fused_problems(cfg: DictConfig) -> list[str]:
    """``optimizer.fused=true`` where Lightning would refuse it (:func:`lightning_allows_fused`)."""
    optimizer = cfg.get("optimizer") or {}
    clip = cfg.trainer.get("gradient_clip_val") if "trainer" in cfg else None
    if optimizer.get("fused") is True and "trainer" in cfg and not lightning_allows_fused(cfg.trainer.get("precision", ""), clip):
        return [
            f"optimizer.fused=true with precision={cfg.trainer.precision} and trainer.gradient_clip_val={clip}: Lightning's "
            "mixed-precision plugin refuses to clip the gradients of a fused optimizer; fix: optimizer.fused=null "
            "(fused where it can be, for-each kernels here), or trainer.gradient_clip_val=null"
        ]
    return []


def optimizer_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """The ``optimizer`` group: a positive lr, a weight decay >= 0, bitsandbytes for the 8-bit ones,
    and what stepping inside backward cannot take (:func:`_step_in_backward_problems`)."""
    problems = []
    optimizer = cfg.optimizer
    lr, weight_decay = optimizer.get("lr"), optimizer.get("weight_decay")
    if _finite_or_not_a_number(lr) and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0):
        problems.append(f"optimizer.lr={lr!r} must be a positive number, e.g. optimizer.lr=5e-5")
    if _finite_or_not_a_number(weight_decay) and (not isinstance(weight_decay, (int, float)) or weight_decay < 0):
        problems.append(f"optimizer.weight_decay={weight_decay!r} must be a number >= 0; fix: e.g. optimizer.weight_decay=0.01 (0: none)")
    if runs_here and is_8bit_optimizer(optimizer.get("name")) and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"optimizer.name={optimizer.name} needs bitsandbytes; fix: pip install 'bitsandbytes>=0.45', or optimizer=adamw")
    if optimizer.get("step_in_backward"):
        problems += _step_in_backward_problems(cfg)
    return problems


def _finite_or_not_a_number(value: object) -> bool:
    """False for a NaN/infinite float (the validator's non-finite check reports it once)."""
    return not (isinstance(value, float) and not math.isfinite(value))


def _step_in_backward_problems(cfg: DictConfig) -> list[str]:
    """``optimizer.step_in_backward`` consumes each gradient as it is made: nothing can wait for
    the whole gradient (accumulation, global-norm clipping, loss scaling, a DDP all-reduce)."""
    problems = []
    devices, nodes = world_size(cfg)
    if "batch" in cfg and batch_problem(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, devices, nodes) is None:
        accumulate = accumulate_grad_batches(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, devices, nodes)
        if devices * nodes > 1:
            problems.append(
                f"optimizer.step_in_backward=true steps each parameter before DDP/FSDP can all-reduce its gradient "
                f"(trainer.devices={devices}, trainer.num_nodes={nodes}); fix: optimizer.step_in_backward=false"
            )
        elif accumulate != 1:
            problems.append(
                f"optimizer.step_in_backward=true steps on every micro-batch, but batch.global_batch_size="
                f"{cfg.batch.global_batch_size} / batch.micro_batch_size={cfg.batch.micro_batch_size} accumulates {accumulate}; "
                f"fix: batch.global_batch_size={cfg.batch.micro_batch_size}, or optimizer.step_in_backward=false"
            )
    if "trainer" in cfg:
        clip = cfg.trainer.get("gradient_clip_val")
        if clip not in (None, 0, 0.0):
            problems.append(
                f"optimizer.step_in_backward=true cannot clip by the global gradient norm (trainer.gradient_clip_val={clip}): "
                "the norm is known only after every parameter has stepped; fix: trainer.gradient_clip_val=null"
            )
        if str(cfg.trainer.get("precision")) == "16-mixed":
            problems.append(
                "optimizer.step_in_backward=true with precision=16-mixed: the loss scaler must see every gradient "
                "before any step; fix: precision=bf16-mixed"
            )
        devices = cfg.trainer.get("devices")
        if devices not in (1, "1", None) or cfg.trainer.get("num_nodes", 1) != 1:
            problems.append(
                f"optimizer.step_in_backward=true runs on one device (trainer.devices={devices}): DDP all-reduces "
                "gradients after backward; fix: trainer.devices=1"
            )
    return problems
