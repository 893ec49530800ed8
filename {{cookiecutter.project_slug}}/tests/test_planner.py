"""The memory planner: exact arithmetic where it is arithmetic, bitsandbytes' real byte counts,
the auto-fit search, the pre-flight refusal, the entry point's files, and every 24 GB
experiment's header figure."""

from __future__ import annotations

{% if cookiecutter.tasks != "classification" %}import json
{% endif %}import re
from importlib import resources

import pytest
import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.core.errors import ConfigError
{% if cookiecutter.tasks != "classification" %}from {{ cookiecutter.package_name }}.core.memory import planner
from {{ cookiecutter.package_name }}.core.memory.planner import GIB, architecture, nf4_bytes, optimizer_state_bytes, plan_memory
{% else %}from {{ cookiecutter.package_name }}.core.memory.planner import architecture
{% endif %}from {{ cookiecutter.package_name }}.core.memory.tracer import CudaAutocastEmulation
{% if cookiecutter.tasks != "classification" %}from {{ cookiecutter.package_name }}.core.models.precision import compute_dtype, weights_dtype
from {{ cookiecutter.package_name }}.tasks import task_of

from .conftest import compose_config, with_task
{% else %}
from .conftest import compose_config
{% endif %}
EXPERIMENTS = resources.files("{{ cookiecutter.package_name }}") / "configs" / "experiment"
HEADER = re.compile(r"planner: ([0-9.]+) GiB")


def plan_cfg(*overrides: str):
    return compose_config("plan", ["hardware=cpu", *overrides])
{%- if cookiecutter.tasks != "classification" %}


# A small Llama from scratch: vocabulary from the SmolLM2 architecture numbers (no files needed).
TINY_LM = (
    "experiment=demo_lm_scratch",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "data.max_length=16",
    "precision=32-true",
)


def _real_model(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(architecture(cfg))


def _stepped_model(cfg) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The planned model after one real backward and one real fused AdamW step."""
    model = _real_model(cfg)
    ids = torch.randint(0, 100, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    optimizer.step()
    return model, optimizer


def test_parameter_gradient_and_optimizer_bytes_are_exact():
    """The arithmetic parts against a real model, its real gradients and a real AdamW's state."""
    cfg = plan_cfg(*TINY_LM, "batch.micro_batch_size=1", "batch.global_batch_size=1")
    model, optimizer = _stepped_model(cfg)
    real_params = sum(p.numel() * p.element_size() for p in model.parameters())
    real_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    real_state = sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values())
    plan = plan_memory(cfg, task_of(cfg), search=False)
    assert plan.counts["param_bytes"] == real_params and plan.counts["grad_bytes"] == real_grads
    assert plan.counts["optimizer_bytes"] == real_state
    # The trace sees the same: all parameters and the whole (steady-state) optimizer state are
    # alive at the peak, whatever the peak's moment.
    assert plan.params == real_params and plan.optimizer == real_state
    assert plan.total == plan.peak_allocated + plan.overhead
    assert plan.peak_allocated >= real_params + real_state + real_grads  # the optimizer step holds all three


def test_checkpoint_staging_is_the_pinned_blocks_of_a_real_checkpoint():
    """plan.json's host_staging against what the background writer stages for a real model's
    checkpoint after a real AdamW step (each tensor in a power-of-two pinned block)."""
    from {{ cookiecutter.package_name }}.core.checkpoints.writer import Stager, tensor_bytes, unique_tensors
    from {{ cookiecutter.package_name }}.core.models.levers import pinned_block

    cfg = plan_cfg(*TINY_LM, "batch.micro_batch_size=1", "batch.global_batch_size=1")
    model, optimizer = _stepped_model(cfg)
    staged = Stager(pin_memory=False).stage({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]})
    real = sum(pinned_block(tensor_bytes(t)) for t in unique_tensors(staged).values())
    plan = plan_memory(cfg, task_of(cfg), search=False)
    assert plan.host_staging == real
    assert "staging each checkpoint" in plan.table("cpu") and plan.as_json()["host_staging_gib"] >= 0
    assert plan_memory(*with_task(plan_cfg(*TINY_LM, "trainer.plugins.0.background=false")), search=False).host_staging == 0


@pytest.mark.parametrize(
    "precision, peft, weights, compute",
    [
        ("32-true", "none", torch.float32, torch.float32),
        ("bf16-mixed", "none", torch.float32, torch.bfloat16),
        ("16-mixed", "none", torch.float32, torch.float16),
        ("bf16-mixed", "lora", torch.bfloat16, torch.bfloat16),
        ("bf16-mixed", "qlora", torch.bfloat16, torch.bfloat16),
        ("32-true", "lora", torch.float32, torch.float32),
        ("bf16-true", "none", torch.bfloat16, torch.bfloat16),
    ],
)
def test_one_precision_policy_gives_the_weight_and_matmul_dtypes(precision, peft, weights, compute):
    assert weights_dtype(precision, peft) == weights and compute_dtype(precision) == compute


def test_plan_builds_the_model_with_the_modules_own_builder(monkeypatch):
    from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule

    built = []
    original = CausalLMModule.build_model

    def recording(self, precision, config=None):
        model = original(self, precision, config=config)
        built.append((precision, self.inputs.max_length, config is not None, {p.dtype for p in model.parameters()}))
        return model

    monkeypatch.setattr(CausalLMModule, "build_model", recording)
    plan_memory(
        *with_task(plan_cfg(*TINY_LM, "precision=bf16-true", "batch.micro_batch_size=1", "batch.global_batch_size=1")), search=False
    )
    assert built == [("bf16-true", 16, True, {torch.bfloat16})]  # the planner's config: random (fake) weights


def test_step_in_backward_plans_no_full_gradient_set():
    cfg = plan_cfg(
        *TINY_LM,
        "batch.micro_batch_size=1",
        "batch.global_batch_size=1",
        "optimizer.step_in_backward=true",
        "trainer.gradient_clip_val=null",
    )
    n = sum(p.numel() for p in _real_model(cfg).parameters())
    plan = plan_memory(cfg, task_of(cfg), search=False)
    assert plan.grads < 4 * n / 2, plan  # gradients are stepped and freed one tensor at a time


def test_8bit_state_is_what_bitsandbytes_allocates():
    bnb = pytest.importorskip("bitsandbytes")
    cfg = plan_cfg(*TINY_LM)
    model = _real_model(cfg)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    trainable = [(p.numel(), p.element_size()) for p in model.parameters()]
    assert optimizer_state_bytes(trainable, "adamw_8bit") == sum(storages.values())


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_bytes_are_what_bitsandbytes_stores(double_quant):
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(300, 640, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    if double_quant:
        stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert nf4_bytes(weight.numel(), double_quant) == stored


def test_autofit_picks_the_largest_divisor_that_fits_and_keeps_the_global_batch():
    base = (*TINY_LM, "data.max_length=64", "batch.global_batch_size=12")
    sizes = {mb: plan_memory(*with_task(plan_cfg(*base, f"batch.micro_batch_size={mb}")), search=False).total for mb in (3, 4)}
    budget_gib = (sizes[3] + sizes[4]) / 2 / GIB  # 3 fits, 4 does not
    plan = plan_memory(*with_task(plan_cfg(*base, "batch.micro_batch_size=12", f"hardware.budget_gib={budget_gib}")))
    assert not plan.fits
    assert plan.max_micro_batch == 3 and plan.max_micro_batch_accumulate == 4
    assert plan.advice == []  # a smaller micro-batch is the fix


def test_several_processes_are_planned_per_process():
    """trainer=ddp trainer.devices=2: each GPU holds one process, with micro-batches of
    batch.device_batch_size and half the global batch; the plan, its search and the OOM advice
    are that process's."""
    from {{ cookiecutter.package_name }}.core.memory.oom import suggest_batch

    base = (*TINY_LM, "batch.global_batch_size=16", "batch.micro_batch_size=16")
    one = plan_memory(*with_task(plan_cfg(*base)), search=False)
    cfg = plan_cfg(*base, "trainer=ddp", "trainer.devices=2")
    two = plan_memory(cfg, task_of(cfg))
    assert (two.micro_batch, two.accumulate, two.processes) == (8, 1, 2)
    assert two.total < one.total  # half the activations of the one-process plan
    assert (two.max_micro_batch, two.max_micro_batch_accumulate) == (8, 1)  # the whole share fits
    assert "Memory plan per process (2 processes, one GPU each): micro-batch 8" in two.table("rtx4090_24gb")
    assert suggest_batch(cfg, task_of(cfg))[0] == 4  # below the 8 that ran out of memory, a divisor of the share


def test_advice_lists_only_levers_that_lower_the_plan():
    base = (*TINY_LM, "data.max_length=256", "batch.micro_batch_size=1", "batch.global_batch_size=1")
    plain = plan_memory(*with_task(plan_cfg(*base)), search=False).total
    checkpointed = plan_memory(*with_task(plan_cfg(*base, "activation_checkpointing=full")), search=False).total
    assert checkpointed < plain
    plan = plan_memory(*with_task(plan_cfg(*base, f"hardware.budget_gib={(plain + checkpointed) / 2 / GIB}")))
    assert plan.max_micro_batch == 0
    levers = [advice for advice in plan.advice if "GiB)" in advice]
    assert any(advice.startswith("activation_checkpointing=full (-") for advice in levers), plan.advice
    # step_in_backward saves nothing when the peak comes before any gradient exists: not advised
    # unless its own plan is lower.
    in_backward = plan_memory(
        *with_task(plan_cfg(*base, "optimizer.step_in_backward=true", "trainer.gradient_clip_val=null")), search=False
    ).total
    assert any("step_in_backward" in advice for advice in levers) == (in_backward < plain)


def test_advice_leaves_out_levers_the_config_refuses():
    # Weights dominate (hidden 512, 16 tokens): stepping in backward saves the gradients, but qat
    # cannot step in backward, so with qat it is not advised.
    base = (*TINY_LM, "model.config.hidden_size=512", "model.config.intermediate_size=1024", "hardware.budget_gib=0.001")
    plain = plan_memory(*with_task(plan_cfg(*base, "batch.micro_batch_size=1", "batch.global_batch_size=1")))
    assert any("step_in_backward" in advice for advice in plain.advice), plain.advice
    quantization_aware = plan_memory(
        *with_task(plan_cfg(*base, "batch.micro_batch_size=1", "batch.global_batch_size=1", "qat=int8a_int4w"))
    )
    assert quantization_aware.advice and not any("step_in_backward" in advice for advice in quantization_aware.advice)


def test_train_refuses_a_gpu_run_that_will_not_fit(tmp_path, monkeypatch):
    cfg = plan_cfg(*TINY_LM, "hardware.budget_gib=0.01")
    monkeypatch.setattr(planner, "uses_cuda", lambda cfg: True)
    with pytest.raises(ConfigError, match="will not fit"):
        planner.check_memory_plan(cfg, task_of(cfg), tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["fits"] is False
    cfg.plan_before_fit = False
    planner.check_memory_plan(cfg, task_of(cfg), tmp_path / "skipped")
    assert not (tmp_path / "skipped").exists()


def test_pruning_counts_its_masks_and_recomputed_weights_and_a_run_that_no_longer_fits_is_refused(tmp_path, monkeypatch):
    from torch.nn.utils import prune

    base = (*TINY_LM, "batch.micro_batch_size=1", "batch.global_batch_size=1")
    plain = plan_memory(*with_task(plan_cfg(*base)), search=False)
    pruned = plan_memory(*with_task(plan_cfg(*base, "pruning=magnitude")), search=False)
    # What torch's pruning really adds on a real model: the mask buffers and the recomputed weights.
    model = _real_model(plan_cfg(*base))
    linears = [(m, "weight") for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    prune.global_unstructured(linears, pruning_method=prune.L1Unstructured, amount=10)
    masks = sum(m.weight_mask.numel() * m.weight_mask.element_size() for m, _ in linears)
    recomputed = sum(m.weight.numel() * m.weight.element_size() for m, _ in linears)
    numel = sum(m.weight.numel() for m, _ in linears)
    assert pruned.counts["pruning_bytes"] == masks + recomputed + numel  # + the 1-byte mask custom_from_mask keeps
    assert pruned.buffers - plain.buffers == masks + numel and pruned.total > plain.total + masks + recomputed - 1
    assert any(note.startswith("pruning=magnitude: +") for note in pruned.corrections)
    monkeypatch.setattr(planner, "uses_cuda", lambda cfg: True)
    budget = f"hardware.budget_gib={(plain.total + pruned.total) / 2 / GIB}"
    planner.check_memory_plan(*with_task(plan_cfg(*base, budget)), tmp_path / "plain")  # fits without pruning ...
    with pytest.raises(ConfigError, match="will not fit"):  # ... not with it
        planner.check_memory_plan(*with_task(plan_cfg(*base, budget, "pruning=magnitude")), tmp_path / "pruned")
    assert any(advice.startswith("pruning=none (-") for advice in json.loads((tmp_path / "pruned" / "plan.json").read_text())["advice"])


def test_an_encoder_is_refused_for_the_causal_lm_task():
    with pytest.raises(ConfigError, match="needs a decoder"):
        plan_memory(*with_task(plan_cfg(*TINY_LM, "model.config.model_type=bert")), search=False)


def test_chunked_loss_plans_less_memory_for_a_large_vocabulary():
    common = (*TINY_LM, "data.max_length=256", "batch.micro_batch_size=4", "batch.global_batch_size=4")
    plain = plan_memory(*with_task(plan_cfg(*common)), search=False)
    chunked = plan_memory(*with_task(plan_cfg(*common, "loss=chunked", "loss.chunk_size=64")), search=False)
    logits_bytes = 4 * 256 * 49152 * 4  # fp32 (B, T, V)
    assert plain.peak_allocated - chunked.peak_allocated > logits_bytes, (plain.peak_allocated, chunked.peak_allocated)
{%- endif %}


def test_cuda_autocast_emulation_runs_layer_norm_in_fp32():
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = torch.nn.functional.linear(x, torch.randn(8, 8))
        assert F.layer_norm(hidden, (8,)).dtype == torch.bfloat16  # CPU autocast's own rule
        with CudaAutocastEmulation():
            assert F.layer_norm(hidden, (8,)).dtype == torch.float32  # CUDA's
            assert F.linear(hidden, torch.randn(8, 8)).dtype == torch.bfloat16


def test_architecture_without_numbers_or_files_names_the_fix():
    cfg = plan_cfg("model.name_or_path=org/unknown-model", "model.config=null", "model.fetch=null", "~model.architecture")
    with pytest.raises(ConfigError, match="model.architecture"):
        architecture(cfg)


def test_another_name_is_not_planned_with_the_model_files_numbers():
    """model.name_or_path=<another model> must not silently plan the shape the file describes."""
    cfg = plan_cfg("model.name_or_path=org/some-70b", "model.fetch=null")
    with pytest.raises(ConfigError, match="describes"):
        architecture(cfg)


def experiment_headers() -> list[tuple[str, float]]:
    """(experiment, GiB) of every experiment whose header states the planner's figure."""
    found = []
    for path in sorted(EXPERIMENTS.iterdir()):
        match = HEADER.search(path.read_text())
        if match:
            found.append((path.name.removesuffix(".yaml"), float(match.group(1))))
    return found


def test_every_24gb_experiment_states_its_plan():
    names = {name for name, _ in experiment_headers()}
    stated = {path.name.removesuffix(".yaml") for path in EXPERIMENTS.iterdir() if "24 GB" in path.read_text()}
    assert stated <= names, f"24 GB experiments without a planner figure: {sorted(stated - names)}"
