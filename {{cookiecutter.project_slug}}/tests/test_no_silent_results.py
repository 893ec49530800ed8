"""No silent wrong results: a setting that would give a result other than the one asked for is
refused (field, value, fix) before anything loads, or honoured exactly; each right value is a test.

The task-specific kinds (chat masks, saved weights, tied outputs) sit beside their task's tests.
"""

from __future__ import annotations

import pytest
import torch

from {{ cookiecutter.package_name }}.train import train
from {{ cookiecutter.package_name }}.utils.config import ConfigError, validate_config


@pytest.fixture
def tiny_cfg(request):
    """``tiny_cfg(*overrides)``: a tiny offline train config of this project's task."""
{%- if cookiecutter.tasks != "causal_lm" %}
    return request.getfixturevalue("make_cfg")
{%- else %}
    return request.getfixturevalue("make_lm_cfg")
{%- endif %}


# ------------------------------------------------------------------------ stopping rules
def test_max_steps_binds_past_the_default_epochs(tiny_cfg, tmp_path):
    """2 batches an epoch, the default 3 epochs: 6 steps; ``trainer.max_steps=8`` runs 8 (Lightning
    alone stops at whichever limit comes first, and exited 0 after 6)."""
    cfg = tiny_cfg("trainer.limit_train_batches=2", "trainer.max_steps=8", "test_after_fit=false", "callbacks.progress_bar=null")
    validate_config(cfg)
    assert cfg.trainer.max_epochs == -1
    train(cfg)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 8


def test_without_max_steps_the_default_epochs_end_the_run(tiny_cfg):
    cfg = tiny_cfg()
    assert (cfg.trainer.max_steps, cfg.trainer.max_epochs) == (-1, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_steps=30", "trainer.max_epochs=2"],
        ["trainer.max_epochs=5", "trainer.max_steps=7"],
        ["debug=limit", "trainer.max_steps=30"],  # the debug group sets max_epochs: 2
    ],
)
def test_max_steps_and_max_epochs_both_set_are_refused_naming_both(tiny_cfg, overrides):
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_cfg(*overrides))
    (line,) = [line for line in str(error.value).splitlines() if "max_steps" in line]
    assert "trainer.max_epochs=" in line and "fix:" in line
