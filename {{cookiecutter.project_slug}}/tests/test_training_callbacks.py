"""Early stopping (Lightning's callback, ``callbacks=early_stopping``), NEFTune
(``callbacks=neftune``) and the EMA of the trained weights (``callbacks=ema``): what each changes,
and that early stopping's counters and both sets of EMA weights survive a resume."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.core.callbacks.ema import EMA
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.tasks import check_config
from {{ cookiecutter.package_name }}.tasks.causal_lm.neftune import NEFTune, row_lengths
from {{ cookiecutter.package_name }}.train import train

from .conftest import with_task


def test_row_lengths_are_each_rows_own_padded_or_packed():
    padded = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    assert row_lengths(padded).tolist() == [[3, 3, 3, 0], [2, 2, 0, 0]]
    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert row_lengths(packed).tolist() == [[3, 3, 3, 2, 2, 1]]
    assert row_lengths({"input_ids": torch.zeros(2, 5, dtype=torch.long)}).tolist() == [[5] * 5] * 2


def test_neftune_noise_is_per_row_in_training_only_and_bounded_by_the_paper_scale():
    from .conftest import tiny_llama_config

    torch.manual_seed(0)
    module = SimpleNamespace(model=AutoModelForCausalLM.from_config(tiny_llama_config(128)))  # what the callback reads
    embedding = module.model.get_input_embeddings()
    width = embedding.embedding_dim
    ids = torch.randint(0, embedding.num_embeddings, (2, 64))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][1, 16:] = 0  # row 1: 16 tokens, then padding
    clean = embedding(ids).detach()

    neftune = NEFTune(alpha=10.0)
    neftune.on_fit_start(None, module)
    neftune.on_train_batch_start(None, module, batch, 0)
    module.model.train()
    noise = embedding(ids).detach() - clean
    for row, length in ((0, 64), (1, 16)):
        bound = 10.0 / math.sqrt(length * width)
        seen = noise[row, :length].abs().max().item()
        assert 0.9 * bound < seen <= bound * (1 + 1e-6), (row, seen, bound)
    assert torch.equal(noise[1, 16:], torch.zeros_like(noise[1, 16:]))  # padding untouched
    module.model.eval()  # validation / generation inside the fit: no noise
    assert torch.equal(embedding(ids), clean)
    module.model.train()
    neftune.on_train_batch_end(None, module, None, batch, 0)  # between batches: no noise either
    assert torch.equal(embedding(ids), clean)
    neftune.on_fit_end(None, module)
    with pytest.raises(ValueError, match=r"callbacks.neftune.alpha=0 must be a positive number"):
        NEFTune(alpha=0)


def test_neftune_changes_the_training_loss_and_not_the_validation(make_lm_cfg, tmp_path):
    common = ("trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.sample_generation=null")
    plain = train(make_lm_cfg(*common))
    noisy = train(make_lm_cfg(*common, "callbacks=neftune", "callbacks.neftune.alpha=15", f"paths.output_dir={tmp_path / 'noisy'}"))
    assert noisy["val/loss_start"] == plain["val/loss_start"]  # the same weights validated without noise
    assert noisy["train/loss"] != plain["train/loss"]


def _last_step(run_dir) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def test_early_stopping_stops_after_patience_validations_and_its_counters_survive_a_resume(make_lm_cfg, tmp_path):
    # min_delta=100: only the first validation counts as an improvement (from +inf), so with
    # patience 2 an uninterrupted fit stops after the validation of step 3.
    stop = ("callbacks=early_stopping", "callbacks.early_stopping.patience=2", "callbacks.early_stopping.min_delta=100")
    common = (*stop, "trainer.val_check_interval=1", "callbacks.sample_generation=null")
    train(make_lm_cfg(*common, "trainer.max_steps=20"))
    assert _last_step(tmp_path / "run") == 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["callbacks"]
    assert [value["wait_count"] for key, value in state.items() if key.startswith("EarlyStopping")] == [2]

    resumed = tmp_path / "resumed"  # a fit stopped at step 2 (a kill would leave the same last.ckpt), then resumed
    first = train(make_lm_cfg(*common, "trainer.max_steps=2", "paths.output_dir=" + str(resumed)))
    assert math.isfinite(first["val/loss"]) and _last_step(resumed) == 2  # one validation without improvement so far
    train(make_lm_cfg(*common, "trainer.max_steps=20", "paths.output_dir=" + str(resumed), "ckpt_path=last"))
    assert _last_step(resumed) == 3  # a fresh counter would have stopped at step 5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("experiment=demo_lm_lora", "callbacks=neftune", "callbacks.neftune.alpha=-1"),
            r"callbacks.neftune.alpha=-1 must be a positive number .*fix: callbacks.neftune.alpha=5",
        ),
        (
            ("experiment=demo_lm_lora", "callbacks=neftune", "compile=default"),
            r"callbacks=neftune with compile=default: .*fix: compile=off",
        ),
        (("callbacks=neftune",), r"callbacks=neftune with task=classification: .*fix: callbacks=default"),
        (("callbacks=neftune", "experiment=demo_dpo_sentiment"), r"callbacks=neftune with task=preference: .*fix: callbacks=default"),
    ],
)
def test_neftune_settings_it_cannot_take_are_refused_before_anything_loads(overrides, message, tmp_path):
    from .conftest import compose_config

    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, runs_here=False)


def test_ema_follows_its_recurrence_once_per_optimizer_step():
    module = torch.nn.Linear(3, 2)
    module.bias.requires_grad_(False)  # frozen: never averaged
    module.trainer = SimpleNamespace(global_step=0)
    ema = EMA(decay=0.75)
    ema._ready(module)
    start = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    ema.on_train_batch_end(module.trainer, module, None, None, 0)  # a micro-batch with no optimizer step: no update
    assert torch.equal(ema.averaged["weight"], start) and set(ema.averaged) == {"weight"}
    module.trainer.global_step = 1
    ema.on_train_batch_end(module.trainer, module, None, None, 1)
    torch.testing.assert_close(ema.averaged["weight"], 0.75 * start + 0.25 * (start + 1.0), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"callbacks.ema.decay=1 must be in \(0, 1\)"):
        EMA(decay=1)


def _checkpoint(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_ema_is_what_checkpoints_hold_and_a_resume_continues_both_weight_sets_bit_identically(make_lm_cfg, tmp_path):
    common = (
        "callbacks=ema",
        "callbacks.ema.decay=0.5",
        "lr_schedule=constant",  # (a schedule over max_steps would differ between a 3-step and a 4-step fit)
        "trainer.val_check_interval=2",
        "callbacks.sample_generation=null",
        "optimizer.lr=1e-2",
    )
    whole = train(make_lm_cfg(*common, "trainer.max_steps=4"))
    last = _checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    raw = last["callbacks"]["EMA"]["raw"]
    assert "model.model.embed_tokens.weight" in raw and "model.lm_head.weight" not in raw  # tied: one tensor, one entry
    assert torch.equal(last["state_dict"]["model.lm_head.weight"], last["state_dict"]["model.model.embed_tokens.weight"])
    assert all(not torch.equal(last["state_dict"][name], raw[name]) for name in raw if name.endswith("q_proj.weight"))
    best = _checkpoint(next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt")))
    if best["global_step"] == last["global_step"]:  # the best is the same step: the same average
        assert all(torch.equal(best["state_dict"][name], last["state_dict"][name]) for name in raw)
    plain = train(make_lm_cfg(*common[2:], "trainer.max_steps=4", f"paths.output_dir={tmp_path / 'plain'}"))
    assert whole["val/loss_start"] == plain["val/loss_start"] and whole["val/loss"] != plain["val/loss"]  # validated on the average

    # 3 steps, then resumed to 4: the same raw weights and the same average
    resumed = tmp_path / "resumed"
    train(make_lm_cfg(*common, "trainer.max_steps=3", f"paths.output_dir={resumed}"))
    train(make_lm_cfg(*common, "trainer.max_steps=4", f"paths.output_dir={resumed}", "ckpt_path=last"))
    again = _checkpoint(resumed / "checkpoints" / "last.ckpt")
    assert again["global_step"] == last["global_step"] == 4
    for name in raw:
        assert torch.equal(again["state_dict"][name], last["state_dict"][name]), name
        assert torch.equal(again["callbacks"]["EMA"]["raw"][name], raw[name]), name


def test_the_planner_counts_the_average_of_the_trained_weights(tmp_path):
    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory

    from .test_planner import TINY_LM, plan_cfg

    one = ("batch.micro_batch_size=1", "batch.global_batch_size=1", f"paths.output_dir={tmp_path}")
    without = plan_memory(*with_task(plan_cfg(*TINY_LM, *one)), search=False)
    with_ema = plan_memory(*with_task(plan_cfg(*TINY_LM, *one, "callbacks=ema")), search=False)
    assert with_ema.counts["ema_bytes"] == 4 * with_ema.counts["trainable"] > 0
    assert with_ema.optimizer - without.optimizer == with_ema.counts["ema_bytes"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("callbacks.ema.decay=1.5",), r"callbacks.ema.decay=1.5 must be in \(0, 1\)"),
        (("precision=bf16-true",), r"callbacks=ema with precision=bf16-true: .*fix: precision=bf16-mixed"),
        (("optimizer.step_in_backward=true", "batch.accumulate_grad_batches=1"), r"callbacks=ema with optimizer.step_in_backward=true"),
        (("pruning=magnitude",), r"callbacks=ema with pruning=magnitude: .*fix: pruning=none"),
        (("trainer=fsdp",), r"callbacks=ema with trainer=fsdp: .*fix: trainer=ddp"),
    ],
)
def test_ema_settings_it_cannot_take_are_refused_before_anything_loads(overrides, message, tmp_path):
    from .conftest import compose_config

    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", "callbacks=ema", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, runs_here=False)
