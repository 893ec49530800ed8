"""The plumbing of causal language models, shared by every task that trains one: the spec's
checks against the architecture, the token loss (plain, chunked, Liger) as ``(loss_sum,
n_targets)``, the model's arguments for a batch, and the parts of a peft-wrapped model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel

from ...core.data.tokenization import IGNORE_INDEX
from ...core.errors import ConfigError
from ...core.models.adapters import check_adapter_spec, target_modules
from ...core.models.builder import check_max_length, linear_layer_names

# Bidirectional encoders: transformers maps some to a "*LMHeadModel", but they are not causal LMs.
ENCODER_ONLY = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "camembert", "modernbert")
# Config fields of model families whose logits are rescaled or capped after the lm_head (Gemma 2,
# Cohere, Granite): the chunked loss calls the lm_head directly and would skip that step.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_causal_spec(
    config: PretrainedConfig, spec: dict, peft: dict, precision: str, max_length: int | None, loss_implementation: str
) -> list[str]:
    """Check a causal LM's spec against its architecture ``config`` (no weights are read) and
    return the LoRA target modules (``[]`` for ``peft.method: none``).

    Args:
        config: the HF config the model will be built from.
        spec, peft: the ``model`` and ``peft`` groups (plain dicts).
        precision: Lightning's precision flag; max_length: tokens per row, or ``None``.
        loss_implementation: ``loss.implementation`` (plain | chunked | liger).

    Raises:
        ConfigError: an encoder-only model, ``max_length`` above its positions, a LoRA/QLoRA spec
            the model or precision cannot take, a target matching no linear layer, a chunked or
            Liger loss on a model that transforms its logits after the lm_head.
    """
    if config.model_type in ENCODER_ONLY:
        raise ConfigError(
            f"task=causal_lm needs a decoder, but the model is a {config.model_type} encoder "
            f"(model.name_or_path={spec.get('name_or_path')!r}); fix: a causal LM such as model=smollm2_135m, "
            "or task=classification"
        )
    check_max_length(config, max_length)
    check_adapter_spec(peft, spec, precision)
    transforms = [field for field in LOGIT_TRANSFORM_FIELDS if getattr(config, field, None) not in (None, 1.0)]
    if loss_implementation != "plain" and transforms:
        raise ConfigError(
            f"loss={loss_implementation} calls the lm_head directly, but {config.model_type} transforms its logits "
            f"afterwards ({', '.join(transforms)}); fix: loss=plain"
        )
    return target_modules(peft, config, linear_layer_names(config)) if peft.get("method", "none") != "none" else []


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of target tokens.

    Args:
        logits: ``(B, T, V)``; position ``t`` predicts token ``t + 1``.
        labels: ``(B, T)`` token ids, -100 where there is nothing to predict (padding).

    Returns:
        ``(loss_sum, n_targets)``: the loss summed over the ``n_targets`` positions whose label
        (after the shift) is not -100 (fp32 scalar), and that count (int64 scalar).
    """
    # Shift the labels left (the last position gets -100) instead of slicing the logits: a
    # slice of (B, T, V) logits would be copied to flatten it (0.2 GB at 1024 tokens x 49k vocab).
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (targets != IGNORE_INDEX).sum()


def chunked_token_loss_sum(
    hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_loss_sum` from the last hidden states, never holding the full logits.

    The lm_head and the cross-entropy run on ``chunk_size`` positions at a time, each chunk under
    non-reentrant activation checkpointing: forward keeps only the chunk's loss, backward
    recomputes one chunk's ``(B, chunk, V)`` logits at a time.  Peak logits memory falls from
    ``B*T*V`` to ``B*chunk*V`` values, and so for their bf16 copy and their gradient (fp32 logits
    of a 128k vocabulary at 2 x 2048 tokens: 1.96 GiB whole, 0.24 GiB per 256-position chunk),
    for one extra lm_head matmul per chunk.  The gradients are those of the plain loss (same
    sum of the same per-token terms).

    Args:
        hidden: ``(B, T, D)`` last hidden states of the transformer body.
        lm_head: the output projection ``D -> V`` (``get_output_embeddings()``).
        labels: ``(B, T)``, -100 where there is nothing to predict.
        chunk_size: positions per chunk (``loss.chunk_size``).

    Returns:
        ``(loss_sum, n_targets)`` as :func:`token_loss_sum`.
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T), shifted as in token_loss_sum
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], chunk_size):
        loss_sum = loss_sum + checkpoint(
            _chunk_loss, hidden[:, start : start + chunk_size], targets[:, start : start + chunk_size], lm_head, use_reentrant=False
        )
    return loss_sum, (targets != IGNORE_INDEX).sum()


def liger_token_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_loss_sum` through Liger Kernel's fused linear cross-entropy (Hsu et al.,
    "Liger Kernel", 2024): Triton kernels that compute the lm_head, the loss and its gradient
    chunk by chunk in the forward pass, so the logits are never stored.  CUDA only (checked by
    ``validate_config``); shapes as :func:`chunked_token_loss_sum`.  A plain ``nn.Linear`` lm_head
    only (a LoRA-wrapped lm_head would lose its adapter here)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T), shifted as in token_loss_sum
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    loss_sum = loss(lm_head.weight, hidden.flatten(0, 1), targets.flatten(), getattr(lm_head, "bias", None))
    return loss_sum.float(), (targets != IGNORE_INDEX).sum()


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    logits = lm_head(hidden)  # (B, chunk, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


# Written by export next to a chat model's weights: {"end_of_turn": token, "system_prompt": text or null}.


def model_arguments(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """The model's keyword arguments for a batch: ``input_ids`` with the padding
    ``attention_mask``, or for packed rows (:mod:`.chat`, ``mode=pack_rows``) with the
    per-row ``position_ids`` and no attention mask, from which transformers builds the
    block-diagonal causal mask (it does so only with no mask and no KV cache: ``use_cache=False``)."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


def causal_lm_of(model: torch.nn.Module) -> PreTrainedModel:
    """The ``*ForCausalLM`` inside ``model`` (itself, or under a peft wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def causal_body(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body (``LlamaModel``, ``GPT2Model``...): hidden states, no lm_head."""
    return causal_lm_of(model).base_model
