"""LoRA and QLoRA through ``peft``, from the ``peft`` config group, and that group's check.

- LoRA (Hu et al. 2021): the base is frozen; each target linear layer ``W`` gains a trainable
  ``B @ A`` of rank ``r``, scaled by ``alpha / r``; a classifier's new head trains in full (peft's
  ``SEQ_CLS``/``TOKEN_CLS`` put it in ``modules_to_save``).  QLoRA (Dettmers et al. 2023): the same on
  an NF4 base (bitsandbytes), double quantization optional; adapters on all linear layers (their
  finding) is why the default target is peft's ``all-linear``.
- Variants, ``peft.LoraConfig`` options: DoRA (Liu et al. 2024, ``use_dora``), rsLoRA
  (Kalajdzievski 2023: ``alpha / sqrt(r)``, ``use_rslora``); LoRA+ (Hayou et al. 2024) is an
  optimizer parameter group (:func:`..optim.param_groups`).
- PiSSA (Meng et al. 2024) and OLoRA (Büyükakyüz 2024) initialise ``A``, ``B`` from ``W`` and leave
  the base at ``W - scale * B0 @ A0``: checkpoints keep ``(A0, B0)`` (:func:`adapter_tensors`), a
  load rebuilds the residual (:func:`restore_residual`), ``export`` converts the adapter for the
  original base (:func:`save_adapter`).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import BitsAndBytesConfig, PretrainedConfig

from ..errors import ConfigError
from .precision import compute_dtype

METHODS = ("none", "lora", "qlora")
# peft's shorthand for every linear layer (nn.Linear, GPT-2's Conv1D) but the output layer (the
# lm_head; for its SEQ_CLS task type the classifier head), resolved by peft on the model itself.
ALL_LINEAR = "all-linear"
# Task heads that peft's classification task types train in full (modules_to_save): never adapted.
HEAD_NAMES = ("lm_head", "classifier", "score")


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies (on the CPU) of every ``lora_A``/``lora_B`` weight of ``model``, by parameter name."""
    return {
        name: param.detach().to("cpu", copy=True) for name, param in model.named_parameters() if ".lora_A." in name or ".lora_B." in name
    }


def lora_layers(model: torch.nn.Module):
    """``(name, module)`` of each peft LoRA layer of ``model`` (the modules holding ``lora_A``)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)]


def restore_residual(model: torch.nn.Module, initial: dict[str, torch.Tensor]) -> int:
    """Set each adapted layer's base weight to ``W - scale * B0 @ A0`` (computed in fp32 on the
    CPU, then cast back to the weight's dtype: the expression PiSSA and OLoRA use in peft), with
    ``(A0, B0)`` the initial adapter stored by the run (:func:`adapter_tensors`).  Call on a model
    whose adapters were built with peft's plain initialisation (its base is the original ``W``).

    Returns the number of layers rewritten.

    Raises:
        ValueError: ``initial`` does not hold an ``(A0, B0)`` pair for every adapted layer.
    """
    done = 0
    for name, layer in lora_layers(model):
        for adapter in layer.lora_A:
            a_key, b_key = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
            if a_key not in initial or b_key not in initial:
                raise ValueError(f"the checkpoint's initial adapter lacks {a_key} / {b_key}: not the run that wrote it")
            weight = layer.get_base_layer().weight
            residual = weight.detach().to("cpu", torch.float32) - layer.scaling[adapter] * initial[b_key].float() @ initial[a_key].float()
            with torch.no_grad():
                weight.copy_(residual.to(weight.dtype))
            done += 1
    return done


def save_adapter(model: torch.nn.Module, folder: Path, initial: dict[str, torch.Tensor] | None) -> None:
    """peft's ``save_pretrained`` of the adapter into ``folder``; for a PiSSA/OLoRA run
    (``initial``: its initial adapter) converted by peft for the *original* base: the initial
    adapter is saved first (beside ``folder``, removed after), then peft writes the rank-``2r``
    adapter ``[B, -B0] @ [A; A0]`` that ``PeftModel.from_pretrained(base, folder)`` loads."""
    if not initial:
        model.save_pretrained(folder)
        return
    params = dict(model.named_parameters())
    trained = {name: params[name].detach().clone() for name in initial}
    starting = folder.parent / f"{folder.name}_initial"  # (peft loads it as an adapter of that name: no dots)
    with torch.no_grad():
        for name, tensor in initial.items():
            params[name].copy_(tensor)
    try:
        model.save_pretrained(starting)
    finally:
        with torch.no_grad():
            for name, tensor in trained.items():
                params[name].copy_(tensor)
    model.save_pretrained(folder, path_initial_model_for_weight_conversion=str(starting))
    shutil.rmtree(starting)


def uses_peft(peft_cfg: dict | None) -> bool:
    """Whether the ``peft`` group asks for adapters (``lora``/``qlora``), not a full model."""
    return bool(peft_cfg) and peft_cfg.get("method", "none") != "none"


def target_modules(peft_cfg: dict, config: PretrainedConfig, linear_names: list[str]) -> list[str] | str:
    """The LoRA target modules for this model, checked against its linear layers.

    ``peft.target_modules``: ``all-linear`` (also ``null``, the default) is peft's own selection,
    every linear layer but the output layer and the task head (returned as the string, for peft to
    resolve on the model); a list of names matches a layer whose dotted path ends with a name
    (peft's own rule).

    Raises:
        ConfigError: ``all-linear`` on a model with no linear layer outside its heads, or a name
            that matches no linear layer (the message lists the layer names the model has).
    """
    names = peft_cfg.get("target_modules")
    leaf_names = sorted({name.rsplit(".", 1)[-1] for name in linear_names})
    if names is None or names == ALL_LINEAR:
        if not [path for path in linear_names if not set(path.split(".")) & set(HEAD_NAMES)]:
            raise ConfigError(
                f"peft.target_modules={ALL_LINEAR}: this {config.model_type} model has no linear layer outside its "
                f"output head (its linear layers: {leaf_names}); fix: peft=none (train it in full)"
            )
        return ALL_LINEAR
    unknown = [n for n in names if not any(path == n or path.endswith("." + n) for path in linear_names)]
    if unknown:
        raise ConfigError(
            f"peft.target_modules={list(names)}: {unknown} match no linear layer of this {config.model_type} model; "
            f"fix: peft.target_modules={ALL_LINEAR}, or choose from its linear layers {leaf_names}"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "tie_word_embeddings", False):
        problem = tied_output_problem(list(names), [path for path in linear_names if path.rsplit(".", 1)[-1] == "lm_head"])
        if problem:
            raise ConfigError(problem)
    return list(names)


def tied_output_problem(names: list[str], output_paths: list[str]) -> str | None:
    """A line when a LoRA target name matches one of ``output_paths``, the output layer(s) that
    share their weight with the input embedding (``tie_word_embeddings``), else ``None``.

    An adapter there trains the output projection alone, but merging it (``export``) writes the
    update into the one shared matrix, so the input embedding changes too: the exported model
    scores differently from the checkpoint (found: perplexity 42.74 vs 45.34, exit 0).
    """
    for name in names:
        for path in output_paths:
            if path == name or path.endswith("." + name):
                return (
                    f"peft.target_modules={names}: {name!r} adapts the output layer {path!r}, which shares its weight with the "
                    "input embedding (tie_word_embeddings=true): merging the adapter on export would change the embedding too, "
                    f"and the exported model would not score as the checkpoint does; fix: drop {name!r} from peft.target_modules"
                )
    return None


def check_adapter_spec(peft_cfg: dict | None, spec: dict, precision: str) -> None:
    """Refuse adapters the model spec cannot take, before any weights load (any task).

    Raises:
        ConfigError: LoRA/QLoRA without pretrained weights (``model.name_or_path``), QLoRA with
            ``bf16-true``.
    """
    if not uses_peft(peft_cfg):
        return
    method = peft_cfg["method"]
    if not spec.get("name_or_path"):
        raise ConfigError(
            f"peft={method} adapts pretrained weights, but model.name_or_path is null; "
            "fix: a pretrained model (e.g. model=smollm2_135m), or peft=none to train from scratch"
        )
    if method == "qlora" and precision == "bf16-true":
        raise ConfigError(
            "peft=qlora with precision=bf16-true: Lightning would cast the 4-bit base weights; fix: precision=bf16-mixed (the QLoRA recipe)"
        )


def lora_config(peft_cfg: dict, modules: list[str] | str, task_type: str = "CAUSAL_LM", initialise: bool = True):
    """The ``peft.LoraConfig`` of the ``peft`` group (rank ``r``, ``alpha``, ``dropout``,
    ``use_dora``, ``use_rslora``, ``init_lora_weights``; ``initialise=False``: peft's plain
    initialisation whatever the group says, for a model whose weights a checkpoint then sets).

    ``task_type``: peft's ``TaskType`` name: ``CAUSAL_LM``, or ``SEQ_CLS``/``TOKEN_CLS`` (peft then
    adds the classifier head, a module named ``score`` or ``classifier``, to ``modules_to_save``: a
    trained full copy of it, saved with the adapter; under ``all-linear`` the head, the layers
    inside it, and layers whose name ends with a head's (``pre_classifier``) are not adapted).
    """
    from peft import LoraConfig, TaskType

    exclude = None
    if modules == ALL_LINEAR and task_type != "CAUSAL_LM":
        # peft full-matches a string against each module path; a name *ending* in a head's name is
        # excluded too, since peft's modules_to_save matches by suffix (DistilBERT's pre_classifier
        # is trained in full with its classifier, and cannot also hold an adapter).
        exclude = rf".*({'|'.join(HEAD_NAMES)})(\..*)?"
    return LoraConfig(
        r=peft_cfg["r"],
        lora_alpha=peft_cfg["alpha"],
        lora_dropout=peft_cfg["dropout"],
        target_modules=modules,
        exclude_modules=exclude,
        use_dora=bool(peft_cfg.get("use_dora", False)),
        use_rslora=bool(peft_cfg.get("use_rslora", False)),
        init_lora_weights=peft_cfg.get("init_lora_weights", True) if initialise else True,
        bias="none",
        task_type=TaskType[task_type],
    )


def require_bitsandbytes() -> None:
    """Raises ConfigError when bitsandbytes (QLoRA, 8-bit optimizers) is not importable."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "peft=qlora needs bitsandbytes (4-bit NF4 weights); fix: pip install 'bitsandbytes>=0.45' "
            "(Linux/Windows; it runs on CUDA GPUs and, from 0.45 on, on the CPU), or use peft=lora"
        )


def quantization_config(peft_cfg: dict, compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """4-bit quantization of the base model for QLoRA: NF4 weights, matmuls in ``compute_dtype``."""
    require_bitsandbytes()
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=peft_cfg["quant_type"],
        bnb_4bit_use_double_quant=peft_cfg["double_quant"],
        bnb_4bit_compute_dtype=compute_dtype,
    )


def quantized_loading(peft_cfg: dict, precision: str, device: torch.device | None) -> dict:
    """``from_pretrained`` options of a QLoRA base: the 4-bit config, and on CUDA the device to
    quantize on (``device``: the trainer's, ``None`` without one)."""
    options = {"quantization_config": quantization_config(peft_cfg, compute_dtype(precision))}
    if device is not None and device.type == "cuda":
        options["device_map"] = {"": device}
    return options


def wrap_with_lora(
    model: torch.nn.Module, peft_cfg: dict, modules: list[str] | str, task_type: str = "CAUSAL_LM", initialise: bool = True
) -> torch.nn.Module:
    """Freeze ``model`` and add LoRA adapters (a ``peft.PeftModel``; ``task_type`` and
    ``initialise`` as in :func:`lora_config`).  Every trained weight is fp32: peft makes the adapters fp32 itself, and
    a classifier head copied by ``modules_to_save`` from a bf16 base is cast here (bf16 weights
    would round most AdamW updates away).

    For a 4-bit base we do *not* call peft's ``prepare_model_for_kbit_training``: it casts every
    weight that is not 4-bit to fp32, and for Llama-3.1-8B that is the 128k x 4096 embedding and
    lm_head, 3.9 GiB more than in bf16 (a third of a QLoRA run's memory, found by the planner).
    They stay in the compute dtype, as the frozen base of a LoRA run does; the adapters are fp32
    (peft's default) and train under autocast.  Activation checkpointing is its own config group.

    Raises:
        ConfigError: a target is an output layer tied to the input embedding (:func:`tied_output_problem`).
    """
    from peft import get_peft_model

    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and inputs is not None and getattr(output, "weight", None) is getattr(inputs, "weight", False):
        problem = tied_output_problem(
            modules if modules != ALL_LINEAR else [], [name for name, module in model.named_modules() if module is output]
        )
        if problem:  # (the config said the weights were not tied; the loaded model ties them)
            raise ConfigError(problem)
    model = get_peft_model(model, lora_config(peft_cfg, modules, task_type, initialise))
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
    return model


# The peft group (both tasks).
PEFT_METHODS = ("none", "lora", "qlora")


def peft_problems(peft: DictConfig) -> list[str]:
    """The ``peft`` group: its method, LoRA's rank/alpha/dropout/targets, and the initialisation."""
    method = peft.get("method")
    if method not in PEFT_METHODS:
        return [f"peft.method={method!r} is not one of {PEFT_METHODS}; fix: peft=lora (or none, qlora)"]
    if method == "none":
        return []
    problems = []
    r, alpha, dropout = peft.get("r"), peft.get("alpha"), peft.get("dropout")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"peft.r={r!r} must be a positive integer (the LoRA rank), e.g. peft.r=16")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"peft.alpha={alpha!r} must be a positive number (scale = alpha / r), e.g. peft.alpha=32")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"peft.dropout={dropout!r} must be in [0, 1); fix: e.g. peft.dropout=0.05")
    modules = peft.get("target_modules")
    if (
        modules is not None
        and modules != "all-linear"
        and (isinstance(modules, str) or not modules or not all(isinstance(m, str) and m for m in modules))
    ):
        problems.append(
            f"peft.target_modules={modules!r} must be all-linear (peft's selection) or a list of layer names; "
            "fix: peft.target_modules=all-linear, or e.g. peft.target_modules=[q_proj,v_proj]"
        )
    for key in ("use_dora", "use_rslora"):
        if not isinstance(peft.get(key, False), bool):
            problems.append(f"peft.{key}={peft.get(key)!r} must be true or false; fix: peft.{key}=true")
    problems += _lora_init_problems(peft)
    ratio = peft.get("loraplus_lr_ratio")
    if ratio is not None and (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio < 1):
        problems.append(
            f"peft.loraplus_lr_ratio={ratio!r} must be null or a number >= 1 (the B matrices' learning rate over A's, "
            "LoRA+); fix: e.g. peft.loraplus_lr_ratio=16"
        )
    return problems


# peft.init_lora_weights values that rewrite the base weights (and pissa_niter_<n>, PISSA_NITER).
BASE_REWRITING_INITS = ("pissa", "olora")


PISSA_NITER = re.compile(r"pissa_niter_[1-9][0-9]*")


def rewrites_base(peft: dict | DictConfig | None) -> bool:
    """Whether the ``peft`` group trains adapters initialised by PiSSA or OLoRA
    (``init_lora_weights``), which leave the frozen base as a residual."""
    peft = peft or {}
    init = peft.get("init_lora_weights", True)
    adapters = peft.get("method", "none") != "none"
    return adapters and isinstance(init, str) and (init in BASE_REWRITING_INITS or bool(PISSA_NITER.fullmatch(init)))


def _lora_init_problems(peft: DictConfig) -> list[str]:
    """``peft.init_lora_weights``: true, pissa, pissa_niter_<n> or olora, and what PiSSA/OLoRA cannot join."""
    init = peft.get("init_lora_weights", True)
    if init is True:
        return []
    if not rewrites_base(peft):
        return [
            f"peft.init_lora_weights={init!r} must be true, pissa, pissa_niter_<n> (e.g. pissa_niter_4) or olora; "
            "fix: peft.init_lora_weights=true"
        ]
    problems = []
    if peft.get("method") == "qlora":
        problems.append(
            f"peft.init_lora_weights={init} with peft=qlora: the residual base would be quantized to 4 bits again, so the "
            "checkpoint's initial adapter could not rebuild it exactly on a load; fix: peft=lora, or peft.init_lora_weights=true"
        )
    if peft.get("use_dora"):
        problems.append(
            f"peft.init_lora_weights={init} with peft.use_dora=true: the conversion of its adapter for the original base "
            "is not checked for DoRA here; fix: one of them"
        )
    return problems
