"""Reward models: a scalar head on a decoder or an encoder, trained on preference pairs with the Bradley–Terry loss.  Module
:class:`.module.RewardModule`, data :class:`.data.RewardDataModule` (configs/task/reward.yaml)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.compress.quantization import TORCHAO_VARIANTS
from ...core.data.loading import rows_as_read
from ...core.task import Task, to_device


class RewardModel(Task):
    """One reward a text; pairs train it (the chosen answer's reward above the rejected one's), ``predict`` scores answers."""

    prediction_suffix = ".jsonl"
    quantize_variants = ("fp32", *TORCHAO_VARIANTS)
    quality = {"pair_accuracy": "max", "margin": "max"}
    identity_keys = {
        "model": ("data.chat_template", "data.end_of_turn", "data.system_prompt"),
        "data": ("data.val_fraction", "data.val_split_seed"),
    }
    shaping_keys = ("data.max_length", "data.chat_template", "data.end_of_turn", "data.system_prompt")

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        if (cfg.get("callbacks") or {}).get("neftune") is None:
            return []
        return [f"callbacks=neftune with task={self.name}: NEFTune is for instruction tuning (SFT); fix: callbacks=default"]

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """``micro_batch`` pairs: ``2 * micro_batch`` sequences of ``data.max_length`` tokens."""
        input_ids = torch.randint(0, vocab_size, (2 * micro_batch, cfg.data.max_length))  # (2P, T)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def planned_model(self, module, cfg: DictConfig, config, precision: str) -> tuple[torch.nn.Module, list[int]]:
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = 0  # a decoder's classifier reads the last non-pad token; the trace has no padding
        module.model = module.build_model(precision, config=config)
        if module.peft_method != "qlora":
            return module.model, []
        linears = [m for m in module.model.modules() if isinstance(m, torch.nn.Linear)]
        return module.model, [m.weight.numel() for m in linears[:-1]]  # (the head, last, stays unquantized)

    def write_predictions(self, module, datamodule, outputs: list, path: Path) -> int:
        """A jsonl file: each input row's fields as read, then ``reward`` (a float; only differences between rewards mean
        something). An input with a ``reward`` field was refused when read (:meth:`.data.RewardDataModule.setup`)."""
        rows = rows_as_read(datamodule.predict_file, datamodule.predict_rows)
        rewards = torch.cat(outputs).tolist()
        with path.open("w", encoding="utf-8") as file:
            for row, reward in zip(rows, rewards, strict=True):
                file.write(json.dumps({**row, "reward": reward}, ensure_ascii=False, default=str) + "\n")
        return len(rewards)

    def score(self, forward: Callable[[dict], torch.Tensor], loader, device: str, datamodule) -> dict[str, float]:
        """``pair_accuracy`` and ``margin`` over the split's pairs, as ``eval`` logs them (the batches: chosen sides first)."""
        rewards = []
        with torch.inference_mode():
            for batch in loader:
                inputs = to_device({key: batch[key] for key in ("input_ids", "attention_mask")}, device)
                rewards.append(forward(inputs).float().cpu()[:, 0].view(2, -1))  # (2, P): chosen, rejected
        chosen, rejected = torch.cat(rewards, dim=1)
        return {"pair_accuracy": float((chosen > rejected).float().mean()), "margin": float((chosen - rejected).mean())}


TASK = RewardModel()
