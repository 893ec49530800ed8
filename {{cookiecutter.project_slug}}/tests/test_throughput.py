"""Throughput/MFU callback: the FLOPs formula on known models (full, tied, LoRA, 4-bit), the peak
table, and real tiny CPU fits of a causal LM and a BERT classifier."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
{%- if cookiecutter.tasks != "classification" %}
from peft import LoraConfig, get_peft_model  # a dependency of causal-LM projects only
{%- endif %}
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from {{ cookiecutter.package_name }}.core.callbacks import throughput
from {{ cookiecutter.package_name }}.core.callbacks.throughput import (
    TokenThroughput,
    architecture,
    count_parameters,
    flops_per_token,
    peak_tflops_for,
    resolve_peak_tflops,
)

from .conftest import RecordingLogger

# A tiny Llama with grouped-query attention: d=64, 2 layers, 4 query heads of 16, 2 KV heads.
D, FFN, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 96, 2, 4, 2, 16


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=64,
            tie_word_embeddings=tie,
        )
    )


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            type_vocab_size=2,
            num_labels=2,
        )
    )


# By hand: per layer q and o (d x d), k and v (d x 2·16), gate/up/down (3 x d x ffn), two RMSNorms;
# then the final norm and the LM head (V x d).  The input embedding is a lookup: not counted.
LLAMA_N = LAYERS * (2 * D * D + 2 * D * KV_HEADS * HEAD_DIM + 3 * D * FFN + 2 * D) + D + VOCAB * D


def test_flops_per_token_of_a_llama_matches_the_hand_count():
    model = tiny_llama()
    assert count_parameters(model) == (LLAMA_N, 0)
    assert sum(p.numel() for p in model.parameters()) == LLAMA_N + VOCAB * D  # only the embedding left out
    assert architecture(model.config) == (LAYERS, HEADS, HEAD_DIM)
    assert flops_per_token(*count_parameters(model), *architecture(model.config), 32) == 6 * LLAMA_N + 12 * LAYERS * HEADS * HEAD_DIM * 32


def test_a_tied_lm_head_is_counted_once():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(model) == (LLAMA_N, 0)  # the shared V x d matrix counts as the head's matmul


def test_bert_leaves_out_its_three_embedding_tables():
    model = tiny_bert()
    tables = (VOCAB + 64 + 2) * 32  # word, position, token type
    assert count_parameters(model) == (sum(p.numel() for p in model.parameters()) - tables, 0)
    assert architecture(model.config) == (2, 4, 8)  # no head_dim in BertConfig: hidden / heads
{%- if cookiecutter.tasks != "classification" %}


def test_lora_counts_adapters_as_trainable_and_the_base_as_frozen():
    rank = 4
    model = get_peft_model(tiny_llama(), LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    # q: A (r x d) + B (d x r); v: A (r x d) + B (kv·hd x r); per layer
    adapters = LAYERS * (rank * D + D * rank + rank * D + KV_HEADS * HEAD_DIM * rank)
    trainable, frozen = count_parameters(model)
    assert (trainable, frozen) == (adapters, LLAMA_N)
    assert trainable == model.get_nb_trainable_parameters()[0]  # peft's own count agrees
    assert architecture(throughput.hf_config_of(model)) == (LAYERS, HEADS, HEAD_DIM)
    # frozen weights skip their weight gradient: 4 FLOPs per parameter and token, not 6
    assert (
        flops_per_token(trainable, frozen, LAYERS, HEADS, HEAD_DIM, 16) == 6 * adapters + 4 * LLAMA_N + 12 * LAYERS * HEADS * HEAD_DIM * 16
    )
{%- endif %}


def test_a_4bit_weight_counts_its_full_shape():
    layer = torch.nn.Linear(8, 6, bias=False)
    packed = torch.nn.Parameter(torch.zeros(24, 1, dtype=torch.uint8), requires_grad=False)  # 48 values, 2 per byte
    packed.quant_state = SimpleNamespace(shape=torch.Size([6, 8]))  # as bitsandbytes' Params4bit carries it
    layer.weight = packed
    assert count_parameters(layer) == (0, 48)


def test_peak_table_matches_device_names_exactly_enough():
    assert peak_tflops_for("NVIDIA GeForce RTX 4090") == 165.2
    assert peak_tflops_for("NVIDIA GeForce RTX 3090") == 71.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for("NVIDIA A100 80GB PCIe") == 312.0
    assert peak_tflops_for("NVIDIA A10G") == 70.0
    assert peak_tflops_for("NVIDIA A10") == 125.0
    assert peak_tflops_for("NVIDIA L4") == 121.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA H200") == 989.4
    # look-alikes with other peaks are unknown, not mismatched
    for other in ("NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D", "NVIDIA L40S", "NVIDIA H100 NVL", "Tesla T4"):
        assert peak_tflops_for(other) is None, other


def test_resolving_the_peak(monkeypatch):
    assert resolve_peak_tflops(torch.device("cpu"), 165.2)[0] is None  # no MFU on a CPU, whatever is configured
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    assert resolve_peak_tflops(cuda, None) == (165.2, None)
    assert resolve_peak_tflops(cuda, 165.2) == (165.2, None)
    peak, message = resolve_peak_tflops(cuda, 100.0)
    assert peak == 100.0 and "165.2" in message  # configured wins, the mismatch is said
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    peak, message = resolve_peak_tflops(cuda, None)
    assert peak is None and "hardware.peak_tflops" in message


# ------------------------------------------------------------------------- real CPU fits
SEQ_LEN, REAL_TOKENS = 8, 5  # every sequence: 5 real tokens, 3 padding


class HFTask(L.LightningModule):
    """A Hugging Face model whose forward returns its own loss from the batch's labels."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def padded_batches(kind: str, n: int = 24) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(SEQ_LEN, dtype=torch.long)
    mask[:REAL_TOKENS] = 1  # right padding
    rows = []
    for _ in range(n):
        input_ids = torch.randint(1, VOCAB, (SEQ_LEN,), generator=generator) * mask
        labels = input_ids.masked_fill(mask == 0, -100) if kind == "llama" else torch.randint(0, 2, (), generator=generator)
        rows.append({"input_ids": input_ids, "attention_mask": mask.clone(), "labels": labels})
    return DataLoader(rows, batch_size=2)  # (B=2, T=8) dicts


def fit(kind: str, callback: TokenThroughput) -> tuple[RecordingLogger, HFTask]:
    module = HFTask(tiny_llama() if kind == "llama" else tiny_bert())
    logger = RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        accumulate_grad_batches=2,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        log_every_n_steps=1,
    )
    trainer.fit(module, padded_batches(kind))
    return logger, module


def perf_records(logger: RecordingLogger) -> list[tuple[int, dict]]:
    return [(step, metrics) for step, metrics in logger.records if any(k.startswith("perf/") for k in metrics)]


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_cpu_fit_logs_rates_without_mfu_and_says_why_once(kind, caplog):
    with caplog.at_level(logging.INFO, logger=throughput.__name__):
        logger, module = fit(kind, TokenThroughput(every_n_steps=2, peak_tflops=165.2))
    records = perf_records(logger)
    # the clock starts after optimizer step 1; then rows of steps numbered 2 and 4 (Lightning's
    # numbering: optimizer steps 3 and 5, the last); nothing left for the end of training
    assert [step for step, _ in records] == [2, 4]
    expected_flops = flops_per_token(*count_parameters(module), *architecture(module.model.config), SEQ_LEN)
    for _, metrics in records:
        assert set(metrics) == {"perf/tokens_per_sec", "perf/samples_per_sec", "perf/tflops"}
        assert metrics["perf/tokens_per_sec"] > 0
        # the clock cancels out: real tokens per sample, and FLOPs per real token
        assert metrics["perf/tokens_per_sec"] / metrics["perf/samples_per_sec"] == pytest.approx(REAL_TOKENS)
        assert metrics["perf/tflops"] * 1e12 / metrics["perf/tokens_per_sec"] == pytest.approx(expected_flops)
    [message] = [r.getMessage() for r in caplog.records if r.name == throughput.__name__]
    assert "cpu" in message and "mfu" in message


def test_a_run_shorter_than_the_period_still_logs_its_rates_at_the_end():
    logger, _ = fit("bert", TokenThroughput(every_n_steps=50))
    [(step, metrics)] = perf_records(logger)  # optimizer steps 2-5 (the clock starts after step 1), once
    assert step == 4 and metrics["perf/tokens_per_sec"] / metrics["perf/samples_per_sec"] == pytest.approx(REAL_TOKENS)


def test_mfu_is_model_flops_over_the_peak(monkeypatch):
    # Pretend the CPU is a GPU with a 1 GFLOP/s peak (1e-3 TFLOP/s), so MFU is logged.
    monkeypatch.setattr(throughput, "resolve_peak_tflops", lambda device, configured: (1e-3, None))
    logger, _ = fit("llama", TokenThroughput(every_n_steps=2))
    records = perf_records(logger)
    assert len(records) == 2
    for _, metrics in records:
        assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tflops"] / 1e-3)


@pytest.mark.parametrize("held", [1, 3, 64])
def test_held_masks_count_the_real_tokens_and_flops_of_every_length_as_at_once(monkeypatch, held):
    # The masks are summed later (at the log, and every HELD_MASKS masks), grouped by length:
    # the same tokens and FLOPs (each at its own T) as summing every micro-batch at once.
    monkeypatch.setattr(throughput, "HELD_MASKS", held)
    callback = TokenThroughput(every_n_steps=1)
    callback.flops_args = (1000, 200, 2, 4, 16)  # trainable, frozen, layers, heads, head_dim
    generator = torch.Generator().manual_seed(0)
    tokens = flops = 0.0
    for length in [8, 8, 12, 8, 5, 12, 12]:
        mask = torch.randint(0, 2, (3, length), generator=generator)
        callback._count({"input_ids": torch.ones(3, length, dtype=torch.long), "attention_mask": mask})
        tokens += int(mask.sum())
        flops += int(mask.sum()) * flops_per_token(*callback.flops_args, length)
    callback._fold()
    assert int(callback._window_tokens) == tokens and callback._window_samples == 21
    assert float(callback._window_flops) == pytest.approx(flops)


def test_batches_without_input_ids_are_refused():
    with pytest.raises(ValueError, match="input_ids"):
        TokenThroughput(every_n_steps=1)._count((torch.zeros(2, 4), torch.zeros(2)))
    with pytest.raises(ValueError, match="every_n_steps=0"):
        TokenThroughput(every_n_steps=0)
