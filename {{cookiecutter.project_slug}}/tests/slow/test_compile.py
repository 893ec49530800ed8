"""torch.compile (``compile=default``) trains and round-trips checkpoints: one real inductor compile
of a tiny Llama's training graph (tens of seconds on a CPU)."""

from __future__ import annotations

import torch

from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule
from {{ cookiecutter.package_name }}.train import train


def test_compiled_checkpoints_load_without_compile_and_back(make_lm_cfg, tmp_path):
    """One compile (tens of seconds cold, so one training graph only: no validation): train with
    compile on, reload with it off (keys carry no ``_orig_mod.``, same weights), then load those
    weights into a compiled module (off -> on)."""
    cfg = make_lm_cfg(
        "compile=default",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=0",
        "task.validate_before_fit=false",
        "callbacks.sample_generation=null",
        "test_after_fit=false",
    )
    train(cfg)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in key for key in checkpoint["state_dict"])
    plain = CausalLMModule.load_from_checkpoint(path, compile={"mode": "off"}, weights_only=True)
    plain.configure_model()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the same keys
    compiled = CausalLMModule.load_from_checkpoint(path, compile={"mode": "default"}, weights_only=True)
    compiled.configure_model()
    assert compiled.model._compiled_call_impl is not None  # compiled in place, not wrapped
    compiled.load_state_dict(plain.state_dict())  # off -> on, strict
    for (name, value), (other_name, other) in zip(plain.state_dict().items(), compiled.state_dict().items()):
        assert name == other_name and torch.equal(value, other), name
