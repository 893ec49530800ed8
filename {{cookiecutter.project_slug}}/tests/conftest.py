"""Fixtures: a tiny offline tokenizer, a small synthetic data set, and Hydra config composition.

Everything here runs without network: the 2-layer BERT of ``model=tiny_bert`` gets a WordPiece
tokenizer written from a word list, and the data is a separable toy sentiment task.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from transformers import BertTokenizer

import {{ cookiecutter.package_name }}  # noqa: F401  (registers the config resolvers)

POSITIVE = ["good", "great", "wonderful", "lovely", "superb", "fun"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "poor", "dull"]
NEUTRAL = ["the", "movie", "film", "plot", "was", "and", "acting", "story", "a", "very"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def toy_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows of ``text``/``label``: the label is which word list the sentiment words come from."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["positive", "negative"])
        words = rng.sample(NEUTRAL, 4) + rng.sample(POSITIVE if label == "positive" else NEGATIVE, 2)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fieldnames or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    vocab = {token: index for index, token in enumerate(SPECIALS + POSITIVE + NEGATIVE + NEUTRAL)}
    BertTokenizer(vocab=vocab).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("toy_data")
    return {
        "train": write_csv(folder / "train.csv", toy_rows(96, seed=0)),
        "validation": write_csv(folder / "validation.csv", toy_rows(32, seed=1)),
        "test": write_csv(folder / "test.csv", toy_rows(40, seed=2)),
    }


def tiny_overrides(tokenizer_dir: Path, toy_data: dict[str, Path], run_dir: Path) -> list[str]:
    """Overrides that make any train/eval/predict config run offline in seconds."""
    return [
        "model=tiny_bert",
        f"model.tokenizer={tokenizer_dir}",
        "data=local_files",
        f"data.splits.train={toy_data['train']}",
        f"data.splits.validation={toy_data['validation']}",
        f"data.splits.test={toy_data['test']}",
        "data.max_length=32",
        "precision=32-true",
        "trainer=cpu",
        "logger=csv",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=16",
        f"paths.output_dir={run_dir}",
        f"paths.log_dir={run_dir}/logs",
        f"paths.cache_dir={run_dir.parent}/cache",
    ]


def compose_config(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` as the entry point would (without running Hydra)."""
    with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
        return compose(config_name=config_name, overrides=overrides)


@pytest.fixture
def make_cfg(tokenizer_dir, toy_data, tmp_path):
    """``make_cfg(*overrides, config_name="train")`` -> a tiny offline config in ``tmp_path/run``."""

    def make(*overrides: str, config_name: str = "train") -> DictConfig:
        base = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run")
        return compose_config(config_name, base + list(overrides))

    return make
