"""A preference run (DPO, full fine-tune: the reference tables come from the checkpoint on a
resume) killed at a random point resumes bit-identically: the same per-step losses as a run that
was never interrupted."""

from __future__ import annotations

import random
import signal

import pytest

from ..processes import step_losses, without_output_dir
from ..test_chat_data import chat_tokenizer_dir  # noqa: F401  (a fixture)
from ..test_preference import pair_files, preference_overrides, pretrained_folder, tokenizer  # noqa: F401  (fixtures)
from .test_resume import assert_same_losses, kill_and_resume, uninterrupted_losses

EVERY = 3  # callbacks.step_checkpoint.every_n_train_steps


@pytest.fixture(scope="module")
def dpo_base(pretrained_folder, pair_files, tmp_path_factory) -> list[str]:  # noqa: F811
    overrides = preference_overrides(pretrained_folder, pair_files, tmp_path_factory.mktemp("dpo") / "run")
    overrides = [o for o in overrides if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    return without_output_dir(overrides) + [
        "peft=none",
        "objective=dpo",
        "trainer.max_epochs=2",  # 24 pairs, micro-batch 2, 2 accumulated: 6 steps an epoch
        "trainer.deterministic=true",
        f"callbacks.step_checkpoint.every_n_train_steps={EVERY}",
        "test_after_fit=false",
    ]


def test_dpo_killed_at_a_random_point_resumes_bit_identically(dpo_base, tmp_path):
    reference = uninterrupted_losses(dpo_base, tmp_path / "reference")
    assert len(reference) == 12
    rng = random.Random()
    step, micro_batch = rng.randrange(EVERY + 1, len(reference) - 1), rng.randrange(2)
    context = f"SIGKILL before micro-batch {micro_batch + 1} of step {step}"
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={step}", f"+callbacks.fault.micro_batch={micro_batch}"]
    run_dir, _ = kill_and_resume(dpo_base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(reference, step_losses(run_dir), context)
