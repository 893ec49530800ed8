"""The planner's modes (plan.mode=longest|fastest|time) and the step-time roofline: the kernel
counter counts what a hand count gives, the roofline's arithmetic, the longest-context search
against a brute-force scan, the host bound's arithmetic against traces, the fastest lever sets
against their own plans, the run's steps, and each bad input refused with the field named."""

from __future__ import annotations

import math

import pytest
import torch
{%- if cookiecutter.tasks != "classification" %}
from omegaconf import open_dict
{%- endif %}

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.memory import modes, tracer
{%- if cookiecutter.tasks != "classification" %}
from {{ cookiecutter.package_name }}.core.memory.planner import GIB, architecture, plan_memory, step_cost
{%- endif %}
from {{ cookiecutter.package_name }}.core.memory.steptime import Peaks, StepCost, predict
{%- if cookiecutter.tasks != "classification" %}
from {{ cookiecutter.package_name }}.tasks import task_of

from .conftest import with_task
from .test_planner import TINY_LM, plan_cfg
{%- else %}

from .test_planner import plan_cfg
{%- endif %}

GPU_PEAKS = (  # round figures, so that the arithmetic below is checkable by hand
    "hardware=rtx4090_24gb",
    "hardware.peak_tflops=100",
    "hardware.peak_tflops_fp32=50",
    "hardware.memory_gbps=1000",
    "hardware.op_overhead_us=10",
    "hardware.step_overhead_ms=2",
)


def test_counter_counts_flops_and_bytes_of_each_kernel_and_skips_views():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with tracer.OpCounter() as counter:
        c = a @ b  # one mm: 2 x 8 x 16 x 4 FLOPs; reads 512 + 256 B, writes 128 B
        c.t().reshape(-1)  # views: no kernel (reshape of a non-contiguous view copies: one clone)
        counter.phase = "optimizer"
        torch.relu_(c)  # in place, pointwise: reads and writes 128 B
    mm, *copies = counter.ops["micro"]
    assert mm == (2 * 8 * 16 * 4, (8 * 16 + 16 * 4 + 8 * 4) * 4, False, False)
    assert all(flops == 0 for flops, *_ in copies)
    assert counter.ops["optimizer"] == [(0, 2 * 8 * 4 * 4, True, False)]
    with tracer.OpCounter() as counter:
        torch.randn(4, 4, dtype=torch.bfloat16) @ torch.randn(4, 4, dtype=torch.bfloat16)
    assert counter.ops["micro"][-1][3] is True  # 16-bit inputs: the card's bf16 peak


def test_roofline_arithmetic():
    peaks = Peaks(tflops=100, tflops_fp32=50, memory_gbps=1000, op_overhead_us=10, step_overhead_ms=2, overlaps=True)
    compute = (10**12, 10**6, False, True)  # 10 ms at 100 TFLOP/s; 0.001 ms of bytes
    memory = (0, 10**9, True, True)  # 1 ms at 1,000 GB/s
    tiny = (0, 1000, True, False)  # 0.000001 ms: the 0.01 ms launch binds
    fp32 = (10**12, 0, False, False)  # 20 ms at 50 TFLOP/s
    cost = StepCost(1, [compute, memory, tiny], [fp32])
    step = predict(cost, peaks, accumulate=4, tokens_per_micro_batch=1000)
    assert step.compute_ms == pytest.approx(4 * 10 + 20)
    assert step.memory_ms == pytest.approx(4 * 1)
    assert step.overhead_ms == pytest.approx(4 * 0.01 + 2)
    assert step.total_ms == pytest.approx(66.04)
    assert step.tokens_per_s == pytest.approx(4000 / 0.06604)
    assert step.flops == 4 * 10**12 + 10**12 and step.bound == "compute"
    # compile: pointwise kernels launch nothing of their own
    assert predict(cost, peaks, 4, 1000, compiled=True).overhead_ms == pytest.approx(2)
    # a CPU: each kernel is its bound plus the launch, in sequence
    cpu = Peaks(tflops=100, tflops_fp32=50, memory_gbps=1000, op_overhead_us=10, overlaps=False)
    assert predict(StepCost(1, [compute, memory, tiny], []), cpu, 1, 1).total_ms == pytest.approx(10 + 1 + 1e-6 + 3 * 0.01)
    # offloaded activations come back over PCIe, once per micro-step
    offloaded = StepCost(1, [compute], [], host_bytes=10**8)
    bus = Peaks(tflops=100, tflops_fp32=50, memory_gbps=1000, op_overhead_us=10, pcie_gbps=25)
    assert predict(offloaded, bus, 2, 1).memory_ms == pytest.approx(2 * 4)
    # another micro-batch scales the micro-step, not the optimizer step
    double = cost.scaled(2)
    assert double.micro[0][:2] == (2 * 10**12, 2 * 10**6) and double.optimizer == cost.optimizer


def test_peaks_are_required_and_named():
    with pytest.raises(ConfigError, match=r"hardware\.peak_tflops, hardware\.peak_tflops_fp32, hardware\.memory_gbps.*doctor --measure"):
        Peaks.of(plan_cfg("hardware=cpu").hardware)
    with pytest.raises(ConfigError, match=r"hardware\.peak_tflops"):  # before any trace
        modes.check_mode(plan_cfg("hardware=cpu", "plan.mode=time"))
    with pytest.raises(ConfigError, match=r"plan\.mode='quickest' is not one of fit, longest, largest, fastest, time"):
        modes.check_mode(plan_cfg("plan.mode=quickest"))
    assert modes.check_mode(plan_cfg("hardware=rtx4090_24gb", "plan.mode=fastest")) == "fastest"
    assert Peaks.of(plan_cfg("hardware=rtx4090_24gb").hardware).memory_gbps == 1008.0


def test_run_steps_from_max_steps_or_examples():
    cfg = plan_cfg("trainer.max_steps=120")
    assert modes.run_steps(cfg) == 120
    cfg = plan_cfg("trainer.max_epochs=3", "batch.global_batch_size=32", "batch.micro_batch_size=32", "plan.train_examples=1000")
    assert modes.run_steps(cfg) == 3 * math.ceil(1000 / 32)
    with pytest.raises(ConfigError, match=r"plan\.train_examples=<training rows per epoch>.*trainer\.max_steps"):
        modes.run_steps(plan_cfg("trainer.max_epochs=2"))
{%- if cookiecutter.tasks != "classification" %}


def test_counter_changes_nothing_the_memory_trace_sees():
    cfg = plan_cfg(*TINY_LM, "activation_checkpointing=full", "batch.micro_batch_size=4", "batch.global_batch_size=4")
    plain, counted = plan_memory(cfg, task_of(cfg), search=False), plan_memory(cfg, task_of(cfg), search=False, count=True)
    assert plain.cost is None and counted.cost is not None and len(counted.cost.micro) > 100
    assert (plain.total, plain.activations, plain.temporaries) == (counted.total, counted.activations, counted.temporaries)
    assert counted.cost.host_bytes == 0
    offloaded = plan_memory(
        *with_task(plan_cfg(*TINY_LM, "activation_checkpointing=offload", "activation_checkpointing.offload_min_bytes=0")),
        search=False,
        count=True,
    )
    assert offloaded.cost.host_bytes == offloaded.offloaded_bytes > 0
    cost, trainable = step_cost(cfg, task_of(cfg), architecture(cfg), 4)
    assert cost.flops == counted.cost.flops and len(cost.micro) == len(counted.cost.micro)
    assert len(cost.optimizer) > 0  # the optimizer's kernels (in-place foreach ops return nothing: still counted)
    assert sum(numel for numel, _ in trainable) == counted.counts["trainable"]
    # The FLOPs of the micro-step: at least 6 x the matmul weights x tokens (forward, two backward matmuls)
    model = architecture(cfg)
    weights = model.num_hidden_layers * (4 * model.hidden_size**2 // 2 + 3 * model.hidden_size * model.intermediate_size)
    assert cost.flops >= 6 * weights * 4 * cfg.data.max_length


def _budgeted(*overrides, budget_bytes: int | None = None):
    cfg = plan_cfg(*TINY_LM, "batch.micro_batch_size=8", "batch.global_batch_size=8", *overrides)
    if budget_bytes is not None:
        with open_dict(cfg):
            cfg.hardware.budget_gib = budget_bytes / GIB
    return cfg


def test_longest_context_equals_a_brute_force_scan():
    step, bound = 16, 96
    search = (f"plan.length_step={step}", f"plan.max_length={bound}")
    totals = {n: plan_memory(*with_task(_budgeted(f"data.max_length={n}")), search=False).total for n in range(step, bound + 1, step)}
    for budget in ((totals[32] + totals[48]) // 2, totals[96] + 1):
        cfg = _budgeted(*search, budget_bytes=budget)
        found = modes.longest_context(cfg, task_of(cfg), architecture(cfg))
        expected = max(n for n, total in totals.items() if total <= budget)
        assert found.length == expected, (budget, totals)
        assert found.plan.total == totals[expected] and found.plan.fits
        assert found.traces < len(totals) or expected == bound
        if expected < bound:
            assert "over the budget" in found.above
        else:
            assert "search bound" in found.above
    with pytest.raises(ConfigError, match=r"no data\.max_length fits; the shortest planned, 16 tokens"):
        cfg = _budgeted(*search, budget_bytes=totals[16] - 1)
        modes.longest_context(cfg, task_of(cfg), architecture(cfg))


def test_host_bound_arithmetic_matches_the_traces():
    offload = ("activation_checkpointing=offload", "activation_checkpointing.offload_min_bytes=0")
    first = plan_memory(*with_task(_budgeted(*offload, "data.max_length=32")), search=False)
    assert first.offloaded_sizes and sum(first.offloaded_sizes) == first.offloaded_bytes
    for length in (16, 48, 96):
        traced = plan_memory(*with_task(_budgeted(*offload, f"data.max_length={length}")), search=False)
        for budget in (traced.host_pinned - 1, traced.host_pinned):
            assert modes._fits_host(first.offloaded_sizes, length, 32, budget) == (traced.host_pinned <= budget), length


def test_longest_context_refuses_a_bound_above_the_positions():
    cfg = _budgeted("plan.max_length=4096", "model.config.max_position_embeddings=1024")
    with pytest.raises(ConfigError, match=r"plan\.max_length=4096 is above the model's 1024 positions.*plan\.max_length<=1024"):
        modes.longest_context(cfg, task_of(cfg), architecture(cfg))
    with pytest.raises(ConfigError, match=r"plan\.length_step=0"):
        cfg = _budgeted("plan.length_step=0")
        modes.longest_context(cfg, task_of(cfg), architecture(cfg))


def test_fastest_lever_sets_are_ranked_and_their_overrides_give_their_plans():
    cfg = plan_cfg(*TINY_LM, *GPU_PEAKS, "data.max_length=64", "batch.micro_batch_size=1", "batch.global_batch_size=2", "plan.top=2")
    ranked, traced, closest = modes.fastest_levers(cfg, task_of(cfg), architecture(cfg))
    assert len(ranked) == 2 and not closest and traced >= 4 and ranked[0].overrides != ranked[1].overrides
    times = [c.time.total_ms for c in ranked]
    assert times == sorted(times)
    for candidate in ranked:  # the printed overrides, applied to the config, plan the printed memory
        assert candidate.confirmed and candidate.micro_batch * candidate.accumulate == 2
        trial = plan_cfg(*TINY_LM, *GPU_PEAKS, "data.max_length=64", "batch.global_batch_size=2", *candidate.overrides)
        plan = plan_memory(trial, task_of(trial), search=False)
        if "optimizer=adamw_8bit" not in candidate.overrides:
            assert plan.total == candidate.total, candidate.overrides
    # Nothing fits: the closest lever set, named
    with open_dict(cfg):
        cfg.hardware.budget_gib = 0.001
    ranked, _, closest = modes.fastest_levers(cfg, task_of(cfg), architecture(cfg))
    assert ranked == [] and closest.startswith("no lever set fits 0.001 GiB; the closest is")


def test_time_to_end_is_steps_times_the_predicted_step():
    cfg = plan_cfg(*TINY_LM, *GPU_PEAKS, "trainer.max_steps=300", "batch.micro_batch_size=2", "batch.global_batch_size=8")
    end = modes.time_to_end(cfg, task_of(cfg), architecture(cfg))
    assert end.steps == 300 and end.plan.accumulate == 4
    assert end.hours == pytest.approx(300 * end.time.total_ms / 3.6e6)
    again = predict(end.plan.cost, Peaks.of(cfg.hardware), 4, 2 * cfg.data.max_length)
    assert again.total_ms == pytest.approx(end.time.total_ms)
    assert "Time to the end of the run: 300 steps" in end.text("rtx4090_24gb")


def test_train_logs_the_measured_step_time_beside_the_prediction(make_lm_cfg, tmp_path, caplog):
    from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics
    from {{ cookiecutter.package_name }}.train import train

    peaks = (
        "hardware=cpu",
        "hardware.peak_tflops=0.1",
        "hardware.peak_tflops_fp32=0.1",
        "hardware.memory_gbps=10",
        "hardware.op_overhead_us=5",
    )
    cfg = make_lm_cfg(
        *peaks, "trainer.max_steps=8", "trainer.log_every_n_steps=1", "callbacks.sample_generation=null", "test_after_fit=false"
    )
    predicted = modes.predicted_step_ms(cfg, task_of(cfg), None)
    with caplog.at_level("INFO"):
        train(cfg)
    rows = [row for row in read_metrics(tmp_path / "run" / "csv") if row.get("time/step_ms")]
    assert len(rows) == 1 and float(rows[0]["time/predicted_step_ms"]) == pytest.approx(predicted, rel=1e-4)
    measured = float(rows[0]["time/step_ms"])
    assert 0 < measured < 60_000
    assert f"measured {measured:.1f} ms, predicted {predicted:.1f} ms" in caplog.text
    # No prediction without the peaks (hardware=cpu as shipped), nor from a GPU's figures for a CPU run
    assert modes.predicted_step_ms(*with_task(make_lm_cfg("hardware=cpu")), None) is None
    assert modes.predicted_step_ms(*with_task(make_lm_cfg("hardware=rtx4090_24gb")), None) is None
{%- endif %}
