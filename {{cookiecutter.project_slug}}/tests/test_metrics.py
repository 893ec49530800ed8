"""Metric values on constructed data with known answers, and the optimizer's param groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.core.models.metrics import PendingUpdates
from {{ cookiecutter.package_name }}.core.optim import build_optimizer, optimizer_factory, param_groups
from {{ cookiecutter.package_name }}.tasks.classification.module import classification_metrics


def one_hot_logits(predictions: list[int], num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(predictions), num_classes).float()


def test_accuracy_and_macro_f1_match_hand_computed_values():
    # targets:     0 0 0 0 1 1 2 2
    # predictions: 0 0 0 1 1 2 2 2
    targets = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    predictions = [0, 0, 0, 1, 1, 2, 2, 2]
    metrics = classification_metrics(3, "val")
    metrics.update(one_hot_logits(predictions, 3), targets)
    values = metrics.compute()
    # accuracy = 6 correct / 8 rows
    assert values["val/acc"].item() == pytest.approx(6 / 8)
    # per-class F1 = 2PR/(P+R): class 0: P=3/3, R=3/4 -> 6/7; class 1: P=1/2, R=1/2 -> 1/2;
    # class 2: P=2/3, R=2/2 -> 4/5; macro = unweighted mean
    assert values["val/f1_macro"].item() == pytest.approx((6 / 7 + 1 / 2 + 4 / 5) / 3)


def test_metrics_accumulate_over_batches_like_one_batch():
    targets = torch.tensor([1, 0, 1, 1, 0, 0])
    predictions = [1, 1, 1, 0, 0, 0]
    whole, split = classification_metrics(2, "test"), classification_metrics(2, "test")
    whole.update(one_hot_logits(predictions, 2), targets)
    split.update(one_hot_logits(predictions[:4], 2), targets[:4])
    split.update(one_hot_logits(predictions[4:], 2), targets[4:])
    assert {k: v.item() for k, v in whole.compute().items()} == {k: v.item() for k, v in split.compute().items()}
    assert whole.compute()["test/acc"].item() == pytest.approx(4 / 6)


class TinyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


@pytest.mark.parametrize("every", [1, 4, 64])
def test_training_updates_gathered_give_the_figures_of_per_batch_updates(every):
    """``PendingUpdates`` (the training metrics' updates, applied a few micro-batches at a time):
    the same accuracy and macro F1 as one update per micro-batch of logits, for micro-batches of
    any size, with the last partial group flushed at the epoch's end."""
    generator = torch.Generator().manual_seed(0)
    each, gathered = classification_metrics(3, "train"), classification_metrics(3, "train")
    pending = PendingUpdates(gathered, every=every)
    for rows in [8, 8, 5, 8, 1, 8, 8, 3, 8, 7]:
        logits = torch.randn(rows, 3, generator=generator)
        labels = torch.randint(0, 3, (rows,), generator=generator)
        each.update(logits, labels)
        pending.add(logits.argmax(dim=-1), labels)
    assert len(pending.predictions) == 10 % every  # applied in whole groups so far
    pending.flush()
    assert not pending.predictions
    expected, got = each.compute(), gathered.compute()
    assert 0.2 < expected["train/acc"].item() < 0.6  # not a trivial all-right or all-wrong case
    assert {k: v.item() for k, v in got.items()} == {k: v.item() for k, v in expected.items()}


def test_no_weight_decay_on_biases_and_norms_and_frozen_params_left_out():
    model = TinyEncoder()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.embed.weight), id(model.linear.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model.linear.bias), id(model.norm.weight), id(model.norm.bias)}


def test_optimizer_factory_builds_the_configured_class_with_its_options():
    optimizer = build_optimizer(TinyEncoder(), {"name": "adamw", "lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05})
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert all(g["lr"] == 3e-4 and tuple(g["betas"]) == (0.8, 0.9) for g in optimizer.param_groups)


@pytest.mark.parametrize(
    ("fused", "allowed", "expected"),
    [(None, True, (True, None)), (None, False, (False, True)), (False, True, (False, None)), (True, True, (True, None))],
)
def test_fused_null_is_the_fused_kernel_unless_lightning_would_refuse_it_then_for_each(fused, allowed, expected):
    optimizer_cfg = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "fused": fused}
    optimizer = optimizer_factory(optimizer_cfg, "cpu", fused_allowed=allowed)([{"params": [nn.Parameter(torch.zeros(2))]}])
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == expected
    assert (
        optimizer_factory({**optimizer_cfg, "fused": None}, "mps")([{"params": [nn.Parameter(torch.zeros(2))]}]).defaults["fused"] is False
    )


def test_a_mixed_precision_run_that_clips_gets_a_for_each_optimizer_lightning_accepts(make_cfg):
    from {{ cookiecutter.package_name }}.train import train

    # Lightning's mixed-precision plugin refuses to clip for a fused optimizer (bf16 too).
    metrics = train(make_cfg("precision=bf16-mixed", "trainer.max_steps=2", "test_after_fit=false"))
    assert metrics["train/loss"] > 0


def test_fused_true_with_mixed_precision_and_clipping_is_refused_before_anything_loads(make_cfg):
    from {{ cookiecutter.package_name }}.core.errors import ConfigError
    from {{ cookiecutter.package_name }}.tasks import check_config

    with pytest.raises(ConfigError, match=r"optimizer\.fused=true with precision=bf16-mixed .*fix: optimizer\.fused=null"):
        check_config(make_cfg("precision=bf16-mixed", "optimizer.fused=true"))
