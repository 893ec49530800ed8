"""Token classification: one tag per word (named entities, part of speech, chunks).  Module
:class:`.module.TokenClassificationModule`, data :class:`.data.TokenTagsDataModule` (configs/task/token_classification.yaml)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.compress.quantization import TORCHAO_VARIANTS
from ...core.data.loading import rows_as_read
from ...core.errors import DataError
from ...core.task import to_device
from ..classification import SequenceClassification
from .spans import SCHEMES

ADDED = ("tags", "words_cut", "words_no_token")  # the fields predict adds to each input row


class TokenClassification(SequenceClassification):
    """One tag per word: cross-entropy on each word's first sub-token, token accuracy and entity-level F1 (:mod:`.spans`);
    the rest (``quantize``'s timed inputs) is the sequence classifier's."""

    quantize_variants = ("fp32", *TORCHAO_VARIANTS)
    quality = {"f1": "max", "accuracy": "max"}
    prediction_suffix = ".jsonl"
    identity_keys = {
        "model": ("data.scheme", "data.strict", "data.tags_column", "data.conll_tag_column"),
        "data": ("data.tokens_column", "data.format", "data.val_fraction", "data.val_split_seed"),
    }

    def data_problems(self, data: DictConfig) -> list[str]:
        problems = [
            f"data.{field}={data.get(field)!r} must name a column of your data, e.g. data.{field}={example}"
            for field, example in (("tokens_column", "tokens"), ("tags_column", "tags"))
            if not isinstance(data.get(field), str) or not data.get(field)
        ]
        if data.get("scheme") not in SCHEMES:
            problems.append(
                f"data.scheme={data.get('scheme')!r} must be one of {list(SCHEMES)}; fix: data.scheme=IOB2 (B-/I- tags), IOB1 (the original CoNLL-2003 files)"
            )
        if not isinstance(data.get("strict"), bool):
            problems.append(f"data.strict={data.get('strict')!r} must be true or false (seqeval's strict mode); fix: data.strict=false")
        elif data.get("strict") and data.get("scheme") in ("IOB1", "none"):
            problems.append(
                f"data.strict=true has no meaning for data.scheme={data.get('scheme')} (strict mode checks IOB2/BIOES entities); fix: data.strict=false"
            )
        if data.get("format") not in ("auto", "conll"):
            problems.append(f"data.format={data.get('format')!r} must be auto (by file suffix) or conll; fix: data.format=auto")
        column = data.get("conll_tag_column")
        if not isinstance(column, int) or isinstance(column, bool):
            problems.append(
                f"data.conll_tag_column={column!r} must be an integer (0-based; -1 = the last column); fix: data.conll_tag_column=-1"
            )
        return problems

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        batch = super().example_batch(cfg, vocab_size, micro_batch)
        return {**batch, "labels": torch.zeros_like(batch["input_ids"])}  # (B, T): a tag on every position, the most the loss reads

    def planned_model(self, module, cfg: DictConfig, config, precision: str) -> tuple[torch.nn.Module, list[int]]:
        config.num_labels = 9  # CoNLL-2003's tag set; the head's size barely matters
        module.model = module.build_model(precision, config=config)
        return module.model, []

    def write_predictions(self, module, datamodule, outputs: list, path: Path) -> int:
        """A jsonl file: each input row's fields, ``tags`` (one per word; ``null`` for a word ``data.max_length`` cut off or
        one without a sub-token), ``words_cut`` and ``words_no_token`` (how many of each)."""
        names = module.inputs.id2label
        rows = datamodule.predict_rows
        taken = [field for field in ADDED if field in rows.column_names]
        if taken:
            raise DataError(
                f"input has field(s) {taken} that predict writes; fix: rename them in the input (its fields are copied as they are)"
            )
        tagged = [row for batch in outputs for row in batch]  # tag ids (None: untagged) per word, per row, in input order
        counts = datamodule.datasets["predict"].select_columns(["words_cut", "words_no_token"])
        with path.open("w", encoding="utf-8") as file:
            for row, ids, count in zip(rows_as_read(datamodule.predict_file, rows), tagged, counts, strict=True):
                tags = [None if i is None else names[i] for i in ids]
                # (default=str: a parquet timestamp or decimal is written as its text, never dropped)
                file.write(json.dumps({**row, "tags": tags, **count}, ensure_ascii=False, default=str) + "\n")
        return len(tagged)

    def score(self, forward: Callable[[dict], torch.Tensor], loader, device: str, datamodule) -> dict[str, float]:
        """``f1`` (entity level, micro) and ``accuracy`` (token level), as ``eval`` logs them."""
        from .data import NOT_INPUTS
        from .module import DEFAULT_FACTS, TagMetrics

        metrics = TagMetrics("test", datamodule.id2label, {**DEFAULT_FACTS, **(datamodule.task_facts or {})})
        with torch.inference_mode():
            for batch in loader:
                logits = forward(to_device({k: v for k, v in batch.items() if k not in NOT_INPUTS}, device))
                metrics.update(logits.float().cpu(), batch)  # (B, T, num_tags)
        values = metrics.compute()
        return {"f1": float(values["test/f1"]), "accuracy": float(values["test/acc"])}


TASK = TokenClassification()
