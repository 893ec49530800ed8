"""A GRPO run (LoRA, the KL term on) killed at a random point resumes with the same per-step rewards and losses as a run
that was never interrupted: each micro-batch samples under a seed of (seed, step, micro-batch, rank)."""

from __future__ import annotations

import random
import signal

import pytest

from ..processes import read_metrics, step_losses, without_output_dir
from ..test_chat_data import chat_tokenizer_dir  # noqa: F401  (a fixture)
from ..test_grpo import grpo_overrides
from ..test_preference import pair_files, pretrained_folder, tokenizer  # noqa: F401  (fixtures)
from .test_resume import assert_same_losses, kill_and_resume, uninterrupted_losses

EVERY = 3  # callbacks.step_checkpoint.every_n_train_steps


def step_rewards(run_dir) -> dict[int, float]:
    return {int(row["step"]): float(row["train/reward"]) for row in read_metrics(run_dir / "csv") if row.get("train/reward")}


@pytest.fixture(scope="module")
def grpo_base(pretrained_folder, pair_files, tmp_path_factory) -> list[str]:  # noqa: F811
    overrides = grpo_overrides(pretrained_folder, pair_files, tmp_path_factory.mktemp("grpo") / "run")
    overrides = [o for o in overrides if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    return without_output_dir(overrides) + [
        "trainer.max_epochs=2",  # 24 prompts, micro-batch 2, 2 accumulated: 6 steps an epoch
        "trainer.deterministic=true",
        f"callbacks.step_checkpoint.every_n_train_steps={EVERY}",
        "test_after_fit=false",
    ]


def test_grpo_killed_at_a_random_point_resumes_with_the_same_rewards_and_losses(grpo_base, tmp_path):
    reference = uninterrupted_losses(grpo_base, tmp_path / "reference")
    assert len(reference) == 12
    rewards = step_rewards(tmp_path / "reference")
    assert len(set(rewards.values())) > 6  # the steps sample differently
    rng = random.Random()
    step, micro_batch = rng.randrange(EVERY + 1, len(reference) - 1), rng.randrange(2)
    context = f"SIGKILL before micro-batch {micro_batch + 1} of step {step}"
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={step}", f"+callbacks.fault.micro_batch={micro_batch}"]
    run_dir, _ = kill_and_resume(grpo_base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(reference, step_losses(run_dir), context)
    assert step_rewards(run_dir) == rewards, context
