"""Build the Hugging Face model a task module wraps.

A spec (the ``model`` group) names pretrained weights (``name_or_path``) or gives a ``config`` for random weights.
Checkpoints store the full HF config, so eval rebuilds the architecture without the pretrained weights.
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
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.pytorch_utils import Conv1D

from ..checkpoints.stored import tokenizer_file_problems
from ..errors import ConfigError


def config_to_dict(config: PretrainedConfig) -> dict:
    """The HF config as JSON types (for a ``weights_only`` checkpoint), without QLoRA's ``quantization_config``."""
    fields = json.loads(config.to_json_string(use_diff=False))
    fields.pop("quantization_config", None)
    return fields


def tokenizer_to_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """The tokenizer's saved files as ``{file name: text}`` (stored inside checkpoints)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {name: Path(folder, name).read_text(encoding="utf-8") for name in sorted(os.listdir(folder))}


def tokenizer_from_files(files: dict[str, str]) -> PreTrainedTokenizerBase:
    """Inverse of :func:`tokenizer_to_files`, via a temporary folder, with no remote code.

    Raises:
        ConfigError: a name that is not a bare file name, a value that is not text, an ``auto_map`` in a JSON file.
    """
    found = tokenizer_file_problems(files, "the stored tokenizer")
    if found:
        raise ConfigError(f"refused: {'; '.join(found)}; fix: a checkpoint written by this project's train")
    with tempfile.TemporaryDirectory() as folder:
        for name, text in files.items():
            Path(folder, name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


# Position ids start after the padding index (RoBERTa's embeddings): roberta-base's 514 positions hold 512 tokens.
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
    """The longest sequence, in tokens, the architecture supports; ``None`` when the config names no limit."""
    for field in ("max_position_embeddings", "n_positions"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            if config.model_type in POSITIONS_AFTER_PADDING:
                value -= (config.pad_token_id if isinstance(config.pad_token_id, int) else 1) + 1
            return value
    return None


def check_max_length(config: PretrainedConfig, max_length: int | None) -> None:
    """Refuse a ``data.max_length`` the architecture has no positions for.

    Raises:
        ConfigError: ``max_length`` above :func:`max_positions`.
    """
    limit = max_positions(config)
    if max_length is not None and limit is not None and max_length > limit:
        raise ConfigError(
            f"data.max_length={max_length} is longer than this model's maximum positions ({limit}, "
            f"{config.model_type}); fix: data.max_length={limit} or less"
        )


def spec_config(spec: dict, tokenizer: PreTrainedTokenizerBase | None, **fields: object) -> PretrainedConfig:
    """The HF config a spec describes, without weights; from scratch, vocab size and special ids follow ``tokenizer``.

    Raises:
        ValueError: the spec gives neither ``name_or_path`` nor ``config``.
    """
    if spec.get("config"):
        given = dict(spec["config"])
        model_type = given.pop("model_type")
        if tokenizer is not None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
            given = {**given, **ids, "pad_token_id": pad}
        return AutoConfig.for_model(model_type, **{**given, **fields})
    if spec.get("name_or_path"):
        return AutoConfig.from_pretrained(spec["name_or_path"], **fields)
    raise ValueError("model.name_or_path and model.config are both null; fix: set one (see configs/model/)")


def linear_layer_names(config: PretrainedConfig, auto_class: type = AutoModelForCausalLM) -> list[str]:
    """Dotted names of the linear layers (``nn.Linear``, GPT-2's ``Conv1D``), found on the meta device (no memory)."""
    with torch.device("meta"):
        model = auto_class.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))]
