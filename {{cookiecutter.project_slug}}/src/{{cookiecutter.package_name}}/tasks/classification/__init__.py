"""Sequence classification: one label per text (or text pair).  Module :class:`.module.SequenceClassificationModule`, data
:class:`.data.ClassificationDataModule` (configs/task/classification.yaml)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.compress.quantization import TORCHAO_VARIANTS
from ...core.errors import DataError
from ...core.task import Task, to_device


class SequenceClassification(Task):
    """One label per row; cross-entropy over the labels, accuracy and macro F1."""

    quantize_variants = ("fp32", *TORCHAO_VARIANTS, "onnx_fp32", "onnx_int8")
    quality = {"accuracy": "max", "f1_macro": "max"}
    prediction_suffix = ".csv"
    identity_keys = {
        "model": ("data.label_column",),
        "data": ("data.text_column", "data.text_pair_column", "data.val_fraction", "data.val_split_seed"),
    }

    def data_problems(self, data: DictConfig) -> list[str]:
        return [
            f"data.{field}={data.get(field)!r} must name a column of your data, e.g. data.{field}={example}"
            for field, example in (("text_column", "text"), ("label_column", "label"))
            if not isinstance(data.get(field), str) or not data.get(field)
        ]

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        if (cfg.get("callbacks") or {}).get("neftune") is None:
            return []
        return [
            f"callbacks=neftune with task={self.name}: NEFTune noises a causal LM's input embeddings for instruction tuning "
            "(tasks/causal_lm/neftune.py); fix: callbacks=default"
        ]

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        batch = super().example_batch(cfg, vocab_size, micro_batch)
        return {**batch, "labels": torch.zeros(micro_batch, dtype=torch.long)}  # (B,)

    def planned_model(self, module, cfg: DictConfig, config, precision: str) -> tuple[torch.nn.Module, list[int]]:
        config.num_labels = 2  # the head's size barely matters; the labels come with the data
        if config.pad_token_id is None:
            config.pad_token_id = 0  # HF's classifiers read the last non-pad token; the trace has no padding
        module.model = module.build_model(precision, config=config)
        return module.model, []

    def write_predictions(self, module, datamodule, outputs: list, path: Path) -> int:
        """A CSV: the input's columns, then ``predicted_label`` and ``prob_<label>`` (:func:`prediction_frame`)."""
        probabilities = torch.cat(outputs)  # (N, num_labels)
        names = [module.inputs.id2label[i] for i in range(probabilities.shape[1])]
        frame = prediction_frame(datamodule.predict_rows.to_pandas(), probabilities, names)
        frame.to_csv(path, index=False)
        return len(frame)

    def timing_inputs(self, input_ids: torch.Tensor, sample: dict[str, torch.Tensor]) -> dict[str, object]:
        inputs = super().timing_inputs(input_ids, sample)
        if "token_type_ids" in sample:
            inputs["token_type_ids"] = torch.zeros_like(input_ids)
        return inputs

    def score(self, forward: Callable[[dict], torch.Tensor], loader, device: str, datamodule) -> dict[str, float]:
        """``accuracy`` and ``f1_macro`` (torchmetrics, as ``eval`` logs them)."""
        from .module import classification_metrics

        metrics = None
        with torch.inference_mode():
            for batch in loader:
                logits = forward(to_device({k: v for k, v in batch.items() if k != "labels"}, device)).float().cpu()  # (B, C)
                metrics = metrics or classification_metrics(logits.shape[-1], "test")
                metrics.update(logits, batch["labels"])
        values = metrics.compute()
        return {"accuracy": float(values["test/acc"]), "f1_macro": float(values["test/f1_macro"])}


def prediction_frame(rows, probabilities: torch.Tensor, names: list[str]):
    """The input's rows (a ``pandas.DataFrame``), then ``predicted_label`` and ``prob_<label>`` per class from ``probabilities``
    ``(N, num_labels)``; the columns are joined at once (inserted one by one: slow, and a pandas warning each).

    Raises:
        DataError: the input already has a column of those names.
    """
    import pandas as pd

    added = ["predicted_label", *(f"prob_{name}" for name in names)]
    taken = [column for column in added if column in rows.columns]
    if taken:
        raise DataError(
            f"input has column(s) {taken[:5]} that predict writes; fix: rename them in the input (its cells are copied as they are)"
        )
    predicted = pd.DataFrame({"predicted_label": [names[i] for i in probabilities.argmax(dim=-1).tolist()]}, index=rows.index)
    scores = pd.DataFrame(probabilities.float().numpy(), columns=[f"prob_{name}" for name in names], index=rows.index)
    return pd.concat([rows, predicted, scores], axis=1)


TASK = SequenceClassification()
