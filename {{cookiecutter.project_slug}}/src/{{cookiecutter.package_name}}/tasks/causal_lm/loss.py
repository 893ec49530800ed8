"""Causal-LM plumbing shared by the tasks that train one: the architecture checks, the token loss (plain, chunked,
Liger) as ``(loss_sum, n_targets)``, the model's arguments for a batch, and the parts of a peft-wrapped model."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel

from ...core.data.tokenization import IGNORE_INDEX
from ...core.errors import ConfigError
from ...core.run.distributed import uses_cuda

# Bidirectional encoders: transformers maps some to a "*LMHeadModel", but they are not causal LMs.
ENCODER_ONLY = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "camembert", "modernbert")
# Fields of families that rescale or cap logits after the lm_head (Gemma 2, Cohere, Granite): chunked losses skip that.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_causal_config(config: PretrainedConfig, spec: dict, loss_implementation: str) -> None:
    """Refuse what a causal LM's architecture ``config`` cannot train (no weights are read).

    Raises:
        ConfigError: an encoder-only model, or a chunked or Liger loss on a model that transforms
            its logits after the lm_head.
    """
    if config.model_type in ENCODER_ONLY:
        raise ConfigError(
            f"task=causal_lm needs a decoder, but the model is a {config.model_type} encoder "
            f"(model.name_or_path={spec.get('name_or_path')!r}); fix: a causal LM such as model=smollm2_135m, "
            "or task=classification"
        )
    transforms = [field for field in LOGIT_TRANSFORM_FIELDS if getattr(config, field, None) not in (None, 1.0)]
    if loss_implementation != "plain" and transforms:
        raise ConfigError(
            f"loss={loss_implementation} calls the lm_head directly, but {config.model_type} transforms its logits "
            f"afterwards ({', '.join(transforms)}); fix: loss=plain"
        )


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of ``logits`` ``(B, T, V)`` (position ``t`` predicts token ``t + 1``) against
    ``labels`` ``(B, T)`` (-100: nothing to predict); returns ``(loss_sum, n_targets)``, fp32 and int64 scalars."""
    # Shift the labels left, not the logits: a slice of (B, T, V) logits would be copied to flatten it.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (targets != IGNORE_INDEX).sum()


def chunked_token_loss_sum(
    hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_loss_sum` from the last hidden states ``(B, T, D)`` and ``lm_head`` (``D -> V``), never holding the
    full logits: each ``chunk_size`` positions run under non-reentrant checkpointing, so backward recomputes one
    ``(B, chunk, V)`` chunk at a time (logits memory ``B*T*V`` -> ``B*chunk*V``, for an extra lm_head matmul a chunk)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T), shifted as in token_loss_sum
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], chunk_size):
        loss_sum = loss_sum + checkpoint(
            _chunk_loss, hidden[:, start : start + chunk_size], targets[:, start : start + chunk_size], lm_head, use_reentrant=False
        )
    return loss_sum, (targets != IGNORE_INDEX).sum()


def liger_token_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_loss_sum` through Liger Kernel's fused linear cross-entropy (Hsu et al., "Liger Kernel", 2024), which
    never stores the logits; CUDA only, and a plain ``nn.Linear`` lm_head only (a LoRA one would lose its adapter)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T), shifted as in token_loss_sum
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    loss_sum = loss(lm_head.weight, hidden.flatten(0, 1), targets.flatten(), getattr(lm_head, "bias", None))
    return loss_sum.float(), (targets != IGNORE_INDEX).sum()


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    logits = lm_head(hidden)  # (B, chunk, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def model_arguments(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """The model's keyword arguments for a batch: ``input_ids`` with the padding ``attention_mask``, or for packed rows
    the per-row ``position_ids`` and no mask (transformers then builds the block-diagonal mask; only with ``use_cache=False``)."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


def causal_lm_of(model: torch.nn.Module) -> PreTrainedModel:
    """The ``*ForCausalLM`` inside ``model`` (itself, or under a peft wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def causal_body(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body (``LlamaModel``, ``GPT2Model``...): hidden states, no lm_head."""
    return causal_lm_of(model).base_model


def loss_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """The ``loss`` group: a chunk size for ``chunked``; ``liger`` needs CUDA and liger-kernel."""
    implementation, chunk_size = cfg.loss.implementation, cfg.loss.chunk_size
    if implementation == "plain":
        return []
    if implementation == "chunked" and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        return [f"loss.chunk_size={chunk_size!r} must be a positive integer (positions per chunk), e.g. loss.chunk_size=256"]
    if implementation == "liger" and runs_here and (importlib.util.find_spec("liger_kernel") is None or not uses_cuda(cfg)):
        return [
            'loss=liger needs a CUDA GPU and the liger-kernel package; fix: pip install -e ".[liger]" on a GPU '
            "machine, or loss=chunked (the same memory saving, in plain PyTorch)"
        ]
    return []
