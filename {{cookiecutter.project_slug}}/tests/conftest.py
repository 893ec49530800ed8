"""Fixtures: tiny offline tokenizers, small synthetic data sets, and Hydra config composition.

Everything here runs without network.
{%- if cookiecutter.tasks != "causal_lm" %} The 2-layer BERT of ``model=tiny_bert`` gets a WordPiece
tokenizer written from a word list and a separable toy sentiment task.
{%- endif %}
{%- if cookiecutter.tasks != "classification" %} The tiny causal LMs get a byte-level BPE
tokenizer (GPT-2 style: an EOS token and no pad token) trained on toy documents.
{%- endif %}
"""

from __future__ import annotations

{% if cookiecutter.tasks != "causal_lm" %}import csv
{% endif %}import os
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

import {{ cookiecutter.package_name }}  # noqa: F401  (registers the config resolvers)

# Test tiers (see docs/development.md): a test's folder is its tier, and the marker is added
# here, so that a test moved between folders changes tier with it.  Plain ``pytest`` runs the
# unmarked ones (tests/*.py); pyproject's addopts deselects the rest; ``pytest -m e2e`` (or
# ``slow``, ``ddp``, ``real_data``, ``gpu``, ``llama_cpp``) runs one tier, ``pytest -m "not (gpu or llama_cpp)"``
# all that needs neither a GPU nor a llama.cpp build (what CI runs).
TIERS = ("slow", "e2e", "ddp", "real_data", "gpu", "llama_cpp")

# Under pytest-xdist (``pytest -n 2 --dist loadfile``, what CI runs: a file's tests on one worker,
# its module fixtures made once) each worker, and every process it starts, computes on one thread:
# two workers of two threads on two cores slow each other far more than twice (OpenMP spin-waits).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def requires_cuda() -> pytest.MarkDecorator:
    """The one skip rule of the ``gpu`` tier: a CUDA device must be visible."""
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def pytest_configure(config):
    """pytest-xdist hands out files in collection order (not its default: the files with the most tests first)."""
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection reads the markers
def pytest_collection_modifyitems(config, items):
    """Mark every test below ``tests/<tier>/`` with that tier; ``gpu`` tests also skip without CUDA.  The longest tiers
    run first, so that under pytest-xdist the minutes-long demos start at once and short files fill in beside them."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
            if tier == "gpu":
                item.add_marker(requires_cuda())
    longest_first = {"real_data": 0, "ddp": 1, "e2e": 2, "slow": 3}
    items.sort(key=lambda item: longest_first.get(item.path.parent.name, len(longest_first)))


def compose_config(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` as the entry point would (without running Hydra)."""
    with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
        return compose(config_name=config_name, overrides=overrides)


def with_task(cfg: DictConfig) -> tuple[DictConfig, object]:
    """``(cfg, its task)``: the first two arguments of the planner's functions, as the entry points pass them."""
    from {{ cookiecutter.package_name }}.tasks import task_of

    return cfg, task_of(cfg)


class RecordingLogger(Logger):
    """A Lightning logger for callback tests: keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[int, dict]] = []

    name, version = "recording", 0

    def log_metrics(self, metrics, step=None):
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def common_overrides(run_dir: Path) -> list[str]:
    """CPU, fp32, CSV logs, and every path inside the test's own folder."""
    return [
        "precision=32-true",
        "trainer=cpu",
        "logger=csv",
        f"paths.output_dir={run_dir}",
        f"paths.log_dir={run_dir}/logs",
        f"paths.cache_dir={run_dir.parent}/cache",
    ]


def byte_level_bpe(texts: list[str], special_tokens: list[str], **roles: str):
    """A byte-level BPE tokenizer (GPT-2 style, 300 tokens) trained on ``texts``, with
    ``special_tokens`` and the ``roles`` given (``eos_token=...``, ``padding_side=...``): no pad
    token unless a role names one.  Decoder tokenizers on the Hub cannot be reached from tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **roles)


def tiny_llama_config(vocab_size: int, **changes):
    """A 2-layer Llama config (hidden 64, 4 heads, 2 KV heads, 128 positions), ``changes`` applied."""
    from transformers import LlamaConfig

    sizes = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    return LlamaConfig(vocab_size=vocab_size, **{**sizes, **changes})
{%- if cookiecutter.tasks != "causal_lm" %}


from transformers import BertTokenizer  # noqa: E402

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
    """Overrides that make any classification train/eval/predict config run offline in seconds."""
    return [
        "task=classification",
        "model=tiny_bert",
        f"model.tokenizer={tokenizer_dir}",
        "data=local_files",
        f"data.splits.train={toy_data['train']}",
        f"data.splits.validation={toy_data['validation']}",
        f"data.splits.test={toy_data['test']}",
        "data.max_length=32",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=16",
        *common_overrides(run_dir),
    ]


@pytest.fixture(scope="session")
def classifier_ckpt(tokenizer_dir, toy_data, tmp_path_factory) -> tuple[Path, list[str]]:
    """A tiny BERT trained for 2 epochs on the toy data; returns (its last.ckpt, the overrides of
    its run).  Shared: tests read it and write elsewhere (``paths.output_dir=`` of their own)."""
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path_factory.mktemp("classifier") / "run"
    base = tiny_overrides(tokenizer_dir, toy_data, run_dir)
    train(compose_config("train", base + ["trainer.max_epochs=2", "optimizer.lr=2e-3", "callbacks.progress_bar=null"]))
    return run_dir / "checkpoints" / "last.ckpt", base


@pytest.fixture
def make_cfg(tokenizer_dir, toy_data, tmp_path):
    """``make_cfg(*overrides, config_name="train")`` -> a tiny offline config in ``tmp_path/run``."""

    def make(*overrides: str, config_name: str = "train") -> DictConfig:
        base = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run")
        return compose_config(config_name, base + list(overrides))

    return make
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


LM_WORDS = ["the", "king", "queen", "speaks", "to", "a", "fool", "and", "ghost", "night", "sword", "love"]
EOS = "<|endoftext|>"


def lm_documents(n: int, seed: int) -> list[str]:
    """``n`` toy documents of 2-6 short lines ("the king speaks to a fool.")."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(LM_WORDS) for _ in range(rng.randint(3, 8))) + "." for _ in range(rng.randint(2, 6))]
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="session")
def lm_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style: EOS ``<|endoftext|>``, no pad token), 300 tokens."""
    folder = tmp_path_factory.mktemp("lm_tokenizer")
    byte_level_bpe(lm_documents(200, seed=0), [EOS], eos_token=EOS, bos_token=EOS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lm_text(tmp_path_factory) -> dict[str, Path]:
    """A folder of 24 .txt documents (one per file) for train, and one .txt file for validation."""
    folder = tmp_path_factory.mktemp("lm_text")
    (folder / "train").mkdir()
    for index, doc in enumerate(lm_documents(24, seed=1)):
        (folder / "train" / f"doc{index:02d}.txt").write_text(doc + "\n")
    (folder / "validation.txt").write_text("\n".join(lm_documents(4, seed=2)) + "\n")
    return {"train": folder / "train", "validation": folder / "validation.txt"}


def lm_overrides(tokenizer_dir: Path, text: dict[str, Path], run_dir: Path, model: str = "tiny_llama") -> list[str]:
    """Overrides that make any causal-LM config run offline in seconds (2-layer tiny Llama,
    128 positions; or ``model="tiny_gpt2"``)."""
    return [
        "task=causal_lm",
        f"model={model}",
        f"model.tokenizer={tokenizer_dir}",
        "model.fetch=null",
        *(["model.config.max_position_embeddings=128"] if model == "tiny_llama" else []),
        "data=text_files",
        f"data.splits.train={text['train']}",
        f"data.splits.validation={text['validation']}",
        "data.max_length=32",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=8",
        "callbacks.sample_generation.max_new_tokens=4",
        *common_overrides(run_dir),
    ]


@pytest.fixture
def make_lm_cfg(lm_tokenizer_dir, lm_text, tmp_path):
    """``make_lm_cfg(*overrides, config_name="train", model="tiny_llama")`` -> a tiny offline causal-LM config."""

    def make(*overrides: str, config_name: str = "train", model: str = "tiny_llama") -> DictConfig:
        base = lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "run", model=model)
        return compose_config(config_name, base + list(overrides))

    return make


@pytest.fixture(scope="session")
def pretrained_lm_dir(lm_tokenizer_dir, tmp_path_factory) -> Path:
    """A "pretrained" tiny Llama folder (random weights, saved with save_pretrained) for
    fine-tuning, LoRA and QLoRA tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    config = tiny_llama_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("pretrained_lm")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
{%- endif %}


# ------------------------------------------------------ runs in subprocesses (e2e, ddp)
# The task whose sweep the e2e and ddp tiers run, its search and the metric it optimises.
{%- if cookiecutter.tasks != "causal_lm" %}
TASK, SEARCH, METRIC = "classification", "classification_optuna", "val/acc"
{%- else %}
TASK, SEARCH, METRIC = "causal_lm", "causal_lm_optuna", "val/loss"
{%- endif %}


@pytest.fixture(scope="module")
def cli_base(tmp_path_factory, request) -> list[str]:
    """Command-line overrides of a tiny offline run of ``TASK``, one epoch, with no run folder
    set (Hydra names it)."""
{%- if cookiecutter.tasks != "causal_lm" %}
    tokenizer, data = request.getfixturevalue("tokenizer_dir"), request.getfixturevalue("toy_data")
    overrides = tiny_overrides(tokenizer, data, tmp_path_factory.mktemp("sweep") / "run") + [
        "batch.global_batch_size=32",
        "test_after_fit=false",
    ]
{%- else %}
    tokenizer, text = request.getfixturevalue("lm_tokenizer_dir"), request.getfixturevalue("lm_text")
    overrides = lm_overrides(tokenizer, text, tmp_path_factory.mktemp("sweep") / "run") + [
        "batch.global_batch_size=8",
        "callbacks.sample_generation=null",
    ]
{%- endif %}
    drop = ("paths.output_dir", "paths.log_dir", "logger=")
    return [o for o in overrides if not o.startswith(drop)] + ["trainer.max_epochs=1", "callbacks.progress_bar=null"]


@pytest.fixture(scope="module")
def single_process_run(cli_base, tmp_path_factory) -> Path:
    """The ``cli_base`` run on one process (with its test split where the task has one): the reference."""
    from .processes import ok, run_module

    run_dir = tmp_path_factory.mktemp("single") / "run"
{%- if cookiecutter.tasks != "causal_lm" %}
    extra = ["test_after_fit=true"]
{%- else %}
    extra = []
{%- endif %}
    ok(run_module("train", cli_base + extra + [f"hydra.run.dir={run_dir}", "logger=csv"], cwd=run_dir.parent))
    return run_dir
