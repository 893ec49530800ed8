"""Every 24 GB experiment's header figure is what ``plan`` computes for it (one fake-tensor trace
of the full-size model each: up to ~15 s for Llama-3.1-8B on 2 CPU cores)."""

from __future__ import annotations

import pytest

from {{ cookiecutter.package_name }}.core.memory.planner import GIB, plan_memory
from {{ cookiecutter.package_name }}.tasks import task_of

from ..conftest import compose_config
from ..test_planner import experiment_headers


@pytest.mark.parametrize(("experiment", "gib"), experiment_headers())
def test_experiment_header_matches_the_plan(experiment, gib):
    cfg = compose_config("plan", [f"experiment={experiment}"])
    plan = plan_memory(cfg, task_of(cfg), search=False)
    # The figure `plan` prints (two decimals): docs/memory.md ("The shipped recipes") promises the header says exactly that.
    assert f"{plan.total / GIB:.2f}" == f"{gib:.2f}", f"{experiment}: header {gib} GiB, plan {plan.total / GIB:.2f} GiB"
    assert plan.fits
