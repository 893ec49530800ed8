"""Evaluate the skill, not only the loss: greedy answers to the test prompts of chat data.

``test/exact_match`` is the fraction of the test rows (the first ``data.answer_rows``, or all)
whose greedy answer, up to the end-of-turn token, equals the reference answer after
:func:`normalize_answer` (Unicode NFKC, case-folded, whitespace runs made one space, trailing
punctuation of any script removed): the whole answer, never a prefix or a substring, so "positive, mostly" does not count as "positive".
Each answer is written to ``predictions.jsonl`` with its reference and verdict.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch

from ...core.run.entry import atomic_write_path


def normalize_answer(text: str) -> str:
    """``text`` as exact match compares it, the same in every script:

    1. Unicode NFKC (compatibility forms folded: full-width ``ｐｏｓｉｔｉｖｅ！`` reads as
       ``positive!``, the ellipsis ``…`` as ``...``);
    2. case-folded (``str.casefold``: ``Straße`` equals ``STRASSE``);
    3. every whitespace run made one space, surrounding whitespace dropped;
    4. trailing characters of the Unicode punctuation categories (``P*``: ``.!?…。！、」``...)
       and whitespace dropped.

    Leading punctuation and symbols (``S*``: ``$``, ``✓``, emoji) are kept: they are content.
    """
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    end = len(text)
    while end and (unicodedata.category(text[end - 1]).startswith("P") or text[end - 1].isspace()):
        end -= 1
    return text[:end]


def exact_match(prediction: str, reference: str) -> bool:
    """The whole normalised prediction equals the normalised reference."""
    return normalize_answer(prediction) == normalize_answer(reference)


def evaluate_answers(module, datamodule, output: Path, split: str = "test", prefix: str = "test") -> dict[str, float]:
    """Greedy answers of ``module`` (a language-model task module: ``complete`` and ``tokenizer``) to the prompts of
    ``datamodule.answer_prompts(split)``; writes ``output`` (jsonl: ``row``, ``prompt``,
    ``reference``, ``prediction``, ``exact_match``) atomically.

    Runs on the GPU when there is one (the module is moved there), else the CPU; greedy
    decoding, ``datamodule.answer_max_new_tokens`` new tokens at most, ``datamodule.answer_batch_size``
    prompts a batch (sorted by length, left-padded).

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
    """:func:`evaluate_answers`, as ``{name: exact match}`` (default name ``<split>/exact_match``),
    also sent to the trainer's loggers at the current step and printed."""
    found = evaluate_answers(module, datamodule, output, split=split)
    name = name or f"{split}/exact_match"
    metrics = {name: found[f"{split}/exact_match"]}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    print(f"{name}={metrics[name]:.4f} over {int(found[f'{split}/answers'])} answers: {output}")
    return metrics
