"""Kill real training processes and resume them: the resumed run must log the same per-step
losses as a run that was never interrupted (bit-identical on CPU), and ``last.ckpt`` must never
be torn.  Faults come from ``tests/faults.py``, loaded by ``_target_`` overrides.

Each run is ``python -m {{ cookiecutter.package_name }}.train ... hydra.run.dir=RUN logger=csv``, the way a user runs it.
"""

from __future__ import annotations

{% if cookiecutter.tasks != "causal_lm" %}import csv
{% endif %}import json
import random
import signal
import subprocess
from pathlib import Path

import pytest

{% if cookiecutter.tasks != "causal_lm" %}from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import launch_files, read_metrics

{% endif %}from ..processes import WITHOUT_FAULT, checkpoint_step, run_train, step_losses, without_output_dir

EVERY = 3  # callbacks.step_checkpoint.every_n_train_steps in these runs


def uninterrupted_losses(base: list[str], run_dir: Path) -> dict[int, float]:
    """Per-step losses of the run that is never interrupted, logged from step 0 without a gap."""
    result = run_train(run_dir, base)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(len(losses)))
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == len(losses)  # last.ckpt is the final state
    assert not list((run_dir / "checkpoints").glob("last-v*.ckpt"))
    return losses


def assert_same_losses(reference: dict[int, float], resumed: dict[int, float], context: str) -> None:
    assert sorted(resumed) == sorted(reference), f"{context}: steps {sorted(resumed)} != {sorted(reference)}"
    differing = {step: (reference[step], resumed[step]) for step in reference if resumed[step] != reference[step]}
    assert not differing, f"{context}: steps whose loss differs from the uninterrupted run: {differing}"


def kill_and_resume(base: list[str], tmp_path: Path, fault: list[str], expect_code: int) -> tuple[Path, subprocess.CompletedProcess]:
    """Run with ``fault`` (which must kill or stop the run), then resume with ``ckpt_path=last``."""
    run_dir = tmp_path / "killed"
    killed = run_train(run_dir, base + fault)
    assert killed.returncode == expect_code, f"expected exit {expect_code}, got {killed.returncode}:\n{killed.stderr[-3000:]}"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file(), "no last.ckpt to resume from"
    checkpoint_step(run_dir / "checkpoints" / "last.ckpt")  # loads with weights_only=True
    killed_owner = json.loads((run_dir / "run.lock").read_text())["pid"]  # its lock went with it (a kernel lock)
    resumed = run_train(run_dir, base + ["ckpt_path=last", WITHOUT_FAULT])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "run.lock").read_text())["pid"] != killed_owner  # the resume held it
    return run_dir, resumed
{%- if cookiecutter.tasks != "causal_lm" %}


# ------------------------------------------------------------------------- classification
# 96 training rows, micro-batch 8, accumulation 2: 6 optimizer steps per epoch, 3 epochs.
CLS_STEPS = 18


@pytest.fixture(scope="module")
def cls_base(tokenizer_dir, toy_data, tmp_path_factory) -> list[str]:
    from ..conftest import tiny_overrides

    return without_output_dir(tiny_overrides(tokenizer_dir, toy_data, tmp_path_factory.mktemp("cls") / "run")) + [
        "batch.global_batch_size=16",
        "batch.micro_batch_size=8",
        "trainer.max_epochs=3",
        "trainer.deterministic=true",
        f"callbacks.step_checkpoint.every_n_train_steps={EVERY}",
        "optimizer.lr=1e-3",
        "test_after_fit=false",
        # (BERT's dropout is on, 0.1: the RNG state must be restored too)
    ]


@pytest.fixture(scope="module")
def cls_reference(cls_base, tmp_path_factory) -> dict[int, float]:
    losses = uninterrupted_losses(cls_base, tmp_path_factory.mktemp("cls_reference"))
    assert len(losses) == CLS_STEPS
    return losses


def test_classifier_killed_between_micro_batches_resumes_bit_identically(cls_base, cls_reference, tmp_path):
    rng = random.Random()
    step = rng.randrange(EVERY + 1, CLS_STEPS - 1)  # after the first step checkpoint, mid-epoch or not
    context = f"SIGKILL before micro-batch 2 of step {step}"
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={step}", "+callbacks.fault.micro_batch=1"]
    run_dir, _ = kill_and_resume(cls_base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(cls_reference, step_losses(run_dir), context)


def test_classifier_killed_right_after_a_validation_checkpoint_in_an_accumulating_run_resumes_bit_identically(cls_base, tmp_path):
    # Validation every 4 micro-batches (optimizer step 2 of accumulation 2) saves best + last.ckpt;
    # the kill comes right after last.ckpt is in place, before the step is logged or training goes on.
    base = cls_base + ["trainer.val_check_interval=4"]
    reference = uninterrupted_losses(base, tmp_path / "reference")
    fault = ["trainer.plugins=[{_target_: faults.KillAfterSave, save: 2}]"]
    run_dir, _ = kill_and_resume(base, tmp_path, fault, expect_code=-signal.SIGKILL)
    with launch_files(run_dir / "csv")[0].open(newline="") as file:  # the killed launch logged steps 1-2 (rows 0-1)
        assert max(int(row["step"]) for row in csv.DictReader(file) if row["train/loss"]) == 1
    assert_same_losses(reference, step_losses(run_dir), "SIGKILL right after the validation checkpoint at step 2")

    def best_so_far(run: Path) -> list[tuple[int, float]]:
        return [(int(row["step"]), float(row["val/acc_best"])) for row in read_metrics(run / "csv") if row.get("val/acc_best")]

    assert len(best_so_far(run_dir)) >= 5 and best_so_far(run_dir) == best_so_far(tmp_path / "reference")  # it survived the kill


def test_classifier_pruned_during_training_killed_mid_ramp_resumes_bit_identically(cls_base, tmp_path):
    # Global magnitude pruning from step 2 to 12: the masks (callback state) and plain weights in
    # last.ckpt must give the resumed run the same masks, losses and sparsity as the uninterrupted one.
    base = cls_base + ["pruning=magnitude", "pruning.begin_step=2", "pruning.end_step=12", "pruning.frequency=2"]
    reference_dir = tmp_path / "reference"
    reference = uninterrupted_losses(base, reference_dir)
    step = random.Random().randrange(EVERY + 1, 12)  # after the first step checkpoint, on the ramp
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={step}", "+callbacks.fault.micro_batch=1"]
    run_dir, _ = kill_and_resume(base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(reference, step_losses(run_dir), f"pruning on, SIGKILL before micro-batch 2 of step {step}")

    def sparsity(run: Path) -> dict[int, float]:
        return {int(row["step"]): float(row["train/sparsity"]) for row in read_metrics(run / "csv") if row.get("train/sparsity")}

    assert sparsity(run_dir) == sparsity(reference_dir) and sparsity(run_dir)[CLS_STEPS - 1] == 0.5


def callback_states(run: Path) -> tuple[int, dict, dict]:
    """The final ``last.ckpt``'s global step, weights, and the states of the stateful callbacks but the checkpoint writers'
    (early stopping's count and best, EMA's raw weights, pruning's masks and schedule), and the best score tracked."""
    import torch

    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    states = {key: value for key, value in checkpoint["callbacks"].items() if not key.startswith("ModelCheckpoint")}
    states["best_model_score"] = [v.get("best_model_score") for k, v in checkpoint["callbacks"].items() if "monitor" in v]
    return checkpoint["global_step"], checkpoint["state_dict"], states


def assert_same_state(reference: tuple, resumed: tuple, context: str) -> None:
    import torch

    assert resumed[0] == reference[0], f"{context}: stopped at step {resumed[0]}, the uninterrupted run at {reference[0]}"
    for name, value in reference[1].items():
        assert torch.equal(resumed[1][name], value), f"{context}: weight {name} differs"

    def same(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    differing = [key for key in reference[2] if not same(reference[2][key], resumed[2].get(key))]
    assert not differing, f"{context}: callback states differ: {differing}"


@pytest.mark.parametrize(
    "stateful",
    [
        ["callbacks=[ema,early_stopping]", "callbacks.ema.decay=0.9"],
        ["callbacks=early_stopping", "pruning=magnitude", "pruning.begin_step=2", "pruning.end_step=8", "pruning.frequency=2"],
    ],
    ids=["ema", "pruning"],
)
def test_a_kill_after_a_validation_resumes_to_the_uninterrupted_runs_stop_step_weights_and_callback_states(cls_base, tmp_path, stateful):
    """The property over the stateful callbacks (early stopping, EMA, the best tracker, pruning's schedule, the LR schedule):
    killed at the step after a validation that did not improve (its step checkpoint held early stopping's count of before
    it, so the resumed run stopped a validation later, with other weights) or after another one, and resumed, a run ends
    where the uninterrupted one ends, with its weights and callback states."""
    base = cls_base + [
        *stateful,
        "callbacks.early_stopping.patience=2",
        "trainer.val_check_interval=4",  # a validation every 2 optimizer steps, each a step checkpoint too
        "callbacks.step_checkpoint.every_n_train_steps=2",
        "optimizer.lr=5e-3",
    ]
    reference_dir = tmp_path / "reference"
    result = run_train(reference_dir, base)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = callback_states(reference_dir)
    rows = [row for row in read_metrics(reference_dir / "csv") if row.get("val/acc")]
    validated = [(int(row["step"]) + 1, float(row["val/acc"]), float(row["val/acc_best"])) for row in rows]  # (optimizer step, ...)
    steps = [step for step, _, _ in validated if step < reference[0]]
    missed = [step for (step, _, best), (_, _, before) in zip(validated[1:], validated) if best == before and step < reference[0]]
    kill = missed[0] if missed else random.Random().choice(steps)
    context = f"SIGKILL before micro-batch 2 of step {kill}, after the validation at step {kill} (validations: {validated})"
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={kill}", "+callbacks.fault.micro_batch=1"]
    run_dir, _ = kill_and_resume(base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_state(reference, callback_states(run_dir), context)
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


# ----------------------------------------------------------------------------- causal LM
@pytest.fixture(scope="module")
def lm_base(lm_tokenizer_dir, lm_text, tmp_path_factory) -> list[str]:
    from ..conftest import lm_overrides

    return without_output_dir(lm_overrides(lm_tokenizer_dir, lm_text, tmp_path_factory.mktemp("lm") / "run")) + [
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "data.max_length=16",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        f"callbacks.step_checkpoint.every_n_train_steps={EVERY}",
        "optimizer.lr=3e-3",
        "test_after_fit=false",
        "callbacks.sample_generation.every_n_steps=4",
        "callbacks.sample_generation.do_sample=true",
        "+model.config.attention_dropout=0.1",  # dropout on: the RNG state must be restored too
    ]


@pytest.fixture(scope="module")
def lm_reference(lm_base, tmp_path_factory) -> dict[int, float]:
    losses = uninterrupted_losses(lm_base, tmp_path_factory.mktemp("lm_reference"))
    assert len(losses) > 2 * EVERY + 2
    return losses


def test_lm_killed_at_a_random_point_resumes_bit_identically(lm_base, lm_reference, tmp_path):
    rng = random.Random()
    step, micro_batch = rng.randrange(EVERY + 1, len(lm_reference) - 1), rng.randrange(2)
    if (step + 1) % (len(lm_reference) // 2) == 0:
        micro_batch = 0  # an epoch's last step is a partial window of one micro-batch here (2 epochs)
    context = f"SIGKILL before micro-batch {micro_batch + 1} of step {step}"
    fault = ["+callbacks.fault._target_=faults.KillAt", f"+callbacks.fault.step={step}", f"+callbacks.fault.micro_batch={micro_batch}"]
    run_dir, _ = kill_and_resume(lm_base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(lm_reference, step_losses(run_dir), context)


def test_lm_with_ema_and_early_stopping_killed_resumes_to_the_same_stop_and_weights(lm_base, tmp_path):
    """The EMA's two weight sets and early stopping's counters come back from ``last.ckpt``: after a
    SIGKILL the resumed run logs the same losses, stops at the same validation and ends with the
    same raw and averaged weights.  ``mode=max`` on ``val/loss`` makes the stop come early and at a
    known count (the first validation is the best; the third is the second without an
    improvement); a resume that lost the counter would stop a validation or more later."""
    import torch

    base = [
        *lm_base,
        "callbacks=[ema,early_stopping]",
        "callbacks.ema.decay=0.5",
        "callbacks.early_stopping.patience=2",
        "callbacks.early_stopping.mode=max",
        "trainer.val_check_interval=4",  # micro-batches: every 2 optimizer steps
    ]
    reference_dir = tmp_path / "reference"
    reference = uninterrupted_losses(base, reference_dir)
    assert len(reference) == 6, sorted(reference)  # stopped at the 3rd validation (step 6), not at max_epochs
    fault = ["+callbacks.fault._target_=faults.KillAt", "+callbacks.fault.step=5", "+callbacks.fault.micro_batch=0"]
    run_dir, _ = kill_and_resume(base, tmp_path, fault, expect_code=-signal.SIGKILL)  # (resumes from step 3 or 4)
    assert_same_losses(reference, step_losses(run_dir), "callbacks=[ema,early_stopping], SIGKILL before step 5")
    ends = [torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True) for d in (reference_dir, run_dir)]
    raw = ends[0]["callbacks"]["EMA"]["raw"]
    assert raw and set(raw) == set(ends[1]["callbacks"]["EMA"]["raw"])
    for name, value in raw.items():
        assert torch.equal(ends[1]["callbacks"]["EMA"]["raw"][name], value), name
        assert torch.equal(ends[1]["state_dict"][name], ends[0]["state_dict"][name]), name  # the average
    stopping = [next(value for key, value in end["callbacks"].items() if key.startswith("EarlyStopping")) for end in ends]
    assert stopping[0] == stopping[1] and stopping[0]["wait_count"] == 2


def test_kill_during_a_checkpoint_write_leaves_the_previous_last_ckpt(lm_base, lm_reference, tmp_path):
    # The 2nd save is the step checkpoint after step 2 * EVERY; the kill tears its write in half.
    fault = ["trainer.plugins=[{_target_: faults.KillDuringSave, save: 2}]"]
    run_dir = tmp_path / "killed"
    killed = run_train(run_dir, lm_base + fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "SIGKILL in thread checkpoint-writer" in killed.stderr  # in the middle of a background write
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == EVERY  # the first save, whole
    assert list((run_dir / "checkpoints").glob(".*.partial")), "the torn write should be a temporary file"
    resumed = run_train(run_dir, lm_base + ["ckpt_path=last", WITHOUT_FAULT])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((run_dir / "checkpoints").glob(".*.partial"))
    assert_same_losses(lm_reference, step_losses(run_dir), "kill during the second checkpoint write")


def test_a_kill_right_after_a_checkpoint_loses_no_logged_step(lm_base, lm_reference, tmp_path):
    # The 2nd save (step 2 * EVERY) completes, then the process dies before the step is logged
    # the usual way: the row must already be in the CSV, since the resumed run starts after it.
    fault = ["trainer.plugins=[{_target_: faults.KillAfterSave, save: 2}]"]
    run_dir, _ = kill_and_resume(lm_base, tmp_path, fault, expect_code=-signal.SIGKILL)
    assert_same_losses(lm_reference, step_losses(run_dir), "kill right after the second checkpoint write")


def test_sigterm_finishes_the_step_saves_and_exits_143(lm_base, lm_reference, tmp_path):
    step = EVERY + 1  # not a step-checkpoint step: this last.ckpt can only come from the signal
    fault = [
        "+callbacks.fault._target_=faults.KillAt",
        f"+callbacks.fault.step={step}",
        "+callbacks.fault.micro_batch=1",
        "+callbacks.fault.signal_name=SIGTERM",
    ]
    run_dir = tmp_path / "stopped"
    stopped = run_train(run_dir, lm_base + fault)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert f"Stopped by SIGTERM after optimizer step {step + 1}" in stopped.stderr
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == step + 1  # the step in progress was finished
    assert max(step_losses(run_dir)) == step  # ... and logged
    resumed = run_train(run_dir, lm_base + ["ckpt_path=last", WITHOUT_FAULT])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_losses(lm_reference, step_losses(run_dir), f"SIGTERM during step {step}")


def test_a_hub_models_revision_moved_in_the_cache_is_refused_on_resume_unless_allowed(
    lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path
):
    """Offline, a hand-made Hugging Face cache with two snapshots of one Hub id: a run trained on the first, resumed after
    refs/main moved to the second, is refused (naming both revisions and the resume.allow_changed fix), then allowed."""
    import shutil
    import sys

    import torch
    from safetensors.torch import load_file, save_file

    from ..conftest import lm_overrides
    from ..processes import subprocess_env
    from ..test_run_identity import fake_hub_cache

    first, second = "1" * 40, "2" * 40
    changed = tmp_path / "changed"
    shutil.copytree(pretrained_lm_dir, changed)
    weights = load_file(changed / "model.safetensors")
    weights = {name: tensor + 0.01 if tensor.is_floating_point() else tensor for name, tensor in weights.items()}
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    hub = tmp_path / "hub"
    repo = fake_hub_cache(hub, "org/tiny-llama", {first: pretrained_lm_dir, second: changed}, main=first)
    env = {**subprocess_env(), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "run"
    base = [*without_output_dir(lm_overrides(lm_tokenizer_dir, lm_text, run_dir)), "model.name_or_path=org/tiny-llama", "model.config=null"]
    base += ["trainer.val_check_interval=2", "callbacks.sample_generation=null", "test_after_fit=false", f"hydra.run.dir={run_dir}"]

    def train(*more: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", *base, *more]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    done = train("trainer.max_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    identity = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["identity"]
    assert identity["files"]["model.name_or_path"]["revision"] == first
    (repo / "refs" / "main").write_text(second)
    refused = train("trainer.max_steps=4", "ckpt_path=last")
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert f"revision {first}" in refused.stderr and f"revision {second}" in refused.stderr
    assert "fix: resume.allow_changed=[model.name_or_path@revision]" in refused.stderr
    allowed = train("trainer.max_steps=4", "ckpt_path=last", "resume.allow_changed=[model.name_or_path@revision]")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
{%- endif %}
