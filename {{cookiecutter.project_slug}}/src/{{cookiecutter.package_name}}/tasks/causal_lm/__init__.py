"""Causal language modelling (pretraining, full fine-tuning, LoRA/QLoRA) on raw text or chat rows: :class:`.module.CausalLMModule`,
data :class:`.text.TextDataModule` or :class:`.chat.ChatDataModule` (configs/task/causal_lm.yaml)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.compress.quantization import TORCHAO_VARIANTS
from ...core.models.levers import MASK_FREE_ATTENTION
from ...core.task import Task, module_class, to_device

# Values of the causal-LM groups (checked here, before anything imports the task's code).

# Positions per chunk the planner suggests for loss=chunked (the loss group's default).
CHUNKED_LOSS_POSITIONS = 256


class CausalLM(Task):
    """Next-token prediction; the loss is summed over the target tokens (labels -100 elsewhere)."""

    loss_implementations = ("plain", "chunked", "liger")
    quantize_variants = ("fp32", *TORCHAO_VARIANTS, "nf4")
    latency_batch_size = 8
    quality = {"perplexity": "min"}
    reads_exported_folders = True
    export_formats = ("hf", "gguf")
    scores_test_split_only = False
    shaping_keys = (
        "data.max_length",
        "data.truncation",
        "data.chat_template",
        "data.end_of_turn",
        "data.system_prompt",
        "data.columns",
        "data.roles",
    )
    identity_keys = {
        "model": ("data.chat_template", "data.end_of_turn", "data.system_prompt"),
        "data": (
            "data.text_column",
            "data.sample_by",
            "data.mode",
            "data.train_on",
            "data.truncation",
            "data.val_fraction",
            "data.val_split_seed",
            "data.mix_ratios",
            "data.mix_until",
            "data.mix_seed",
        ),
    }

    def data_problems(self, data: DictConfig) -> list[str]:
        problems = []
        if "train_on" in data:  # data=chat: the rows' columns are fixed (messages, or prompt/completion)
            from .chat import CHAT_MODES, TRAIN_ON, TRUNCATION, mix_problems

            for field, allowed in (("mode", CHAT_MODES), ("train_on", TRAIN_ON), ("truncation", TRUNCATION)):
                if data.get(field) not in allowed:
                    problems.append(f"data.{field}={data.get(field)!r} is not one of {allowed}; fix: data.{field}={' or '.join(allowed)}")
            return problems + mix_problems(dict(data.get("splits") or {}), data.get("mix_ratios"), data.get("mix_until", "first_exhausted"))
        from .text import MODES, SAMPLE_BY

        if not isinstance(data.get("text_column"), str) or not data.get("text_column"):
            problems.append(f"data.text_column={data.get('text_column')!r} must name a column of your data, e.g. data.text_column=text")
        if data.get("mode") not in MODES:
            problems.append(f"data.mode={data.get('mode')!r} is not one of {MODES}; fix: data.mode=pack (pretraining) or pad")
        if data.get("sample_by") not in SAMPLE_BY:
            problems.append(f"data.sample_by={data.get('sample_by')!r} is not one of {SAMPLE_BY}")
        return problems

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        from .loss import loss_problems
        from .neftune import neftune_problems

        return neftune_problems(cfg) + (loss_problems(cfg, runs_here) if "loss" in cfg else [])

    def memory_phases(self, cfg: DictConfig, config, micro_batch: int, value_bytes: int) -> dict[str, dict]:
        """``callbacks=benchmarks``: the lm-eval pass at each validation (:func:`.benchmarks.benchmark_phase`)."""
        settings = (cfg.get("callbacks") or {}).get("benchmarks")
        if settings is None:
            return {}
        from .benchmarks import benchmark_phase

        return {"lm-eval": benchmark_phase(settings, config, value_bytes)}

    def benchmark(self, cfg: DictConfig, load, run_dir: Path) -> dict:
        from .benchmarks import evaluate_benchmarks

        return evaluate_benchmarks(cfg, load, run_dir)

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        batch = super().example_batch(cfg, vocab_size, micro_batch)
        attention = cfg.attention.implementation if "attention" in cfg else "sdpa"
        if cfg.data.mode == "pack_rows" and attention in MASK_FREE_ATTENTION:
            # flash-attn (varlen) and flex (block mask) need no dense mask: traced as SDPA with none (is_causal path).
            batch = {"input_ids": batch["input_ids"], "attention_mask": None}
        elif cfg.data.mode == "pack_rows":
            # Per-row position ids, no mask: the trace holds the dense block-diagonal (B, 1, T, T) mask of SDPA/eager (2 rows a block).
            positions = torch.arange(cfg.data.max_length) % -(-cfg.data.max_length // 2)
            batch = {"input_ids": batch["input_ids"], "position_ids": positions.expand(micro_batch, -1)}
        return {**batch, "labels": batch["input_ids"]}

    def planned_model(self, module, cfg: DictConfig, config, precision: str) -> tuple[torch.nn.Module, list[int]]:
        if module.loss_implementation == "liger":  # Triton: no CPU; traced as the chunked loss
            module.hparams.loss = {"implementation": "chunked", "chunk_size": liger_chunk_positions(config, cfg.data.max_length)}
        model = module.build_model(precision, config=config)
        module.model = model
        return model, quantized_weights(model) if module.peft_method == "qlora" else []

    def memory_advice(self, cfg: DictConfig, weights_dominate: bool) -> tuple[dict[str, dict], list[str]]:
        tried = {}
        if cfg.loss.implementation == "plain":
            tried["loss=chunked"] = {"loss.implementation": "chunked", "loss.chunk_size": CHUNKED_LOSS_POSITIONS}
        told = []
        if cfg.peft.method != "qlora" and weights_dominate:
            told.append("peft=lora or peft=qlora (the weights, not the activations, dominate; plan it to see)")
        return tried, told

    def after_test(self, module, datamodule, trainer, predictions: Path, split: str, key: str) -> dict:
        if not hasattr(datamodule, "answer_prompts"):  # raw text: no answers to match (chat data has them)
            return {}
        from .answers import answer_metrics

        return answer_metrics(module, datamodule, predictions, trainer, split, key)

    def timing_inputs(self, input_ids: torch.Tensor, sample: dict[str, torch.Tensor]) -> dict[str, object]:
        # One forward over the batch (prefill), no KV cache kept.
        return {**super().timing_inputs(input_ids, sample), "use_cache": False}

    def score(self, forward: Callable[[dict], torch.Tensor], loader, device: str, datamodule) -> dict[str, float]:
        """``perplexity`` = exp(the NLL summed over every target token of the split / their count)."""
        from .loss import model_arguments, token_loss_sum

        total, count = 0.0, 0
        with torch.inference_mode():
            for batch in loader:
                logits = forward(to_device(model_arguments(batch), device))  # (B, T, V)
                loss_sum, targets = token_loss_sum(logits.float().cpu(), batch["labels"])
                total, count = total + float(loss_sum), count + int(targets)
        return {"perplexity": math.exp(total / count)}


def liger_chunk_positions(config, seq_len: int) -> int:
    """Positions per chunk Liger's fused linear cross-entropy holds logits for: it cuts the B*T rows into ceil(V / H) chunks
    (``liger_kernel.ops.fused_linear_cross_entropy``), so a chunk's logits are about the size of the hidden states."""
    return max(1, math.ceil(seq_len / math.ceil(config.vocab_size / config.hidden_size)))


def quantized_weights(model: torch.nn.Module) -> list[int]:
    """Numels of the weights a 4-bit load quantizes: every linear layer but the lm_head (transformers keeps it unquantized);
    traced in bf16, re-counted as NF4 afterwards (see ``core.models.adapters.wrap_with_lora``)."""
    output = model.get_output_embeddings()
    return [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]


TASK = CausalLM()


def causal_module_class(cfg: DictConfig) -> type:
    """The class ``export``/``generate`` load a checkpoint into: ``task.module`` when it is a causal LM (causal_lm, preference),
    else :class:`CausalLMModule` (``core.checkpoints.io.load_trained_module`` then refuses another task's checkpoint)."""
    from .module import CausalLMModule

    found = module_class(cfg)
    return found if issubclass(found, CausalLMModule) else CausalLMModule
