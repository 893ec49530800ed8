"""The GGUF writer (tasks/causal_lm/gguf_file.py) read back by transformers' GGUF reader, on tiny random Llamas: a
SmolLM2-shaped one (GPT-2 byte-level tokenizer, tied embeddings) and a Llama-3-shaped one (``llama3`` RoPE scaling, Llama
3's pre-tokenizer, untied).  The round trip of the real demo file is tests/real_data/test_demo_causal_lm.py; llama.cpp
itself reads these files in tests/llama_cpp/ (its own tier)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from {{ cookiecutter.package_name }}.tasks.causal_lm.gguf_file import LLAMA3_PATTERN, gguf_problems, rope_factors, write_gguf

from .conftest import byte_level_bpe, lm_documents, tiny_llama_config

# Largest |logit difference| through transformers' GGUF reader, per weight type (tiny random Llamas, logits of order 1;
# measured on both: f32 0, f16 3.4e-4, bf16 2.4e-3, q8_0 6.3e-3); top-1 must agree at >= 90 % of the positions.
TOLERANCE = {"f32": 1e-6, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2}


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Llama 3's pre-tokenizer (the split pattern, then byte-level without its own regex)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lm_documents(200, seed=0), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def tiny_model(kind: str):
    """``(model, tokenizer)``: ``smollm`` (tied, GPT-2 pre-tokenizer) or ``llama3`` (untied, llama3 RoPE, head_dim 32)."""
    torch.manual_seed(0)
    if kind == "smollm":
        tokenizer = byte_level_bpe(lm_documents(200, seed=0), ["<|endoftext|>"], eos_token="<|endoftext|>", bos_token="<|endoftext|>")
        config = tiny_llama_config(len(tokenizer), tie_word_embeddings=True)
    else:
        tokenizer = llama3_tokenizer()
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = tiny_llama_config(len(tokenizer), tie_word_embeddings=False, rope_parameters=rope, num_attention_heads=2)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="module", params=["smollm", "llama3"])
def tiny(request):
    return (request.param, *tiny_model(request.param))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # (1, T, V)


@pytest.mark.parametrize("type_name", list(TOLERANCE))
def test_the_file_read_by_transformers_gives_the_models_logits(tiny, type_name, tmp_path):
    kind, model, tokenizer = tiny
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf", type_name, "tiny")
    # transformers' reader takes no Llama 3 RoPE scaling from a file (it reads rope.freq_base only): the llama3 model's
    # tensors are read with its own config; rope_freqs is checked against transformers' scaled frequencies below.
    extra = {"config": model.config} if kind == "llama3" else {}
    reread = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32, **extra).eval()
    ids = torch.tensor([tokenizer("the king speaks to a fool, and 2024 fools answer him.")["input_ids"]])
    expected, got = logits(model, ids), logits(reread, ids)
    difference = (got - expected).abs().max().item()
    print(f"{kind} {type_name}: max |logit difference| {difference:.2e}")
    assert difference <= TOLERANCE[type_name], difference
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_the_metadata_carries_what_llama_cpp_reads(tiny, tmp_path):
    kind, model, tokenizer = tiny
    reader = GGUFReader(write_gguf(model, tokenizer, tmp_path / "m.gguf", "q8_0", "tiny", end_of_turn=None))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    config = model.config
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == config.num_hidden_layers and field("llama.context_length") == config.max_position_embeddings
    assert field("llama.attention.head_count_kv") == config.num_key_value_heads
    assert field("llama.rope.freq_base") == pytest.approx(config.rope_parameters["rope_theta"])
    assert field("tokenizer.ggml.pre") == {"smollm": "gpt-2", "llama3": "llama-bpe"}[kind]
    assert field("tokenizer.ggml.tokens") == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("tokenizer.ggml.add_bos_token") == (tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id)
    types = field("tokenizer.ggml.token_type")
    assert types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.NORMAL
    names = {tensor.name for tensor in reader.tensors}
    assert ("output.weight" in names) is (kind == "llama3")  # tied embeddings are written once, as token_embd
    by_type = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert by_type["blk.0.attn_q.weight"] == "Q8_0" and by_type["blk.0.attn_norm.weight"] == "F32"
    if kind == "llama3":  # rope_freqs: transformers' own llama3 frequencies are the default ones divided by these factors
        freqs = next(tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight")
        head_dim = config.hidden_size // config.num_attention_heads
        default = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        scaled = model.model.rotary_emb.inv_freq.double()
        np.testing.assert_allclose(np.asarray(freqs.data), (default / scaled).numpy(), rtol=1e-5)
        assert len(set(np.asarray(freqs.data).round(4))) > 2  # kept, slowed and interpolated frequencies all present
    else:
        assert rope_factors(config) is None


def test_a_chat_models_end_of_turn_is_its_eos_and_eot_and_its_template_is_the_trained_one(tmp_path):
    model, tokenizer = tiny_model("smollm")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    model.resize_token_embeddings(len(tokenizer))
    tag, value = ("{" + "%", "%" + "}"), ("{" + "{", "}" + "}")  # (this file is a Jinja template of the cookiecutter)
    template = f"{tag[0]} for m in messages {tag[1]}<|im_start|>{value[0]} m['role'] {value[1]}\n{value[0]} m['content'] {value[1]}<|im_end|>\n{tag[0]} endfor {tag[1]}"
    tokenizer.chat_template = template
    reader = GGUFReader(write_gguf(model, tokenizer, tmp_path / "chat.gguf", "f16", "tiny", end_of_turn="<|im_end|>"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == end == reader.fields["tokenizer.ggml.eot_token_id"].contents()
    assert reader.fields["tokenizer.chat_template"].contents() == template


def test_what_it_cannot_write_faithfully_is_refused_before_writing(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tokenizer = tiny_model("smollm")
    assert gguf_problems(model, tokenizer, "f16") == []
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    assert any("'gpt2'" in p and "fix: format=hf" in p for p in gguf_problems(gpt2, tokenizer, "f16"))
    assert any("outtype='q2_k'" in p for p in gguf_problems(model, tokenizer, "q2_k"))
    described = json.loads(tokenizer.backend_tokenizer.to_str())
    described["pre_tokenizer"] = {"type": "Whitespace"}
    from tokenizers import Tokenizer

    odd = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(described)), eos_token="<|endoftext|>")
    problems = gguf_problems(model, odd, "f16")
    assert len(problems) == 1 and "Whitespace" in problems[0] and "no llama.cpp name" in problems[0]
    with pytest.raises(ValueError, match="no llama.cpp name"):
        write_gguf(model, odd, tmp_path / "odd.gguf", "f16", "tiny")
    assert not (tmp_path / "odd.gguf").exists()
