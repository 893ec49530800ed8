"""Pruning during training (core/compress/pruning.py, core/callbacks/pruning.py): the schedule, the masks of
each method, checkpoints and resume, shrinking the FFN, and the refusals.  Tiny random models."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from transformers import BertConfig, BertForSequenceClassification, LlamaForCausalLM

from {{ cookiecutter.package_name }}.core.callbacks.pruning import Pruning
from {{ cookiecutter.package_name }}.core.compress.pruning import (
    block_linears,
    ffn_blocks,
    is_two_four,
    pruning_problems,
    scheduled_sparsity,
    shrink_ffn,
    to_semi_structured_sparse,
)
from {{ cookiecutter.package_name }}.core.errors import ConfigError
{%- if cookiecutter.tasks != "causal_lm" %}
from {{ cookiecutter.package_name }}.tasks import check_config
{%- endif %}

from .conftest import tiny_llama_config

MAGNITUDE = {"method": "magnitude", "begin_step": 2, "end_step": 10, "final_sparsity": 0.5, "frequency": 2}


def tiny_bert(**changes) -> BertForSequenceClassification:
    torch.manual_seed(0)
    sizes = {"vocab_size": 40, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
    return BertForSequenceClassification(BertConfig(**{**sizes, **changes})).eval()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=40)).eval()


class Holder(L.LightningModule):
    """A LightningModule holding ``model`` as ``self.model``, as the task modules do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def started(model: nn.Module, **settings) -> tuple[Pruning, Holder]:
    """A Pruning callback after ``on_fit_start`` on ``model`` (no trainer needed for the masks)."""
    callback, holder = Pruning(**{**MAGNITUDE, **settings}), Holder(model)
    callback.on_fit_start(None, holder)
    return callback, holder


def masks(callback: Pruning) -> dict[str, torch.Tensor]:
    return {key: mask.clone() for key, mask in callback.state_dict()["masks"].items()}


# --------------------------------------------------------------------------- schedule
def test_the_schedule_is_zhu_and_gupta_cubic_ramp_held_between_pruning_points():
    begin, end, final, every = 10, 50, 0.8, 5
    values = [scheduled_sparsity(t, begin, end, final, every) for t in range(70)]
    assert values[:begin] == [0.0] * begin and values[begin] == 0.0  # s_i = 0 at t0
    for t in range(begin, end + 1, every):  # eq. 1 at t0 + k dt
        assert values[t] == pytest.approx(final * (1 - (1 - (t - begin) / (end - begin)) ** 3))
        assert values[t : t + every] == [values[t]] * len(values[t : t + every])  # held until the next point
    assert values[end:] == [final] * (70 - end)
    assert all(a <= b for a, b in zip(values, values[1:]))
    # a frequency that does not divide the ramp still ends at end_step
    assert scheduled_sparsity(49, 10, 50, 0.8, 7) < 0.8 == scheduled_sparsity(50, 10, 50, 0.8, 7)


# ---------------------------------------------------------------------------- magnitude
def test_magnitude_masks_only_block_linears_grow_monotonically_and_end_exact():
    model = tiny_bert()
    callback, _ = started(model)
    linears = {layer for _, layer in block_linears(model)}
    assert len(linears) == 2 * 6  # q, k, v, attention output, intermediate, output per block
    previous = None
    for step in range(13):
        callback.update(step)
        now = masks(callback)
        if previous:
            assert all(bool((previous[k] >= now[k]).all()) for k in previous)  # a masked weight stays masked
        previous = now
        expected = round(
            scheduled_sparsity(step, **{k: MAGNITUDE[k] for k in ("begin_step", "end_step", "final_sparsity", "frequency")})
            * callback.weights
        )
        assert callback.pruned == expected
    zeros = sum(int((layer.weight == 0).sum()) for layer in linears)
    assert zeros == round(0.5 * callback.weights) == callback.pruned  # the integer amount: exact
    assert callback.sparsity == pytest.approx(0.5, abs=1 / callback.weights)
    pruned_modules = {m for m in model.modules() if any(name.endswith("_mask") for name, _ in m.named_buffers(recurse=False))}
    assert pruned_modules == linears  # not embeddings, pooler or classifier
    assert callback.sparsity_model == pytest.approx(callback.pruned / sum(p.numel() for p in model.parameters()))


def test_the_checkpoint_holds_plain_weights_and_a_resume_restores_the_masks():
    model = tiny_bert()
    callback, holder = started(model)
    callback.update(6)
    optimizer_params = list(holder.parameters())  # as the optimizer saw them
    checkpoint = {"state_dict": holder.state_dict()}
    callback.on_save_checkpoint(None, holder, checkpoint)
    state = checkpoint["state_dict"]
    assert not [key for key in state if key.endswith(("_orig", "_mask"))]
    plain = Holder(tiny_bert())
    plain.load_state_dict(state)  # strict: a module without pruning takes it
    x = torch.randint(0, 40, (2, 8))
    assert torch.equal(plain.model(input_ids=x).logits, model(input_ids=x).logits)

    # resume: a fresh run loads the plain state, builds its optimizer, then the callback re-applies the masks
    resumed_model = tiny_bert()
    resumed_holder = Holder(resumed_model)
    resumed_holder.load_state_dict(state)
    parameters = list(resumed_holder.parameters())
    resumed = Pruning(**MAGNITUDE)
    resumed.load_state_dict(callback.state_dict())
    resumed.on_fit_start(None, resumed_holder)
    assert {k: bool(torch.equal(v, masks(callback)[k])) for k, v in masks(resumed).items()} == dict.fromkeys(masks(callback), True)
    assert (resumed.pruned, resumed.step) == (callback.pruned, 6)
    assert {id(p) for p in resumed_holder.parameters()} == {id(p) for p in parameters}  # the optimizer's tensors
    assert len(optimizer_params) == len(parameters)
    resumed.update(10), callback.update(10)  # the schedule goes on from the restored masks alike
    assert {k: bool(torch.equal(v, masks(callback)[k])) for k, v in masks(resumed).items()} == dict.fromkeys(masks(callback), True)


def test_end_of_training_makes_the_masks_permanent():
    model = tiny_bert()
    callback, holder = started(model)
    callback.update(10)
    callback.on_train_end(None, holder)
    assert not prune.is_pruned(model)
    assert sum(int((layer.weight == 0).sum()) for _, layer in block_linears(model)) == callback.pruned


# --------------------------------------------------------------------------- structured
@pytest.mark.parametrize("build", [tiny_bert, tiny_llama], ids=["bert", "llama"])
def test_structured_prunes_the_same_neurons_count_per_block_and_shrink_keeps_the_outputs(build, tmp_path):
    model = build()
    callback, holder = started(model, method="structured", final_sparsity=0.25)
    callback.update(10)
    blocks = ffn_blocks(model)
    dead = [int((block.columns.weight == 0).all(dim=0).sum()) for block in blocks]
    assert dead == [round(0.25 * blocks[0].width)] * len(blocks)
    for block in blocks:
        for layer in block.rows:  # the same neurons' rows are zero
            assert torch.equal((layer.weight == 0).all(dim=1), (block.columns.weight == 0).all(dim=0))
    callback.on_train_end(None, holder)
    x = torch.randint(0, 40, (2, 8))
    before = model(input_ids=x).logits
    n_before = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "full")
    shrink_ffn(model)
    assert model.config.intermediate_size == blocks[0].width - dead[0]
    assert sum(p.numel() for p in model.parameters()) < n_before
    torch.testing.assert_close(model(input_ids=x).logits, before)
    model.save_pretrained(tmp_path / "shrunk")
    reloaded = type(model).from_pretrained(tmp_path / "shrunk").eval()
    torch.testing.assert_close(reloaded(input_ids=x).logits, before)
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("full", "shrunk")}
    assert size["shrunk"] < size["full"]


def test_structured_refuses_an_architecture_it_does_not_know():
    problems = pruning_problems({**MAGNITUDE, "method": "structured"}, model={"config": {"model_type": "gpt2"}})
    assert any("model_type='gpt2'" in p and "pruning=structured" in p for p in problems), problems


# ----------------------------------------------------------------------------- 2:4
def test_two_four_pattern_is_applied_once_at_begin_step():
    model = tiny_bert()
    callback, _ = started(model, method="semi_structured_2_4", begin_step=3, end_step=None, frequency=None)
    callback.update(2)
    assert callback.pruned == 0
    callback.update(3)
    for _, layer in block_linears(model):
        assert is_two_four(layer.weight)
        assert int((layer.weight.reshape(-1, 4) == 0).sum()) == layer.weight.numel() // 2
    assert callback.sparsity == 0.5
    before = masks(callback)
    callback.update(50)
    assert all(torch.equal(before[k], v) for k, v in masks(callback).items())  # once


def test_two_four_refuses_inputs_not_divisible_by_4():
    model = tiny_bert(hidden_size=66, num_attention_heads=2, intermediate_size=128)
    with pytest.raises(ConfigError, match="in_features divisible by 4"):
        started(model, method="semi_structured_2_4", end_step=None, frequency=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_the_sparse_kernel_conversion_says_it_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        to_semi_structured_sparse(tiny_bert())


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "changes, field",
    [
        ({"method": "random"}, "pruning.method='random'"),
        ({"begin_step": 10, "end_step": 10}, "pruning.begin_step=10 >= pruning.end_step=10"),
        ({"final_sparsity": 1.0}, "pruning.final_sparsity=1.0"),
        ({"final_sparsity": -0.1}, "pruning.final_sparsity=-0.1"),
        ({"frequency": 0}, "pruning.frequency=0"),
        ({"method": "semi_structured_2_4", "end_step": None, "frequency": None, "final_sparsity": 0.6}, "pruning.final_sparsity=0.6"),
        ({"method": "semi_structured_2_4", "frequency": None}, "pruning.end_step=10"),
    ],
)
def test_bad_values_are_refused_naming_the_field(changes, field):
    problems = pruning_problems({**MAGNITUDE, **changes})
    assert any(field in p and "fix" in p for p in problems), problems
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        Pruning(**{**MAGNITUDE, **changes})


{%- if cookiecutter.tasks != "causal_lm" %}


def test_the_config_is_refused_before_weights_load(make_cfg):
    for overrides, expected in [
        (["pruning=magnitude", "peft=lora"], "pruning=magnitude with peft=lora"),
        (["pruning=magnitude", "pruning.end_step=0"], "pruning.begin_step=0 >= pruning.end_step=0"),
        (["pruning=structured", "model.config.model_type=gpt2", "~model.config.intermediate_size"], "model_type='gpt2'"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            check_config(make_cfg(*overrides))
    for name in ("train", "eval", "predict", "plan"):
        cfg = make_cfg("pruning=magnitude", config_name=name)  # the groups compose with every entry point
        assert cfg.pruning.method == "magnitude"


# --------------------------------------------------------------------------- train
def test_train_logs_the_sparsity_in_each_steps_row_and_saves_a_plain_pruned_model(make_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics
    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule
    from {{ cookiecutter.package_name }}.train import train

    cfg = make_cfg(
        "pruning=magnitude",
        "pruning.end_step=4",
        "pruning.frequency=1",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "batch.micro_batch_size=8",
        "test_after_fit=false",
    )
    train(cfg)
    rows = [row for row in read_metrics(tmp_path / "run" / "csv") if row.get("train/loss")]
    sparsity = [float(row["train/sparsity"]) for row in rows]
    assert len(sparsity) == 6 and all(row.get("train/sparsity_model") for row in rows)
    assert sparsity == sorted(sparsity) and sparsity[0] > 0 and sparsity[-1] == pytest.approx(0.5, abs=1e-3)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert not [key for key in checkpoint["state_dict"] if key.endswith(("_orig", "_mask"))]
    module = SequenceClassificationModule.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu")
    weights = [layer.weight for _, layer in block_linears(module.model)]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(0.5, abs=1e-3)
{%- endif %}


def test_an_early_best_checkpoint_is_not_taken_for_the_pruned_model(tmp_path):
    pruning = Pruning(method="magnitude", begin_step=0, end_step=10, final_sparsity=0.5, frequency=2)
    for step in (4, 10, 12):
        torch.save({"global_step": step}, tmp_path / f"step{step}.ckpt")
    final = str(tmp_path / "step12.ckpt")
    with pytest.warns(UserWarning, match=r"saved before pruning reached its final sparsity \(step 10\)"):
        assert pruning.checkpoint_to_test(str(tmp_path / "step4.ckpt"), final, global_step=12) == final
    assert pruning.checkpoint_to_test(str(tmp_path / "step10.ckpt"), final, global_step=12) == str(tmp_path / "step10.ckpt")
    # A run shorter than the schedule: its last step is as far as it got.
    assert pruning.checkpoint_to_test(str(tmp_path / "step4.ckpt"), final, global_step=4) == str(tmp_path / "step4.ckpt")
