"""Judge what a preference-tuned model writes: seeded samples for held-out prompts, scored by a judge the project did
not write (the demo's: VADER, :func:`...core.assets.vader.sentiment_scores`). The untuned (``..._start``) and tuned
samples share prompts and seed, so the difference is the tuning's."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import torch

from ...core.run.entry import atomic_write_path


def judged_samples(module, datamodule, trainer, output: Path, split: str, suffix: str) -> dict[str, float]:
    """``data.samples_per_prompt`` seeded samples for each of ``data.sample_prompts`` (as a user turn), scored by
    ``data.judge``; writes ``output`` (jsonl) atomically, logs and prints the means.

    Returns:
        ``{f"{split}/{metric}{suffix}": mean over the samples}`` for each metric of the judge, and ``distinct_2`` (distinct
        word bigrams / all word bigrams of the samples: Li et al. 2016, "A Diversity-Promoting Objective Function") and
        ``sample_words`` (mean words a sample), which show a judge gamed by degenerate text.
    """
    prompts = datamodule.sample_prompt_texts()
    repeated = [prompt for prompt in prompts for _ in range(datamodule.samples_per_prompt)]
    if torch.cuda.is_available():
        module.to("cuda")
    torch.manual_seed(datamodule.sample_seed)
    completions = module.complete(
        module.prompt_ids(repeated),
        batch_size=datamodule.sample_batch_size,
        max_new_tokens=datamodule.sample_max_new_tokens,
        do_sample=True,
        temperature=datamodule.sample_temperature,
        top_p=1.0,
        top_k=0,
    )
    texts = [module.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in completions]
    scores = datamodule.judge(texts)
    records = [{"prompt": prompt, "sample": text, **score} for prompt, text, score in zip(repeated, texts, scores, strict=True)]
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_path(output) as partial:
        partial.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    metrics = {f"{split}/{name}{suffix}": statistics.fmean(score[name] for score in scores) for name in scores[0]}
    bigrams = [pair for text in texts for pair in itertools.pairwise(text.split())]
    metrics[f"{split}/distinct_2{suffix}"] = len(set(bigrams)) / max(1, len(bigrams))
    metrics[f"{split}/sample_words{suffix}"] = statistics.fmean(len(text.split()) for text in texts)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    print(", ".join(f"{name}={value:.4f}" for name, value in metrics.items()) + f" over {len(texts)} samples: {output}")
    return metrics
