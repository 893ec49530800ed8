"""A Llama-family causal LM (weights, tokenizer, chat template) as one GGUF file for llama.cpp, Ollama and LM Studio.

Written with the ``gguf`` package's public writer (``GGUFWriter``, ``SpecialVocab``, ``quants.quantize``, the tensor name
map), so no llama.cpp build is needed to export.  What llama.cpp reads and how (the GGUF spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; llama.cpp's ``src/llama-vocab.cpp`` for the pre-tokenizer names):

- the architecture's hyper-parameters under ``llama.*``; RoPE's base, and Llama 3's frequency scaling as the
  ``rope_freqs.weight`` tensor (one factor per frequency: Meta's Llama 3.1 ``apply_scaling``);
- Q and K projections in GGML's interleaved RoPE layout: Hugging Face's rotate-half rows are permuted back (transformers'
  GGUF reader undoes the same permutation on load);
- the byte-level BPE tokenizer: tokens, their types (added special tokens CONTROL, other added tokens USER_DEFINED),
  merges, the pre-tokenizer llama.cpp must run (named from the tokenizer's own pre-tokenizer, :data:`PRE_TOKENIZERS`),
  BOS/EOS/UNK/pad ids, whether BOS is prepended (as the tokenizer did in training) and the chat template the run
  trained with; a chat model's end-of-turn token is its EOS and EOT.

Anything it cannot write faithfully is refused before a byte is written (:func:`gguf_problems`).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # (transformers' modeling module imports torchao, which logs as it loads: export imports this file early)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# gguf.type -> the GGML type name; 1-D tensors (norms) and rope_freqs are always F32, as llama.cpp's converter writes them.
GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
# Transformers model types written as llama.cpp's ``llama`` architecture (same tensors and RoPE).
ARCHITECTURES = {"llama": "llama"}
# The Llama 3 tokenizer's split pattern (tokenizer.json of meta-llama/Llama-3.1-8B, a ``Split`` pre-tokenizer).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokenizer (``tokenizer.ggml.pre``), or ``None`` for one it has no name for.

    ``gpt-2``: byte-level with GPT-2's split pattern (what transformers builds from the demo model's GGUF file);
    ``smollm``: digits split one by one, then GPT-2's (SmolLM2 on the Hub); ``llama-bpe``: Llama 3's pattern.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]

    def byte_level(regex: bool) -> bool:
        return steps[-1].get("use_regex", True) is regex and not steps[-1].get("add_prefix_space", False)

    if kinds == ["ByteLevel"] and byte_level(regex=True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level(regex=True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and byte_level(regex=False) and steps[0].get("pattern", {}).get("Regex") == LLAMA3_PATTERN:
        return "llama-bpe"
    return None


def gguf_problems(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, type_name: str) -> list[str]:
    """What keeps ``model``/``tokenizer`` from being written as a faithful GGUF file of ``type_name`` (empty: nothing)."""
    config, problems = model.config, []
    if type_name not in GGUF_TYPES:
        problems.append(f"outtype={type_name!r} is not one of {sorted(GGUF_TYPES)}; fix: outtype=f16 (or q8_0 for half the size)")
    if config.model_type not in ARCHITECTURES:
        problems.append(
            f"the model is a {config.model_type!r} ({type(model).__name__}); the GGUF writer knows the Llama family "
            f"({sorted(ARCHITECTURES)}: SmolLM2, Llama 3.x); fix: format=hf and llama.cpp's convert_hf_to_gguf.py on that folder"
        )
    if getattr(config, "quantization_config", None) is not None:
        problems.append("the weights are quantized (bitsandbytes); fix: export format=hf (adapters merged into the fp32 base) first")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        problems.append(f"RoPE scaling {rope.get('rope_type')!r} has no GGUF form here (default, linear, llama3); fix: format=hf")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [*problems, f"the tokenizer ({type(tokenizer).__name__}) is not a fast tokenizer; fix: format=hf"]
    described = json.loads(backend.to_str())
    model_kind, decoder = described.get("model", {}), described.get("decoder") or {}
    if model_kind.get("type") != "BPE" or model_kind.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        problems.append("the tokenizer is not a byte-level BPE (GPT-2 style); the writer describes only those; fix: format=hf")
    elif described.get("normalizer") is not None:
        problems.append(f"the tokenizer has a normalizer ({described['normalizer'].get('type')}) llama.cpp would not run; fix: format=hf")
    elif pre_tokenizer_name(described) is None:
        problems.append(
            f"the tokenizer's pre-tokenizer {json.dumps(described.get('pre_tokenizer'))[:200]} has no llama.cpp name here "
            "(gpt-2, smollm, llama-bpe); fix: format=hf"
        )
    return problems


def rope_factors(config) -> np.ndarray | None:
    """Llama 3's per-frequency RoPE divisors (``rope_freqs.weight``, shape ``(head_dim // 2,)``), ``None`` without that scaling.

    Source: Meta's Llama 3.1 reference ``apply_scaling`` (wavelengths above ``original / low_freq_factor`` are slowed by
    ``factor``, below ``original / high_freq_factor`` kept, in between interpolated); llama.cpp divides each frequency by it.
    """
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, original = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def to_ggml_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Q/K projection rows ``(heads * head_dim, hidden)`` from Hugging Face's rotate-half order to GGML's interleaved one:
    within each head, row ``j`` of the first half and row ``j`` of the second become rows ``2j`` and ``2j + 1``."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    type_name: str,
    name: str,
    end_of_turn: str | None = None,
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (plain, unquantized weights) and ``tokenizer`` to the GGUF file ``path``.

    ``type_name``: a :data:`GGUF_TYPES` key for every 2-D weight (a row length that is not a multiple of the type's block
    falls back to F16, as llama.cpp's converter does); ``tensor_types``: GGUF tensor name -> GGML type name, overriding it
    per tensor (the round-trip test hands the original file's types). ``end_of_turn``: a chat model's end-of-turn token.

    Raises:
        ValueError: :func:`gguf_problems` found something (checked before anything is written).
    """
    import gguf

    problems = gguf_problems(model, tokenizer, type_name)
    if problems:
        raise ValueError("cannot write a faithful GGUF file:\n  - " + "\n  - ".join(problems))
    config = model.config
    writer = gguf.GGUFWriter(path, ARCHITECTURES[config.model_type])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{GGUF_TYPES[type_name]}", gguf.LlamaFileType.ALL_F32))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.rope_parameters.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(config.rope_parameters["factor"]))
    add_tokenizer(writer, tokenizer, config.vocab_size, end_of_turn)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tensors(writer, model, type_name, tensor_types or {})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer, tokenizer: PreTrainedTokenizerBase, vocab_size: int, end_of_turn: str | None) -> None:
    """Tokens, types, merges, special ids, BOS use and chat template (``gguf.SpecialVocab`` on the saved tokenizer files)."""
    import gguf

    described = json.loads(tokenizer.backend_tokenizer.to_str())
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = {int(index): token for index, token in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for index in range(vocab_size):  # ids the tokenizer lacks (a padded embedding) are llama.cpp's UNUSED placeholders
        if index not in by_id:
            tokens.append(f"[PAD{index}]"), types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index]), types.append(gguf.TokenType.NORMAL)
    writer.add_add_space_prefix(False)  # byte-level BPE: a word's leading space is its own byte
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(described))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as folder:  # SpecialVocab reads the files transformers saves
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    probe = tokenizer("a")["input_ids"]  # what training fed the model: BOS first or not
    special.add_special_token = {"bos": bool(probe) and probe[0] == tokenizer.bos_token_id and tokenizer.bos_token_id is not None}
    special.chat_template = tokenizer.chat_template  # the template the run trained with (export set it on the tokenizer)
    if end_of_turn is not None:
        special.special_token_ids["eos"] = special.special_token_ids["eot"] = tokenizer.convert_tokens_to_ids(end_of_turn)
    special.add_to_gguf(writer, quiet=True)


def add_tensors(writer, model: PreTrainedModel, type_name: str, tensor_types: dict[str, str]) -> None:
    """Every weight under its GGUF name (tied output weights once, as ``token_embd``), Q/K in GGML's RoPE layout."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    factors = rope_factors(config)
    if factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for the weight {hf_name!r}; fix: format=hf")
        weight = tensor.detach().to("cpu", torch.float32)
        if hf_name.endswith("q_proj.weight"):
            weight = to_ggml_rope(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = to_ggml_rope(weight, config.num_key_value_heads)
        data = weight.numpy()
        qtype = gguf.GGMLQuantizationType[tensor_types.get(name, GGUF_TYPES[type_name] if data.ndim == 2 else "F32")]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if data.shape[-1] % block:
            qtype = gguf.GGMLQuantizationType.F16
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
