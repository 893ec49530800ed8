"""The memory/speed levers applied to a built Hugging Face model: activation checkpointing and
``torch.compile`` (the ``activation_checkpointing`` and ``compile`` config groups).  Attention is chosen at
build time (``attn_implementation``), the loss in the task module.  Shared by both tasks and by
the memory planner, so the planner traces exactly what training runs."""

from __future__ import annotations

from torch import nn


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer layer in backward instead of keeping its activations.

    Through the model's own ``activation_checkpointing_enable`` (transformers >= 5.x; the older
    name ``gradient_checkpointing_enable`` before it, now a deprecated alias that warns) with
    ``use_reentrant=False``: the non-reentrant ``torch.utils.checkpoint`` gives the same gradients
    as no checkpointing, works when the layer inputs need no gradient (frozen embeddings under
    LoRA) and warns about nothing (PyTorch docs, ``torch.utils.checkpoint``: reentrant is the
    legacy variant).  ``use_cache`` is turned off, as a KV cache makes no sense while training
    (and HF would warn each step); the causal-LM module turns it back on for export (``merged_model``).
    """
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.config.use_cache = False


def compile_in_place(module: nn.Module, mode: str) -> None:
    """``torch.compile`` ``module`` in place (``nn.Module.compile``): the module object and its
    ``state_dict`` keys stay as they are (no ``_orig_mod.`` prefix), so a checkpoint written with
    compile on loads with compile off and back.

    Args:
        mode: ``default`` or ``max-autotune`` (``off`` is never passed here).
    """
    module.compile(mode=None if mode == "default" else mode)


def apply_levers(
    model: nn.Module, activation_checkpointing: dict | None, compile_cfg: dict | None, compile_target: nn.Module | None = None
) -> None:
    """Apply the ``activation_checkpointing`` and ``compile`` groups (plain dicts; ``None`` = off) to
    ``model``; compile ``compile_target`` (default: the whole model), e.g. the transformer body
    when the loss calls it directly."""
    if activation_checkpointing and activation_checkpointing["mode"] == "full":
        enable_activation_checkpointing(model)
    if compile_cfg and compile_cfg["mode"] != "off":
        compile_in_place(compile_target if compile_target is not None else model, compile_cfg["mode"])
