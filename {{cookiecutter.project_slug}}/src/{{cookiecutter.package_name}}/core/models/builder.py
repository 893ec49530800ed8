"""Build the Hugging Face model a LightningModule wraps (shared by every task).

A model spec (``model`` config group, as a plain dict) either names pretrained weights
(``name_or_path``: hub name or local folder) or gives a ``config`` to build a randomly
initialised model (tests, pretraining).  Checkpoints store the full HF config, so evaluation
rebuilds the architecture from it without downloading or loading the pretrained weights again.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.pytorch_utils import Conv1D

from ..checkpoints.stored import tokenizer_file_problems
from ..data.tokenization import use_eos_as_pad
from ..errors import ConfigError


def build_sequence_classifier(
    spec: dict,
    id2label: dict[int, str],
    tokenizer: PreTrainedTokenizerBase,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    loading: dict | None = None,
    loading_info: dict | None = None,
    auto_class: type = AutoModelForSequenceClassification,
) -> PreTrainedModel:
    """An ``auto_class`` classifier (``AutoModelForSequenceClassification``: one label per row;
    ``AutoModelForTokenClassification``: one per token) with a fresh head of ``len(id2label)`` outputs.

    ``config.pad_token_id`` is the tokenizer's pad id (a decoder's classifier reads the logits
    at each row's rightmost non-pad token), also for pretrained weights whose ``config.json``
    names another or none; a tokenizer without a pad token gets its EOS as pad first
    (:func:`..data.tokenization.use_eos_as_pad`, done by the data module before this).

    Args:
        spec: ``name_or_path`` (pretrained) or ``config`` (from scratch: ``model_type`` plus
            architecture fields; ``vocab_size`` and ``pad_token_id`` are taken from ``tokenizer``,
            their one source).
        attn_implementation: HF's ``sdpa`` | ``flash_attention_2`` | ``eager`` (``attention`` group).
        dtype: of the weights (see :func:`.precision.weights_dtype`).
        loading: more ``from_pretrained`` options: QLoRA's 4-bit base (:func:`.adapters.quantized_loading`);
            pretrained weights only.
        loading_info: filled with ``from_pretrained``'s loading info (``missing_keys``: the
            weights drawn at random, e.g. the new head), pretrained weights only.

    Raises:
        ValueError: the spec gives neither ``name_or_path`` nor ``config``.
        DataError: the tokenizer has neither a pad nor an EOS token.
    """
    use_eos_as_pad(tokenizer)
    labels = {
        "num_labels": len(id2label),
        "id2label": dict(id2label),
        "label2id": {name: index for index, name in id2label.items()},
        "pad_token_id": tokenizer.pad_token_id,
    }
    if spec.get("config"):
        fields = dict(spec["config"])
        model_type = fields.pop("model_type")
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **fields, **labels)
        return auto_class.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if spec.get("name_or_path"):
        model, info = auto_class.from_pretrained(
            spec["name_or_path"],
            attn_implementation=attn_implementation,
            dtype=dtype,
            output_loading_info=True,
            **(loading or {}),
            **labels,
        )
        if loading_info is not None:
            loading_info.update(info)
        return model
    raise ValueError("model.name_or_path and model.config are both null; fix: set one (see configs/model/)")


def config_to_dict(config: PretrainedConfig) -> dict:
    """The HF config as plain JSON types (storable in a ``weights_only`` checkpoint): the
    architecture, without how it was loaded (QLoRA's ``quantization_config``)."""
    fields = json.loads(config.to_json_string(use_diff=False))
    fields.pop("quantization_config", None)
    return fields


def sequence_classifier_from_dict(
    config_dict: dict,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    auto_class: type = AutoModelForSequenceClassification,
) -> PreTrainedModel:
    """Rebuild the architecture stored by :func:`config_to_dict`, with random weights, as an
    ``auto_class`` model (see :func:`build_sequence_classifier`)."""
    fields = dict(config_dict)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return auto_class.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def tokenizer_to_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """The tokenizer's saved files as ``{file name: text}`` (stored inside checkpoints)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {name: Path(folder, name).read_text(encoding="utf-8") for name in sorted(os.listdir(folder))}


def tokenizer_from_files(files: dict[str, str]) -> PreTrainedTokenizerBase:
    """Inverse of :func:`tokenizer_to_files`: the files written into a temporary folder (each name
    checked to be a bare file name before the first is written) and loaded from there, with no
    remote code.

    Raises:
        ConfigError: a name that is not a bare file name, a value that is not text, a class path
            (``auto_map``) in a JSON file.
    """
    found = tokenizer_file_problems(files, "the stored tokenizer")
    if found:
        raise ConfigError(f"refused: {'; '.join(found)}; fix: a checkpoint written by this project's train")
    with tempfile.TemporaryDirectory() as folder:
        for name, text in files.items():
            Path(folder, name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


# Architectures whose position ids start after the padding index (RoBERTa's embeddings): the
# first ``pad_token_id + 1`` positions are never used, so roberta-base's 514 hold 512 tokens.
POSITIONS_AFTER_PADDING = {
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "data2vec-text",
    "roberta-prelayernorm",
    "longformer",
    "mpnet",
}


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence, in tokens, the architecture supports (``max_position_embeddings``,
    or GPT-2's ``n_positions``, less the offset of RoBERTa-style position ids); ``None`` when the
    config names no limit."""
    for field in ("max_position_embeddings", "n_positions"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            if config.model_type in POSITIONS_AFTER_PADDING:
                value -= (config.pad_token_id if isinstance(config.pad_token_id, int) else 1) + 1
            return value
    return None


def check_max_length(config: PretrainedConfig, max_length: int | None) -> None:
    """Refuse a ``data.max_length`` the architecture has no positions for (any task), before
    the data is tokenised or any weights load.

    Raises:
        ConfigError: ``max_length`` above :func:`max_positions`.
    """
    limit = max_positions(config)
    if max_length is not None and limit is not None and max_length > limit:
        raise ConfigError(
            f"data.max_length={max_length} is longer than this model's maximum positions ({limit}, "
            f"{config.model_type}); fix: data.max_length={limit} or less"
        )


def spec_config(spec: dict, tokenizer: PreTrainedTokenizerBase | None) -> PretrainedConfig:
    """The HF config a model spec describes (a causal LM's, or any other task's), read without
    loading any weights.

    From scratch (``config``), ``vocab_size`` and the BOS/EOS/pad ids follow the tokenizer
    (their one source; with ``tokenizer=None``, the architecture's defaults, enough for checks
    of positions and layer names); pretrained (``name_or_path``), the model's own ``config.json``.

    Raises:
        ValueError: the spec gives neither ``name_or_path`` nor ``config``.
    """
    if spec.get("config"):
        fields = dict(spec["config"])
        model_type = fields.pop("model_type")
        if tokenizer is None:
            return AutoConfig.for_model(model_type, **fields)
        token_ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        }
        return AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **token_ids, **fields)
    if spec.get("name_or_path"):
        return AutoConfig.from_pretrained(spec["name_or_path"])
    raise ValueError("model.name_or_path and model.config are both null; fix: set one (see configs/model/)")


def linear_layer_names(config: PretrainedConfig, auto_class: type = AutoModelForCausalLM) -> list[str]:
    """Names of the linear layers (``nn.Linear``, GPT-2's ``Conv1D``) of the architecture built
    by ``auto_class`` (the task's ``AutoModelFor*``), as dotted paths; found on the meta device,
    so no memory is used and no weights load."""
    with torch.device("meta"):
        model = auto_class.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))]
