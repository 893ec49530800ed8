"""Long-context levers: activation offloading moves exactly what the planner counts and changes no
bit of the loss or the gradients; the tiled MLP gives the untiled outputs and gradients; packed
rows under FlexAttention give SDPA's outputs with the dense mask (slow: compiled); the host budget
is planned; bad combinations are refused before anything loads (their cases are in
``test_levers.py``'s list of lever conflicts)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.memory.planner import GIB, architecture, plan_memory, training_step
from {{ cookiecutter.package_name }}.core.models.levers import (
    ActivationOffload,
    enable_activation_checkpointing,
    enable_activation_offloading,
    enable_tiled_mlp,
)
from {{ cookiecutter.package_name }}.tasks import check_config, task_of
from {{ cookiecutter.package_name }}.train import train

from .conftest import with_task
from .test_planner import TINY_LM, plan_cfg

ONE_STEP = ("batch.micro_batch_size=2", "batch.global_batch_size=2")
OFFLOAD = ("activation_checkpointing=offload", "activation_checkpointing.offload_min_bytes=0")


def _loss_and_grads(cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor], ActivationOffload | None]:
    torch.manual_seed(0)  # the same random weights and batch for every config
    setup = training_step(cfg, task_of(cfg), architecture(cfg), cfg.batch.micro_batch_size)
    loss = setup.loss()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in setup.loss.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, setup.offload


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_offloading_moves_what_the_plan_counts_and_changes_no_bit(precision):
    offloaded = plan_cfg(*TINY_LM, *ONE_STEP, *OFFLOAD, f"precision={precision}")
    checkpointed = plan_cfg(*TINY_LM, *ONE_STEP, "activation_checkpointing=full", f"precision={precision}")
    loss, grads, offload = _loss_and_grads(offloaded)
    plain_loss, plain_grads, none = _loss_and_grads(checkpointed)
    assert none is None
    # What went to the host and back: both layers' inputs and what the final norm saves, real copies.
    layers = offloaded.model.config.num_hidden_layers
    assert offload.tensors >= layers and offload.restored == offload.tensors, vars(offload)
    plan = plan_memory(offloaded, task_of(offloaded), search=False)
    assert (plan.offloaded_tensors, plan.offloaded_bytes) == (offload.tensors, offload.bytes)
    assert plan.host_pinned == offload.pinned >= offload.bytes
    assert plan.as_json()["host_fits"] is True
    # Bit-identical: the loss and every gradient.
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def test_offloading_keeps_parameters_small_tensors_and_ids_on_the_device():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    offload = ActivationOffload([weight], min_bytes=1024)
    assert not offload.offloads(weight) and not offload.offloads(weight.t())  # a saved weight or its view
    assert not offload.offloads(torch.randn(8))  # 32 bytes < 1024
    assert not offload.offloads(torch.zeros(64, 64, dtype=torch.long))  # token ids, masks
    hidden = torch.randn(2, 16, 64)
    assert offload.offloads(hidden)
    packed = offload.pack(hidden)
    back = offload.unpack(packed)
    assert torch.equal(back, hidden) and back.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()
    assert (offload.tensors, offload.bytes, offload.pinned, offload.restored) == (1, 8192, 8192, 1)
    offload.pack(torch.randn(3, 100))  # 1200 bytes: a 2048-byte pinned block
    assert offload.pinned == 8192 + 2048


# A long-sequence Llama from scratch whose step is activation-dominated (small vocabulary, chunked
# loss): one trace takes ~2 s.
LONG_ROWS = (
    "experiment=demo_lm_scratch",
    "model.config.hidden_size=64",
    "model.config.num_hidden_layers=4",
    "model.architecture.vocab_size=256",
    "data.max_length=1024",
    "precision=32-true",
    "loss=chunked",
    "loss.chunk_size=128",
    *ONE_STEP,
)


def test_offloading_lowers_the_planned_gpu_peak_and_plans_the_host():
    # Many thin layers: each layer's saved input (the tensor offloading moves, 512 KiB here)
    # outweighs its gradients, so the checkpointed peak is early in backward, with most layer
    # inputs still held.  (With wide MLPs the gradients grow faster than the inputs are released
    # and the peak is at the end of backward, where nothing is left to offload: 4 layers of
    # intermediate 1024 put it there, by a few hundred KiB either way.)
    base = (*LONG_ROWS, "model.config.num_hidden_layers=12", "model.config.intermediate_size=128")
    checkpointed = plan_memory(*with_task(plan_cfg(*base, "activation_checkpointing=full")), search=False)
    offloaded = plan_memory(*with_task(plan_cfg(*base, *OFFLOAD)), search=False)
    layer_input = 2 * 1024 * 64 * 4  # (B, T, d) fp32: 512 KiB
    assert offloaded.offloaded_tensors >= 4 and offloaded.offloaded_bytes >= 4 * layer_input
    assert offloaded.total <= checkpointed.total - 4 * layer_input, (offloaded.total, checkpointed.total)
    assert offloaded.activations < checkpointed.activations
    assert "Host memory" in offloaded.table("cpu") and offloaded.host_pinned >= offloaded.offloaded_bytes
    # A host budget the offloaded activations exceed: no micro-batch fits, the advice names the host.
    small = plan_memory(*with_task(plan_cfg(*base, *OFFLOAD, f"hardware.host_budget_gib={layer_input / GIB}")))
    assert not small.fits and not small.as_json()["host_fits"] and small.max_micro_batch == 0
    assert any("hardware.host_budget_gib" in advice for advice in small.advice), small.advice
    assert "does NOT fit in the host budget" in small.table("cpu")


@pytest.mark.parametrize("attention", ["flex_attention", "flash_attention_2"])
def test_packed_rows_without_a_dense_mask_plan_no_square_mask(attention):
    base = (*LONG_ROWS, "model.config.intermediate_size=256", "data=chat", "data.mode=pack_rows", "activation_checkpointing=full")
    dense = plan_memory(*with_task(plan_cfg(*base, "attention=sdpa")), search=False)
    mask_free = plan_memory(*with_task(plan_cfg(*base, f"attention={attention}")), search=False)
    square = 2 * 1024 * 1024  # (B, 1, T, T) booleans
    assert mask_free.total <= dense.total - square, (mask_free.total, dense.total)


def _tiny_llama(layers: int = 2) -> AutoModelForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def test_offloading_never_moves_a_parameter_after_the_model_moves():
    """``.to(device)`` or quantization give parameters new storages after the hooks are installed:
    the saved final-norm weight must still stay (the hooks re-read the storages each forward)."""
    model = _tiny_llama()
    enable_activation_checkpointing(model)
    offload = enable_activation_offloading(model, min_bytes=0)
    model.to(torch.float64)  # every parameter gets a new storage
    moved = []
    pack = offload.pack
    offload.pack = lambda tensor: (moved.append(tensor) if offload.offloads(tensor) else None) or pack(tensor)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    parameters = {id(p.untyped_storage()) for p in model.parameters()}
    assert len(moved) >= 2 and offload.restored == offload.tensors == len(moved)
    assert not [tuple(t.shape) for t in moved if id(t.untyped_storage()) in parameters]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_untiled_outputs_and_gradients(checkpointing):
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    results = []
    for tiles in (1, 4):
        model = _tiny_llama()
        if checkpointing:
            enable_activation_checkpointing(model)
        if tiles > 1:
            assert enable_tiled_mlp(model, tiles) == 2
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits, loss, grads), (tiled_logits, tiled_loss, tiled_grads) = results
    torch.testing.assert_close(tiled_logits, logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # inference is untouched: one call of the MLP
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, logits, rtol=1e-6, atol=1e-6)


def test_tiled_mlp_lowers_the_planned_peak():
    base = (*LONG_ROWS, "model.config.intermediate_size=8192", "activation_checkpointing=full")
    plain = plan_memory(*with_task(plan_cfg(*base)), search=False)
    tiled = plan_memory(*with_task(plan_cfg(*base, "activation_checkpointing.mlp_tiles=8")), search=False)
    intermediate = 2 * 1024 * 8192 * 4  # one (B, T, d_ff) fp32 MLP activation: 64 MiB
    assert tiled.total <= plain.total - 2 * intermediate, (tiled.total, plain.total)


@pytest.mark.slow
def test_packed_rows_under_flex_attention_equal_sdpa_with_the_dense_mask():
    """No-grad forward (FlexAttention has no CPU backward): three rows packed in one block, the
    block mask against SDPA's dense block-diagonal mask, and each row alone."""
    model = _tiny_llama().eval().float()
    lengths = (20, 31, 13)
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        dense = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(input_ids=row, use_cache=False).logits for row in ids.split(lengths, dim=1)], dim=1)
        model.set_attn_implementation("flex_attention")
        flex = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(dense, alone, rtol=1e-5, atol=1e-5)  # SDPA's mask keeps rows apart
    for row, (a, b) in enumerate(zip(flex.split(lengths, dim=1), dense.split(lengths, dim=1))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"row {row}")


def test_flex_attention_on_a_torch_without_it_names_the_fix(make_lm_cfg, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.endswith("flex_attention") else real(name, *a))
    with pytest.raises(ConfigError, match="needs torch.nn.attention.flex_attention"):
        check_config(make_lm_cfg("attention=flex_attention"))


def test_train_with_offloading_and_tiles_logs_the_losses_of_checkpointing_alone(make_lm_cfg, monkeypatch, tmp_path):
    """Through ``train`` (the task module applies the levers): the hooks see the layer inputs, and
    every logged loss equals the run with checkpointing alone (fp32)."""
    packed = []
    pack = ActivationOffload.pack
    monkeypatch.setattr(ActivationOffload, "pack", lambda self, tensor: packed.append(self.offloads(tensor)) or pack(self, tensor))
    common = ("trainer.max_steps=3", "trainer.val_check_interval=3", "callbacks.sample_generation=null", "test_after_fit=false")
    plain = train(
        make_lm_cfg(*common, "activation_checkpointing=full", "activation_checkpointing.mlp_tiles=2", f"paths.output_dir={tmp_path}/a")
    )
    assert not packed
    levers = train(make_lm_cfg(*common, *OFFLOAD, "activation_checkpointing.mlp_tiles=2", f"paths.output_dir={tmp_path}/b"))
    assert sum(packed) >= 3 * 2, packed  # at least each layer's input, each step
    for key in ("train/loss", "val/loss", "val/loss_start"):
        assert levers[key] == plain[key], (key, levers[key], plain[key])
