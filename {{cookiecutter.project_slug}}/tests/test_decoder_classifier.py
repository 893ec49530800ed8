"""Decoders (GPT-2, Llama) as sequence classifiers: padding with EOS, LoRA with the head trained
in full, and checkpoints that eval/predict read back (offline, tiny models, seconds on a CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import hydra
import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from {{ cookiecutter.package_name }}.core.config.resolvers import to_plain
from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.core.models.adapters import target_modules, wrap_with_lora
from {{ cookiecutter.package_name }}.core.models.builder import linear_layer_names
from {{ cookiecutter.package_name }}.core.models.inputs import ModelInputs
from {{ cookiecutter.package_name }}.core.task import build_module
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.predict import predict
from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule
from {{ cookiecutter.package_name }}.train import train

from .conftest import NEGATIVE, NEUTRAL, POSITIVE, byte_level_bpe, compose_config, tiny_llama_config, tiny_overrides, write_csv

EOS = "<|endoftext|>"
GPT2 = "{model_type: gpt2, n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64}"
LLAMA = (
    "{model_type: llama, num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 4, "
    "num_key_value_heads: 2, max_position_embeddings: 64}"
)


def varied_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` toy sentiment rows of 2 to 10 words, so that batches need padding."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["positive", "negative"])
        words = rng.sample(NEUTRAL, rng.randint(1, 8)) + rng.sample(POSITIVE if label == "positive" else NEGATIVE, rng.randint(1, 2))
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def bpe_tokenizer(special_tokens: dict[str, str]):
    """A byte-level BPE tokenizer trained on the toy rows, with only ``special_tokens`` (no pad)."""
    texts = [row["text"] for row in varied_rows(200, seed=9)]
    # padding_side="left", as some Hub decoder tokenizers ship: the data module pads on the right anyway.
    return byte_level_bpe(texts, list(special_tokens.values()), padding_side="left", **special_tokens)


@pytest.fixture(scope="module")
def decoder_tokenizer_dir(tmp_path_factory) -> Path:
    """A GPT-2 style tokenizer: an EOS token, no pad token."""
    folder = tmp_path_factory.mktemp("decoder_tokenizer")
    tokenizer = bpe_tokenizer({"eos_token": EOS})
    assert tokenizer.pad_token is None and tokenizer.eos_token_id is not None
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def varied_data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("varied_data")
    return {
        "train": write_csv(folder / "train.csv", varied_rows(64, seed=0)),
        "validation": write_csv(folder / "validation.csv", varied_rows(16, seed=1)),
        "test": write_csv(folder / "test.csv", varied_rows(24, seed=2)),
    }


def decoder_overrides(tokenizer_dir: Path, data: dict[str, Path], run_dir: Path, config: str | None) -> list[str]:
    """A tiny offline classification run of a decoder built from ``config`` (``None``: keep
    ``model.config`` for the caller to replace by pretrained weights)."""
    model = ["~model.config", f"+model.config={config}"] if config else ["model.config=null"]
    return tiny_overrides(tokenizer_dir, data, run_dir) + model + ["batch.micro_batch_size=8", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def gpt2_run(decoder_tokenizer_dir, varied_data, tmp_path_factory):
    """Three epochs of a 2-layer GPT-2 classifier from scratch; returns (run_dir, metrics)."""
    run_dir = tmp_path_factory.mktemp("gpt2") / "run"
    overrides = decoder_overrides(decoder_tokenizer_dir, varied_data, run_dir, GPT2) + ["trainer.max_epochs=3", "optimizer.lr=2e-3"]
    return run_dir, train(compose_config("train", overrides))


@pytest.fixture(scope="module")
def pretrained_llama_dir(decoder_tokenizer_dir, tmp_path_factory) -> Path:
    """A "pretrained" tiny Llama causal LM (random weights, save_pretrained) with its tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(decoder_tokenizer_dir)
    # (hidden 64: bitsandbytes' CPU 4-bit kernels need 64 or more)
    config = tiny_llama_config(len(tokenizer), max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("pretrained_llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_lora_run(pretrained_llama_dir, varied_data, tmp_path_factory):
    """Two epochs of LoRA (r=4) on the "pretrained" tiny Llama with a new head; returns (run_dir, metrics)."""
    run_dir = tmp_path_factory.mktemp("llama_lora") / "run"
    overrides = decoder_overrides(pretrained_llama_dir, varied_data, run_dir, None) + [
        f"model.name_or_path={pretrained_llama_dir}",
        "peft=lora",
        "peft.r=4",
        "trainer.max_epochs=2",
        "optimizer.lr=1e-2",
    ]
    return run_dir, train(compose_config("train", overrides))


def test_a_gpt2_classifier_pads_with_eos_in_the_model_and_the_checkpoints_tokenizer(gpt2_run):
    _, metrics = gpt2_run
    module = SequenceClassificationModule.load_from_checkpoint(metrics["best_checkpoint"], map_location="cpu")
    eos = module.tokenizer.eos_token_id
    assert module.tokenizer.pad_token_id == eos and module.tokenizer.padding_side == "right"
    assert module.model.config.model_type == "gpt2" and module.model.config.pad_token_id == eos
    assert 0.0 <= metrics["test/acc"] <= 1.0


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_rows_logits_do_not_depend_on_the_padding_beside_it(decoder_tokenizer_dir, varied_data, tmp_path, config):
    cfg = compose_config("train", decoder_overrides(decoder_tokenizer_dir, varied_data, tmp_path / "run", config))
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    torch.manual_seed(0)
    module = build_module(cfg)
    module.connect(ModelInputs.of(datamodule, "32-true"))
    model = module.build_model("32-true").eval()  # the project's builder, as train calls it
    assert model.config.pad_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id

    rows = sorted(({"input_ids": ids} for ids in datamodule.datasets["train"]["input_ids"]), key=lambda row: len(row["input_ids"]))
    short, long = rows[0], rows[-1]
    ends_with_eos = {"input_ids": tokenizer("good film" + EOS)["input_ids"]}  # a text whose own last token is EOS
    assert ends_with_eos["input_ids"][-1] == tokenizer.eos_token_id and len(short["input_ids"]) < len(long["input_ids"])
    collate = datamodule.collator()
    with torch.no_grad():
        for row in (short, ends_with_eos):
            alone, padded = collate([row]), collate([row, long])
            assert padded["attention_mask"][0, -1] == 0  # the row is padded (on the right)
            logits_alone = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"]).logits[0]  # (num_labels,)
            logits_padded = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits[0]
            torch.testing.assert_close(logits_padded, logits_alone, atol=1e-5, rtol=1e-5)


def test_eval_and_predict_from_the_checkpoint_reproduce_the_end_of_training(gpt2_run, decoder_tokenizer_dir, varied_data, tmp_path):
    _, metrics = gpt2_run
    base = decoder_overrides(decoder_tokenizer_dir, varied_data, tmp_path / "run", GPT2) + [f"ckpt_path={metrics['best_checkpoint']}"]
    evaluated = evaluate(compose_config("eval", base))
    for key in ("test/acc", "test/loss"):
        assert evaluated[key] == pytest.approx(metrics[key], abs=1e-6), key
    out = tmp_path / "predictions.csv"
    predict(compose_config("predict", base + [f"input={varied_data['test']}", f"output={out}", f"paths.output_dir={tmp_path / 'predict'}"]))
    frame = pd.read_csv(out)
    assert (frame.predicted_label == frame.label).mean() == pytest.approx(metrics["test/acc"], abs=1e-6)


def test_lora_trains_only_the_adapters_and_the_head_and_round_trips(llama_lora_run, pretrained_llama_dir, varied_data, tmp_path):
    _, metrics = llama_lora_run
    checkpoint = torch.load(metrics["best_checkpoint"], map_location="cpu", weights_only=True)
    saved = [key for key in checkpoint["state_dict"] if key.startswith("model.")]
    # adapters, the trained head, and the head as drawn before training (not in the base files: saved, see core/models/base.py)
    assert saved and all("lora_" in key or ".score.modules_to_save." in key or ".score.original_module." in key for key in saved), saved
    assert any(".score." in key for key in saved) and checkpoint["hyper_parameters"]["peft"]["method"] == "lora"
    # The adapters' B matrices start at zero: a non-zero one was trained.
    assert any(value.abs().sum() > 0 for key, value in checkpoint["state_dict"].items() if "lora_B" in key)

    module = SequenceClassificationModule.load_from_checkpoint(metrics["best_checkpoint"], map_location="cpu")
    trained = [name for name, param in module.model.named_parameters() if param.requires_grad]
    frozen = [name for name, param in module.model.named_parameters() if not param.requires_grad]
    assert trained and all("lora_" in name or ".score.modules_to_save." in name for name in trained), trained
    assert sum(".score." in name for name in trained) == 1  # the head's weight (no bias), trained in full
    assert {name.split(".")[-4] for name in trained if "lora_A" in name} == {  # (...q_proj.lora_A.default.weight)
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert any("embed_tokens" in name for name in frozen) and any("base_layer" in name for name in frozen)
    assert module.model.config.pad_token_id == module.tokenizer.eos_token_id

    cfg = compose_config(
        "eval",
        decoder_overrides(pretrained_llama_dir, varied_data, tmp_path / "run", None)
        + [f"model.name_or_path={pretrained_llama_dir}", f"ckpt_path={metrics['best_checkpoint']}"],
    )
    evaluated = evaluate(cfg)
    for key in ("test/acc", "test/loss"):
        assert evaluated[key] == pytest.approx(metrics[key], abs=1e-6), key


def test_qlora_keeps_the_head_trainable_in_fp32_on_a_4bit_base_and_round_trips(pretrained_llama_dir, varied_data, tmp_path):
    import bitsandbytes as bnb  # a dependency of the project: no skip

    base = decoder_overrides(pretrained_llama_dir, varied_data, tmp_path / "run", None) + [f"model.name_or_path={pretrained_llama_dir}"]
    metrics = train(compose_config("train", base + ["peft=qlora", "peft.r=4", "trainer.max_epochs=1"]))
    module = SequenceClassificationModule.load_from_checkpoint(metrics["best_checkpoint"], map_location="cpu")
    head = [param for name, param in module.model.named_parameters() if ".score.modules_to_save." in name]
    assert len(head) == 1 and head[0].requires_grad and head[0].dtype == torch.float32
    assert any(isinstance(layer, bnb.nn.Linear4bit) for layer in module.model.modules())
    evaluated = evaluate(
        compose_config("eval", base + [f"ckpt_path={metrics['best_checkpoint']}", f"paths.output_dir={tmp_path / 'eval'}"])
    )
    # The adapter and head load exactly (strict keys); bitsandbytes' CPU 4-bit matmuls of the re-read
    # base agree with the training process's to about 1e-4, not bit for bit.
    assert evaluated["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-3)


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_before_weights_load(varied_data, tmp_path, monkeypatch):
    folder = tmp_path / "no_specials"
    bpe_tokenizer({}).save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was built before the tokenizer was checked")

    monkeypatch.setattr("{{ cookiecutter.package_name }}.core.models.base.HFModule.build_model", no_weights)
    cfg = compose_config("train", decoder_overrides(folder, varied_data, tmp_path / "run", GPT2) + ["debug=fdr"])
    with pytest.raises(DataError, match=r"model.tokenizer=.* has neither a pad token nor an EOS token.*fix: "):
        train(cfg)


def test_lora_without_pretrained_weights_is_refused_before_weights_load(decoder_tokenizer_dir, varied_data, tmp_path):
    overrides = decoder_overrides(decoder_tokenizer_dir, varied_data, tmp_path / "run", LLAMA) + ["peft=lora", "debug=fdr"]
    cfg = compose_config("train", overrides)
    with pytest.raises(ConfigError, match="peft=lora adapts pretrained weights, but model.name_or_path is null"):
        train(cfg)


def test_lora_targets_are_peft_all_linear_on_any_family_or_the_named_layers(tmp_path):
    """The default ``all-linear`` is peft's selection on any family (DistilBERT was in no list of
    ours): every linear layer but the head; a list is checked against the model's layers."""
    lora = to_plain(compose_config("train", [f"paths.output_dir={tmp_path}", "peft=lora"]).peft)
    distilbert = AutoConfig.for_model("distilbert", dim=32, n_layers=1, n_heads=2, hidden_dim=64, num_labels=3)
    assert target_modules(lora, distilbert, linear_layer_names(distilbert, AutoModelForSequenceClassification)) == "all-linear"
    model = wrap_with_lora(AutoModelForSequenceClassification.from_config(distilbert), lora, "all-linear", task_type="SEQ_CLS")
    adapted = {name.rsplit(".", 1)[-1] for name in model.base_model.targeted_module_names}
    assert adapted == {"q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"}, adapted
    trained_in_full = {name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name}
    assert trained_in_full == {  # the head (and DistilBERT's pre_classifier, which peft saves with it by suffix)
        f"base_model.model.{head}.modules_to_save.default.{p}" for head in ("classifier", "pre_classifier") for p in ("weight", "bias")
    }
    with pytest.raises(ConfigError, match=r"\['qkv'\] match no linear layer.*fix: peft.target_modules=all-linear.*'q_lin'"):
        target_modules(
            {**lora, "target_modules": ["q_lin", "qkv"]}, distilbert, linear_layer_names(distilbert, AutoModelForSequenceClassification)
        )
