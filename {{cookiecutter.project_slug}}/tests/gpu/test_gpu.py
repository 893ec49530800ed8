"""The gpu tier: what only a CUDA GPU can show.  Skipped (through ``conftest.requires_cuda``) on a
machine without one; CI has none, so run it by hand on a GPU box: ``pytest -m gpu``."""

from __future__ import annotations
{%- if cookiecutter.tasks != "classification" %}

import math

import torch

from {{ cookiecutter.package_name }}.core.memory.planner import GIB, plan_memory
from {{ cookiecutter.package_name }}.tasks import task_of
from {{ cookiecutter.package_name }}.train import train


def test_a_bf16_mixed_fit_on_the_gpu_stays_under_its_memory_plan(make_lm_cfg):
    """A few bf16-mixed steps of the tiny Llama on CUDA: finite losses, and the measured peak of
    allocated memory below what the planner (run by train before the fit) predicted."""
    cfg = make_lm_cfg("trainer=gpu", "precision=bf16-mixed", "trainer.max_steps=3", "test_after_fit=false")
    planned = plan_memory(cfg, task_of(cfg), search=False).total
    torch.cuda.reset_peak_memory_stats()
    metrics = train(cfg)
    measured = torch.cuda.max_memory_allocated()
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    assert 0 < measured <= planned, f"measured {measured / GIB:.3f} GiB, planned {planned / GIB:.3f} GiB"
{%- else %}

import math

from {{ cookiecutter.package_name }}.train import train


def test_a_bf16_mixed_fit_on_the_gpu_trains(make_cfg):
    """A few bf16-mixed steps of the tiny BERT classifier on CUDA give finite losses and metrics."""
    metrics = train(make_cfg("trainer=gpu", "precision=bf16-mixed", "trainer.max_steps=3"))
    assert math.isfinite(metrics["train/loss"]) and 0 <= metrics["test/acc"] <= 1
{%- endif %}
