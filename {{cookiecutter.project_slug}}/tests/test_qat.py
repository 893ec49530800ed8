"""Quantization-aware training (``qat=int8a_int4w``, torchao) on a 2-layer BERT and a tiny Llama."""

from __future__ import annotations

import pytest
import torch

from {{ cookiecutter.package_name }}.core.compress.qat import convert_qat, prepare_qat, qat_problems
from {{ cookiecutter.package_name }}.core.errors import ConfigError
{%- if cookiecutter.tasks != "causal_lm" %}
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule
{%- endif %}
from {{ cookiecutter.package_name }}.train import train

QAT = {"scheme": "int8a_int4w", "group_size": 32}
# Each conflict of qat with another choice, and the words its refusal must contain.
CONFLICTS = [
    (["qat.scheme=int4"], "qat.scheme='int4' is not one of"),
    (["qat.group_size=48"], r"qat.group_size=48 does not divide the model's hidden size \(\d+\)"),
    (["qat.group_size=0"], "qat.group_size=0 must be a positive integer"),
    (["optimizer.step_in_backward=true", "batch.global_batch_size={micro}"], "optimizer.step_in_backward=false"),
    (["peft=lora"], "fix: peft=none"),
]


@pytest.fixture
def tiny_bert_model():
    """A 2-layer BERT classifier with random weights (hidden 64, intermediate 128)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_labels=2)
    return BertForSequenceClassification(config)


def test_convert_of_plain_weights_is_the_post_training_quantization_of_the_same_scheme(tiny_bert_model):
    model = tiny_bert_model.eval()
    batch = torch.randint(5, 100, (2, 10))
    with torch.no_grad():
        before = model(input_ids=batch).logits
        after = convert_qat(model, QAT)(input_ids=batch).logits
    assert not torch.equal(before, after)  # rounded to int4 weights ...
    torch.testing.assert_close(after, before, atol=0.2, rtol=0.2)  # ... close to the float outputs


def test_layers_the_group_does_not_divide_keep_full_precision(tiny_bert_model):
    count = prepare_qat(tiny_bert_model, {"scheme": "int8a_int4w", "group_size": 128})
    assert count == 2  # only the intermediate-to-output layers (in_features 128) of the two layers
    with pytest.raises(ConfigError, match="qat.group_size=256"):
        prepare_qat(tiny_bert_model, {"scheme": "int8a_int4w", "group_size": 256})


def test_qat_problems_is_empty_for_none_and_for_a_valid_scheme():
    assert qat_problems({"scheme": "none"}) == []
    assert qat_problems(QAT, {"step_in_backward": False}, {"method": "none"}) == []


def test_a_tied_lm_head_stays_tied_and_unquantised():
    from torchao.quantization.qat import FakeQuantizedLinear
    from transformers import AutoModelForCausalLM

    from .conftest import tiny_llama_config

    model = AutoModelForCausalLM.from_config(tiny_llama_config(128, tie_word_embeddings=True))
    count = prepare_qat(model, QAT)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert not isinstance(model.lm_head, FakeQuantizedLinear)
    assert count == sum(isinstance(layer, FakeQuantizedLinear) for layer in model.modules()) > 0
{%- if cookiecutter.tasks != "causal_lm" %}


@pytest.fixture(scope="module")
def qat_run(tokenizer_dir, toy_data, tmp_path_factory):
    from .conftest import compose_config, tiny_overrides

    run_dir = tmp_path_factory.mktemp("qat") / "run"
    overrides = tiny_overrides(tokenizer_dir, toy_data, run_dir) + ["qat=int8a_int4w", "trainer.max_epochs=6", "optimizer.lr=2e-3"]
    return run_dir, train(compose_config("train", overrides))


def test_qat_trains_with_fake_quantised_linear_layers_and_learns(qat_run):
    run_dir, metrics = qat_run
    module = SequenceClassificationModule.load_from_checkpoint(metrics["best_checkpoint"], map_location="cpu")
    module.configure_model()
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    fake = [name for name, layer in module.model.named_modules() if isinstance(layer, FakeQuantizedLinear)]
    assert len(fake) == 2 * 6 + 2  # per layer q, k, v, attention output, intermediate, output; the pooler and the head
    assert isinstance(module.model.get_input_embeddings(), FakeQuantizedEmbedding)  # int8 rows, as quantize stores it
    assert metrics["test/acc"] >= 0.8, metrics


def test_a_qat_checkpoint_holds_plain_weight_names_and_eval_scores_the_fake_quantised_model(qat_run, make_cfg):
    run_dir, metrics = qat_run
    state = torch.load(metrics["best_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    assert not [key for key in state if "fake_quantizer" in key]
    again = evaluate(make_cfg(f"ckpt_path={metrics['best_checkpoint']}", config_name="eval"))  # the checkpoint names its qat
    assert again["test/acc"] == pytest.approx(metrics["test/acc"])


def test_convert_gives_the_fake_quantised_outputs_with_integer_weights(qat_run):
    run_dir, metrics = qat_run
    module = SequenceClassificationModule.load_from_checkpoint(metrics["best_checkpoint"], map_location="cpu")
    module.configure_model()
    model = module.model.eval()
    batch = torch.randint(5, model.config.vocab_size, (4, 12))
    with torch.no_grad():
        fake = model(input_ids=batch).logits
        converted = convert_qat(model, QAT)(input_ids=batch).logits
    assert type(model.bert.encoder.layer[0].attention.self.query.weight).__name__ != "Parameter"
    torch.testing.assert_close(converted, fake, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("overrides", "message"), CONFLICTS)
def test_qat_conflicts_are_refused_before_any_weights_load(make_cfg, monkeypatch, overrides, message):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the config was checked")

    monkeypatch.setattr(SequenceClassificationModule, "configure_model", no_weights)
    with pytest.raises(ConfigError, match=message):
        train(make_cfg("qat=int8a_int4w", *(o.format(micro=16) for o in overrides)))
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


def test_a_causal_lm_trains_with_qat(make_lm_cfg):
    metrics = train(make_lm_cfg("qat=int8a_int4w", "debug=fdr"))
    assert metrics["train/loss"] > 0


@pytest.mark.parametrize("lever", ["qat=int8a_int4w", "pruning=magnitude", "pruning=semi_structured_2_4"])
def test_levers_of_linear_layers_refuse_gpt2s_conv1d_blocks_before_anything_loads(lm_tokenizer_dir, lm_text, tmp_path, lever):
    from {{ cookiecutter.package_name }}.tasks import check_config

    from .conftest import compose_config, lm_overrides

    cfg = compose_config("train", [*lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "run", model="tiny_gpt2"), lever])
    with pytest.raises(ConfigError, match=rf"{lever} acts on nn.Linear layers, and model_type='gpt2' builds .* Conv1D; fix: "):
        check_config(cfg)


@pytest.mark.parametrize(("overrides", "message"), CONFLICTS)
def test_qat_conflicts_of_a_causal_lm_are_refused_before_any_weights_load(make_lm_cfg, monkeypatch, overrides, message):
    from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the config was checked")

    monkeypatch.setattr(CausalLMModule, "configure_model", no_weights)
    with pytest.raises(ConfigError, match=message):
        train(make_lm_cfg("qat=int8a_int4w", *(o.format(micro=8) for o in overrides)))
{%- endif %}
