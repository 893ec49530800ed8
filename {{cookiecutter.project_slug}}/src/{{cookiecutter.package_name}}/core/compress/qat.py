"""Quantization-aware training (the ``qat`` group) on torchao's QAT flow.

``qat=int8a_int4w`` fine-tunes with fake-quantised ``nn.Linear`` layers: activations rounded as int8 (asymmetric, per
token, dynamic range), weights as int4 (symmetric, per ``group_size`` input weights), computed in floating point; the
gradient passes the rounding as the identity (straight-through estimator).  ``convert`` then stores integer weights with
the same arithmetic, so outputs are unchanged.  The scheme is torchao's ``Int8DynamicActivationIntxWeightConfig``
(torchao README, "Quantization-Aware Training").

Parameter names are kept, so QAT and plain checkpoints load into each other.  Layers :func:`quantizable` rejects keep
full precision.  torchao is imported only here, when a scheme is chosen (the ``compress`` extra).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import CONV1D_MODEL_TYPES, conv1d_refusal

SCHEMES = ("none", "int8a_int4w")


def qat_problems(qat: dict, optimizer: dict | None = None, peft: dict | None = None, model: dict | None = None) -> list[str]:
    """What is wrong with a ``qat`` group (and its conflicts), one line each with the fix; ``[]`` if nothing.

    Refused: ``optimizer.step_in_backward`` (weights would be fake-quantised from already-stepped parameters), LoRA/QLoRA
    (QAT trains the full weights), Conv1D families, and a group size that does not divide the hidden size.
    """
    scheme = qat.get("scheme")
    if scheme not in SCHEMES:
        return [f"qat.scheme={scheme!r} is not one of {SCHEMES}; fix: qat=int8a_int4w or qat=none"]
    if scheme == "none":
        return []
    from .pruning import hidden_size_named, model_type_named

    problems = []
    group = qat.get("group_size")
    hidden = hidden_size_named(model) if model else None
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        problems.append(f"qat.group_size={group!r} must be a positive integer (input weights per int4 scale), e.g. qat.group_size=32")
    elif hidden is not None and hidden % group:
        problems.append(
            f"qat.group_size={group} does not divide the model's hidden size ({hidden}): the layers it does not divide would train "
            "unrounded; fix: qat.group_size=32 (or another divisor)"
        )
    if optimizer and optimizer.get("step_in_backward"):
        problems.append(
            "qat=int8a_int4w with optimizer.step_in_backward=true: the fake-quantised weights are derived from the parameters "
            "that step during backward; fix: optimizer.step_in_backward=false"
        )
    if peft and peft.get("method", "none") != "none":
        problems.append(f"qat=int8a_int4w with peft={peft.get('method')}: QAT trains the full weights it rounds; fix: peft=none")
    model_type = model_type_named(model) if model else None
    if model_type in CONV1D_MODEL_TYPES:
        problems.append(conv1d_refusal(f"qat={scheme}", model_type, "qat=none"))
    try:
        import torchao  # noqa: F401
    except ImportError:
        problems.append('qat=int8a_int4w needs torchao; fix: pip install -e ".[compress]"')
    return problems


def quantizable(model: nn.Module, group_size: int) -> Callable[[nn.Module, str], bool]:
    """``quantize_``'s ``filter_fn(module, fqn) -> bool``: an ``nn.Linear`` with ``in_features`` a multiple of ``group_size``
    (a group cannot straddle a row), except an LM head tied to the input embedding (swapping it would untie them)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and inputs is not None and head.weight is inputs.weight
    return lambda module, fqn: isinstance(module, nn.Linear) and module.in_features % group_size == 0 and not (tied and module is head)


def embedding_table(model: nn.Module) -> str | None:
    """The qualified name of the input embedding QAT rounds (int8 per row, as ``quantize`` stores it), or ``None`` when
    there is none or it is tied to the head."""
    get_inputs = getattr(model, "get_input_embeddings", None)
    table = get_inputs() if get_inputs is not None else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(table, nn.Embedding) or (head is not None and head.weight is table.weight):
        return None
    return next(fqn for fqn, module in model.named_modules() if module is table)


def embedding_config():
    """torchao's config of the embedding table: int8 weights, one scale per row (token)."""
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def base_config(qat: dict):
    """torchao's post-training config of the scheme: what ``convert`` and the ``ptq_int8a_int4w`` variant apply."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(qat["group_size"]))


def prepare_qat(model: nn.Module, qat: dict) -> int:
    """Swap the quantizable Linear layers and the input embedding (:func:`embedding_table`) for fake-quantised ones in
    place; return how many Linear layers were swapped.

    Raises:
        ConfigError: no Linear layer can take the scheme (none, or ``qat.group_size`` divides no ``in_features``).
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    from ..errors import ConfigError

    keep = quantizable(model, qat["group_size"])
    count = sum(keep(module, name) for name, module in model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not any(isinstance(module, nn.Linear) and module is not head for module in model.modules()):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type in CONV1D_MODEL_TYPES:
            raise ConfigError(conv1d_refusal(f"qat={qat['scheme']}", model_type, "qat=none"))
        raise ConfigError(f"qat={qat['scheme']}: {type(model).__name__} has no nn.Linear layer to fake-quantise; fix: qat=none")
    if count == 0:
        raise ConfigError(
            f"qat.group_size={qat['group_size']} divides the in_features of none of the model's Linear layers; fix: a smaller qat.group_size"
        )
    quantize_(model, QATConfig(base_config(qat), step="prepare"), filter_fn=keep)
    table = embedding_table(model)
    if table is not None:
        quantize_(model, QATConfig(embedding_config(), step="prepare"), filter_fn=lambda module, fqn: fqn == table)
    return count


def convert_qat(model: nn.Module, qat: dict) -> nn.Module:
    """Replace the fake-quantised layers by integer ones (int4 weights, int8 dynamic activations; int8 embedding) in place;
    return ``model``.  A plain model (QAT weights loaded without :func:`prepare_qat`) gets the scheme's PTQ: the same result.
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear, QATConfig

    keep, table = quantizable(model, qat["group_size"]), embedding_table(model)
    is_table = lambda module, fqn: fqn == table
    if any(isinstance(module, (FakeQuantizedLinear, FakeQuantizedEmbedding)) for module in model.modules()):
        quantize_(model, QATConfig(base_config(qat), step="convert"), filter_fn=keep)
        if table is not None:
            quantize_(model, QATConfig(embedding_config(), step="convert"), filter_fn=is_table)
    else:
        quantize_(model, base_config(qat), filter_fn=keep)
        if table is not None:
            quantize_(model, embedding_config(), filter_fn=is_table)
    return model
