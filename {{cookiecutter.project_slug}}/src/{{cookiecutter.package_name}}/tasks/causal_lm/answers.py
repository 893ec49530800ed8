"""Evaluate the skill, not only the loss: greedy answers to the test prompts of chat data.

``test/exact_match`` is the fraction of test rows (the first ``data.answer_rows``, or all) whose whole greedy answer
equals the reference after :func:`normalize_answer` (never a prefix: "positive, mostly" is not "positive"); each
answer goes to ``predictions.jsonl`` with its reference and verdict."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch

from ...core.run.entry import atomic_write_path


def normalize_answer(text: str) -> str:
    """``text`` as exact match compares it, in any script: Unicode NFKC (``ｐｏｓｉｔｉｖｅ！`` reads ``positive!``),
    case-folded, whitespace runs made one space, trailing punctuation (categories ``P*``) and whitespace dropped.
    Leading punctuation and symbols (``S*``: ``$``, ``✓``, emoji) are content and kept."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    end = len(text)
    while end and (unicodedata.category(text[end - 1]).startswith("P") or text[end - 1].isspace()):
        end -= 1
    return text[:end]


def exact_match(prediction: str, reference: str) -> bool:
    """The whole normalised prediction equals the normalised reference."""
    return normalize_answer(prediction) == normalize_answer(reference)


def evaluate_answers(module, datamodule, output: Path, split: str = "test", prefix: str = "test") -> dict[str, float]:
    """Greedy answers of ``module`` (``complete``, ``tokenizer``) to ``datamodule.answer_prompts(split)``, on the GPU if any,
    ``answer_batch_size`` prompts a batch, ``answer_max_new_tokens`` at most; writes ``output`` (jsonl) atomically.

    Returns:
        ``{f"{prefix}/exact_match": fraction, f"{prefix}/answers": count}``.
    """
    rows = datamodule.answer_prompts(split)
    if torch.cuda.is_available():
        module.to("cuda")
    answers = module.complete(
        [row["prompt_ids"] for row in rows],
        batch_size=datamodule.answer_batch_size,
        max_new_tokens=datamodule.answer_max_new_tokens,
        do_sample=False,
    )
    tokenizer = module.tokenizer
    records = []
    for row, ids in zip(rows, answers):
        prediction = tokenizer.decode(ids, skip_special_tokens=True)
        records.append(
            {
                "row": row["row"],
                "prompt": tokenizer.decode(row["prompt_ids"]),
                "reference": row["reference"],
                "prediction": prediction,
                "exact_match": exact_match(prediction, row["reference"]),
            }
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_path(output) as partial:
        partial.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    matched = sum(record["exact_match"] for record in records)
    return {f"{prefix}/exact_match": matched / len(records) if records else float("nan"), f"{prefix}/answers": float(len(records))}


def answer_metrics(module, datamodule, output: Path, trainer, split: str = "test", name: str | None = None) -> dict[str, float]:
    """:func:`evaluate_answers` as ``{name: exact match}`` (default ``<split>/exact_match``), logged at this step and printed."""
    found = evaluate_answers(module, datamodule, output, split=split)
    name = name or f"{split}/exact_match"
    metrics = {name: found[f"{split}/exact_match"]}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    print(f"{name}={metrics[name]:.4f} over {int(found[f'{split}/answers'])} answers: {output}")
    return metrics
