"""The 24 GB levers on tiny causal LMs: each composes and trains a step; activation checkpointing
and the chunked loss give the plain gradients; compile round-trips checkpoints both ways; the
optimizer paths (fused, 8-bit, stepped in backward) follow the one LR schedule; conflicts are
refused before anything loads."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.core.callbacks.lr_schedule import lr_factor
from {{ cookiecutter.package_name }}.core.config.validate import config_warnings
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.models.levers import enable_activation_checkpointing
from {{ cookiecutter.package_name }}.core.optim import StepInBackward, build_optimizer
from {{ cookiecutter.package_name }}.tasks import check_config
from {{ cookiecutter.package_name }}.tasks.causal_lm.loss import causal_body, chunked_token_loss_sum, token_loss_sum
from {{ cookiecutter.package_name }}.train import train

STEP_IN_BACKWARD = ("optimizer.step_in_backward=true", "trainer.gradient_clip_val=null")


@pytest.mark.parametrize(
    "levers",
    [
        ("attention=eager",),
        ("activation_checkpointing=full",),
        ("loss=chunked", "loss.chunk_size=8"),
        ("optimizer=adamw_8bit",),
        ("optimizer=paged_adamw_8bit",),
        STEP_IN_BACKWARD,
        ("precision=bf16-true", "peft=none"),
        ("precision=bf16-mixed", "activation_checkpointing=full", "loss=chunked"),
    ],
    ids=lambda levers: "+".join(levers),
)
def test_each_lever_trains_a_few_steps(make_lm_cfg, levers):
    cfg = make_lm_cfg(
        "trainer.max_steps=3", "trainer.val_check_interval=3", "callbacks.sample_generation=null", "test_after_fit=false", *levers
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"]), metrics
    assert metrics["val/loss"] < metrics["val/loss_start"] or "precision=bf16-true" in levers, metrics


def _tiny_lm(seed: int = 0) -> AutoModelForCausalLM:
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    return AutoModelForCausalLM.from_config(config).train()


def _grads(model: torch.nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 97, (3, 20))  # (B, T)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = _batch()
    loss = lambda model: token_loss_sum(model(input_ids=ids).logits, ids)[0]  # noqa: E731
    plain = _grads(_tiny_lm(), loss)
    model = _tiny_lm()
    enable_activation_checkpointing(model)
    on = model.is_activation_checkpointing if hasattr(type(model), "is_activation_checkpointing") else model.is_gradient_checkpointing
    assert on and model.config.use_cache is False
    checkpointed = _grads(model, loss)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_chunked_loss_gives_the_plain_loss_and_gradients():
    ids = _batch()
    labels = ids.clone()
    labels[0, 15:] = -100  # padding in one row
    plain_loss = lambda model: token_loss_sum(model(input_ids=ids).logits, labels)[0]  # noqa: E731

    def chunked_loss(model):
        hidden = causal_body(model)(input_ids=ids).last_hidden_state  # (B, T, D)
        return chunked_token_loss_sum(hidden, model.get_output_embeddings(), labels, chunk_size=6)[0]  # 20 = 6+6+6+2

    model = _tiny_lm()
    assert chunked_loss(model).item() == pytest.approx(plain_loss(model).item(), rel=1e-6)
    assert (
        chunked_token_loss_sum(causal_body(model)(input_ids=ids).last_hidden_state, model.lm_head, labels, 6)[1]
        == token_loss_sum(model(input_ids=ids).logits, labels)[1]
    )
    plain, chunked = _grads(_tiny_lm(), plain_loss), _grads(_tiny_lm(), chunked_loss)
    for name, grad in plain.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_step_in_backward_makes_the_same_update_as_adamw():
    ids = _batch()
    options = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "fused": None}
    reference, fused_in_backward = _tiny_lm(), _tiny_lm()
    optimizer = build_optimizer(reference, {**options, "step_in_backward": False})
    in_backward = build_optimizer(fused_in_backward, {**options, "step_in_backward": True})
    assert isinstance(in_backward, StepInBackward)
    for _ in range(3):
        for model in (reference, fused_in_backward):
            token_loss_sum(model(input_ids=ids).logits, ids)[0].div(60).backward()
        optimizer.step()
        optimizer.zero_grad()
        in_backward.step()
        assert all(p.grad is None for p in fused_in_backward.parameters())  # freed inside backward
    for (name, p), q in zip(reference.named_parameters(), fused_in_backward.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    # Its state round-trips (checkpoints, resume): same moments after load_state_dict.
    fresh = build_optimizer(_tiny_lm(), {**options, "step_in_backward": True})
    fresh.load_state_dict(in_backward.state_dict())
    first = next(iter(in_backward.inner.values())).state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(next(iter(fresh.inner.values())).state_dict()["state"][0]["exp_avg"], first)


class RecordLR(L.Callback):
    """The LR each parameter is actually stepped with (the inner optimizers' under step_in_backward)."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, StepInBackward):
            self.lrs.append(next(iter(optimizer.inner.values())).param_groups[0]["lr"])
        else:
            self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("path", [("optimizer=adamw",), ("optimizer=adamw_8bit",), STEP_IN_BACKWARD], ids=lambda p: p[0])
def test_every_optimizer_path_follows_the_same_lr_schedule(make_lm_cfg, monkeypatch, path):
    recorder = RecordLR()
    from {{ cookiecutter.package_name }}.core.callbacks.build import instantiate_callbacks as build

    monkeypatch.setattr("{{ cookiecutter.package_name }}.train.instantiate_callbacks", lambda cfg: [*build(cfg), recorder])
    cfg = make_lm_cfg(
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "callbacks.sample_generation=null",
        "lr_schedule=cosine_warmup",
        "lr_schedule.warmup_ratio=0.34",
        "optimizer.lr=1e-3",
        "test_after_fit=false",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=4",
        *path,
    )
    train(cfg)
    expected = [1e-3 * lr_factor(step, 6, 2, "cosine", cfg.lr_schedule.min_lr_ratio) for step in range(6)]
    assert recorder.lrs == pytest.approx(expected), (recorder.lrs, expected)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("precision=16-mixed", "trainer=cpu"), "precision=16-mixed needs a CUDA GPU"),
        (("optimizer.step_in_backward=true", "batch.micro_batch_size=4"), "accumulates 2"),
        (("optimizer.step_in_backward=true",), "trainer.gradient_clip_val=null"),
        (("attention=flash_attention_2",), "pip install flash-attn"),
        (("activation_checkpointing.mode=selective",), "activation_checkpointing.mode='selective'"),
        (("compile.mode=fast",), "compile.mode='fast'"),
        (("loss=chunked", "loss.chunk_size=0"), "loss.chunk_size=0"),
        (("loss=liger", "trainer=cpu"), "loss=liger needs a CUDA GPU and the liger-kernel package"),
        (("loss.implementation=fused",), "loss.implementation='fused'"),
        (("hardware.bf16=false", "precision=bf16-mixed"), "which has no bf16"),
        (("activation_checkpointing=none", "activation_checkpointing.offload=true"), "fix: activation_checkpointing=offload"),
        (("activation_checkpointing=offload", "compile=default"), "activation_checkpointing.offload=true with compile=default"),
        (("activation_checkpointing.offload=yes",), "activation_checkpointing.offload='yes' must be true or false"),
        (("activation_checkpointing.offload_min_bytes=-1",), "offload_min_bytes=-1"),
        (("activation_checkpointing.mlp_tiles=0",), "mlp_tiles=0 must be a whole number >= 1"),
        (("activation_checkpointing.mlp_tiles=1000",), "mlp_tiles=1000 is more than data.max_length"),
        (("attention=flex_attention", "trainer=cpu"), "attention=flex_attention trains on a CUDA GPU only"),
    ],
)
def test_lever_conflicts_are_refused_before_anything_loads(make_lm_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("=", "=")):
        check_config(make_lm_cfg(*overrides))


def test_8bit_optimizer_without_bitsandbytes_names_the_install(make_lm_cfg, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install 'bitsandbytes"):
        check_config(make_lm_cfg("optimizer=adamw_8bit"))


def test_bf16_true_full_fine_tune_is_warned_about(make_lm_cfg, pretrained_lm_dir):
    cfg = make_lm_cfg("precision=bf16-true", f"model.name_or_path={pretrained_lm_dir}", "model.config=null")
    assert any("rounds away" in warning for warning in config_warnings(cfg))
    assert not config_warnings(make_lm_cfg("precision=bf16-mixed", f"model.name_or_path={pretrained_lm_dir}", "model.config=null"))
    with pytest.warns(UserWarning, match="bf16-true with a full fine-tune"):
        train(make_lm_cfg("precision=bf16-true", f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "debug=fdr"))
