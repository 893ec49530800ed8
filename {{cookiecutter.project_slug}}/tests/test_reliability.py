"""Out-of-memory and non-finite-loss stops, seeds, kill-safe files, W&B resume, and the batch
edge cases (a data set smaller than one batch, fewer batches than the accumulation factor)."""

from __future__ import annotations

{% if cookiecutter.tasks != "causal_lm" %}import signal
{% endif %}from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.core.checkpoints.io import AtomicCheckpointIO
{% if cookiecutter.tasks != "causal_lm" %}from {{ cookiecutter.package_name }}.core.errors import EXIT_NON_FINITE_LOSS, RunStopped
{% endif %}from {{ cookiecutter.package_name }}.core.loggers.csv_log import ResumableCSVLogger
from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import launch_files, read_metrics
{% if cookiecutter.tasks != "causal_lm" %}from {{ cookiecutter.package_name }}.train import train

from .processes import step_losses
{% endif %}

def csv_rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "csv")


# ------------------------------------------------------------------------ kill-safe files
class _Torn(RuntimeError):
    pass


class TornWrite(AtomicCheckpointIO):
    """Writes half a checkpoint, then fails: what a kill or a full disk does mid-save."""

    def write(self, checkpoint, file) -> None:
        file.write(b"half a checkpoint")
        raise _Torn


def test_a_failed_checkpoint_write_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    with pytest.raises(_Torn):
        TornWrite().save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_each_launch_writes_its_own_csv_and_a_resume_replaces_the_steps_it_logs_again(tmp_path):
    first = ResumableCSVLogger(tmp_path, name="csv", flush_logs_every_n_steps=1)
    for step in range(6):
        first.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    # killed after step 5; the checkpoint was at step 3, so the resumed launch logs 3, 4, ... again
    resumed = ResumableCSVLogger(tmp_path, name="csv", flush_logs_every_n_steps=1)
    resumed.log_metrics({"train/loss": 0.3, "val/loss": 0.5}, step=3)
    assert [p.parent.name for p in launch_files(tmp_path / "csv")] == ["version_0", "version_1"]
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().count("\n") == 7  # the first launch's file is never rewritten
    rows = csv_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert [r["train/loss"] for r in rows] == ["1.0", "0.5", str(1 / 3), "0.3"]
    assert rows[3]["val/loss"] == "0.5" and rows[0]["val/loss"] == ""
    # A launch that died before its first row cuts nothing; the next one still replaces from its first step.
    ResumableCSVLogger(tmp_path, name="csv").log_hyperparams({"seed": 1})
    third = ResumableCSVLogger(tmp_path, name="csv", flush_logs_every_n_steps=1)
    third.log_metrics({"train/loss": 0.7}, step=2)
    assert [(int(r["step"]), r["train/loss"]) for r in csv_rows(tmp_path)] == [(0, "1.0"), (1, "0.5"), (2, "0.7")]


def test_a_new_column_rewrites_the_file_whole_and_a_row_written_early_is_not_written_again(tmp_path):
    logger = ResumableCSVLogger(tmp_path, name="csv", flush_logs_every_n_steps=1)
    logger.log_metrics({"train/loss": 2.0, "epoch": 0}, step=0)
    logger.experiment.write_now({"train/loss": float("nan"), "epoch": 0}, step=1)  # before step 1's checkpoint
    logger.log_metrics({"train/loss": torch.tensor(float("nan")), "epoch": 0, "train/extra": 1.0}, step=1)  # Lightning's delivery
    logger.log_metrics({"val/loss": 1.5, "epoch": 0}, step=1)  # another row at the same step is written
    logger.experiment.write_now({"train/loss": 3.0, "epoch": 0}, step=2)
    logger.experiment.write_now({"train/loss": 3.0, "epoch": 0}, step=2)  # a second save of the same step
    logger.finalize("success")
    rows = csv_rows(tmp_path)
    assert [(r["step"], r["train/loss"], r["train/extra"], r["val/loss"]) for r in rows] == [
        ("0", "2.0", "", ""),
        ("1", "nan", "", ""),
        ("1", "", "1.0", ""),
        ("1", "", "", "1.5"),
        ("2", "3.0", "", ""),
    ]
    assert sorted(p.name for p in (tmp_path / "csv" / "version_0").iterdir()) == ["metrics.csv"]  # no partial file left


{%- if cookiecutter.tasks != "causal_lm" %}


# ------------------------------------------------------------------------ out of memory


# ------------------------------------------------------------------------------ signals
@pytest.mark.parametrize("name", ["SIGINT", "SIGUSR1"])
def test_ctrl_c_and_slurms_signal_finish_the_step_save_and_keep_a_requeue_handler(make_cfg, tmp_path, name):
    signum = getattr(signal, name)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    requeued = []
    previous = signal.signal(signal.SIGUSR1, lambda *args: requeued.append(args[0]))  # stands in for Lightning's SLURM requeue
    try:
        cfg = make_cfg(
            "+callbacks.fault._target_=tests.faults.KillAt",
            "+callbacks.fault.step=2",
            "+callbacks.fault.micro_batch=1",
            f"+callbacks.fault.signal_name={name}",
            "batch.micro_batch_size=8",
            "test_after_fit=false",
        )
        with pytest.raises(RunStopped) as stop:
            train(cfg)
        assert stop.value.exit_code == 128 + signum
        assert f"Stopped by {name} after optimizer step 3" in str(stop.value)
        assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
        assert requeued == ([signal.SIGUSR1] if name == "SIGUSR1" else [])  # the earlier handler still ran
        assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers put back after the stop
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_stop_on_signal_puts_the_previous_handlers_back_at_teardown(tmp_path):
    from {{ cookiecutter.package_name }}.core.callbacks.guards import StopOnSignal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopper = StopOnSignal(str(tmp_path), ["SIGTERM", "SIGINT"])
    stopper.on_train_start(None, None)
    assert all(signal.getsignal(sig) == stopper._handle for sig in before)
    stopper.teardown(None, None, "fit")
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_test_after_the_fit_exits_128_plus_n_without_metrics(make_cfg, tmp_path, name):
    """Lightning would end a SIGTERM there with exit code 0 (and Ctrl-C with 1): a killed run counted as done."""
    signum = getattr(signal, name)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    cfg = make_cfg("+callbacks.fault._target_=tests.faults.SignalWhileTesting", f"+callbacks.fault.signal_name={name}")
    with pytest.raises(RunStopped) as stop:
        train(cfg)
    assert stop.value.exit_code == 128 + signum
    assert f"Stopped by {name} outside the optimizer steps" in str(stop.value)
    run_dir = tmp_path / "run"
    assert not (run_dir / "metrics.json").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # the fit's weights are kept
    assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers put back


# ---------------------------------------------------------------------- non-finite loss
def test_a_nan_step_is_skipped_and_does_not_advance_the_lr_schedule(make_cfg, tmp_path, recwarn):
    cfg = make_cfg(
        "+callbacks.fault._target_=tests.faults.NaNLogits",
        "+callbacks.fault.steps=[2]",
        "callbacks.non_finite_loss.action=skip",
        "trainer.max_steps=6",
        "lr_schedule=linear_warmup",
        "batch.micro_batch_size=8",
        "test_after_fit=false",
    )
    train(cfg)
    rows = csv_rows(tmp_path / "run")
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    lrs = {int(r["step"]): float(r["train/lr"]) for r in rows if r.get("train/lr")}  # LR used in that step
    assert str(losses[2]) == "nan" and all(loss == loss for step, loss in losses.items() if step != 2)
    assert lrs[3] == lrs[2] and lrs[4] < lrs[3]  # (linear decay: the skipped step did not move it)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    weights = [t for name, t in state["state_dict"].items() if name.startswith("model.")]
    assert state["skipped_steps"] == 1 and all(torch.isfinite(t).all() for t in weights)
    assert any("at optimizer step 2 (epoch 0, micro-batches 4-5 of the epoch): update skipped" in str(w.message) for w in recwarn)


def test_consecutive_nan_steps_stop_with_the_last_good_weights(make_cfg, tmp_path):
    cfg = make_cfg(
        "+callbacks.fault._target_=tests.faults.NaNLogits",
        "+callbacks.fault.steps=[3,4]",
        "callbacks.non_finite_loss.patience=2",
        "trainer.max_steps=8",
        "test_after_fit=false",
    )
    with pytest.raises(RunStopped) as stop:
        train(cfg)
    assert stop.value.exit_code == EXIT_NON_FINITE_LOSS
    assert "non-finite for 2 optimizer steps in a row, the last at optimizer step 4" in str(stop.value)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 5 and state["skipped_steps"] == 2
    assert all(torch.isfinite(t).all() for name, t in state["state_dict"].items() if name.startswith("model."))
    assert max(int(r["step"]) for r in csv_rows(tmp_path / "run") if r.get("train/loss")) == 4  # the stop step is logged


# ------------------------------------------------------------------------- W&B on resume
def test_each_launch_of_a_resumed_run_is_its_own_wandb_run_in_one_group_on_the_global_step(make_cfg, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    given = []  # (run id, group, name, notes, step) of every log_metrics call
    log_metrics = WandbLogger.log_metrics

    def recording(self, metrics, step=None):
        run = self.experiment
        given.append((run.id, run.group, run.name, run.notes, step))
        return log_metrics(self, metrics, step)

    monkeypatch.setattr(WandbLogger, "log_metrics", recording)
    common = ("logger=wandb", "test_after_fit=false", "batch.micro_batch_size=8")
    train(make_cfg(*common, "trainer.max_steps=3"))
    first_id = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["wandb_run_id"]
    train(make_cfg(*common, "trainer.max_steps=5", "ckpt_path=last"))
    ids = list(dict.fromkeys(run_id for run_id, *_ in given))
    assert len(ids) == 2 and ids[0] == first_id  # one W&B run per launch
    first, second = ([g for g in given if g[0] == run_id] for run_id in ids)
    assert {g[1:3] for g in first} == {g[1:3] for g in second} == {("train", "run")}  # one group, the run folder's name
    assert all(first_id in g[3] for g in second)  # the resumed launch names the run it continues
    first_steps, second_steps = [g[4] for g in first if g[4] is not None], [g[4] for g in second if g[4] is not None]
    assert max(first_steps) < min(second_steps) and max(second_steps) == 4  # trainer/global_step continues, no overlap
    parts = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert sorted(p.name.rsplit("-", 1)[1] for p in parts) == sorted(ids)


def test_a_wandb_run_starts_without_a_warning_of_our_own_making(make_cfg, capfd, monkeypatch):
    from {{ cookiecutter.package_name }}.core.config.instantiate import instantiate_loggers
    from {{ cookiecutter.package_name }}.core.run.entry import close_loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    loggers = instantiate_loggers(make_cfg("logger=wandb"))
    try:
        run = loggers[0].experiment
        assert (run.name, run.group, run.settings.mode) == ("run", "train", "offline")
    finally:
        close_loggers(loggers, failed=False)
    printed = capfd.readouterr()
    assert "anonymous setting" not in printed.err + printed.out and "already in progress" not in printed.err + printed.out


# ------------------------------------------------------------------------------- seeds
def first_losses(make_cfg, run: str, *overrides: str) -> list[float]:
    cfg = make_cfg(
        "trainer.max_steps=4",
        "batch.micro_batch_size=8",
        "test_after_fit=false",
        "task.validate_before_fit=false",
        "trainer.num_sanity_val_steps=0",
        *overrides,
    )
    cfg.paths.output_dir = str(Path(cfg.paths.output_dir).parent / run)
    train(cfg)
    return list(step_losses(Path(cfg.paths.output_dir)).values())


def test_the_same_seed_repeats_the_losses_and_seed_0_is_a_seed(make_cfg):
    zero = first_losses(make_cfg, "a", "seed=0")
    assert first_losses(make_cfg, "b", "seed=0") == zero
    assert first_losses(make_cfg, "c", "seed=1") != zero


# ------------------------------------------------------------------- small data, batches
def test_a_data_set_smaller_than_one_batch_trains_one_step_per_epoch(make_cfg, tmp_path):
    from .conftest import toy_rows, write_csv

    small = write_csv(tmp_path / "small.csv", toy_rows(5, seed=7))
    metrics = train(make_cfg(f"data.splits.train={small}", "batch.micro_batch_size=16", "trainer.max_epochs=3"))
    assert metrics["rows"]["train"] == 5
    assert max(step_losses(tmp_path / "run")) == 2  # steps 0, 1, 2: one per epoch


def one_step_weights(make_cfg, tmp_path: Path, rows: Path, micro_batch: int, global_batch: int, run: str) -> dict:
    cfg = make_cfg(
        f"data.splits.train={rows}",
        f"batch.micro_batch_size={micro_batch}",
        f"batch.global_batch_size={global_batch}",
        "trainer.max_epochs=1",
        "data.group_by_length=false",
        "+model.config.hidden_dropout_prob=0.0",
        "+model.config.attention_probs_dropout_prob=0.0",
        "trainer.gradient_clip_val=null",
        "test_after_fit=false",
        "task.validate_before_fit=false",
    )
    cfg.paths.output_dir = str(tmp_path / run)
    train(cfg)
    return torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def test_a_partial_accumulation_window_steps_on_the_mean_of_its_rows(make_cfg, tmp_path):
    from .conftest import toy_rows, write_csv

    rows = write_csv(tmp_path / "twenty.csv", toy_rows(20, seed=8))
    # 20 rows as micro-batches 8 + 8 + 4 of a global batch of 64: fewer batches than the
    # accumulation factor (8), so the epoch's only step is a partial window ...
    partial = one_step_weights(make_cfg, tmp_path, rows, micro_batch=8, global_batch=64, run="partial")
    # ... which must update the weights as one batch of the same 20 rows does.
    whole = one_step_weights(make_cfg, tmp_path, rows, micro_batch=20, global_batch=20, run="whole")
    for name, value in whole.items():
        torch.testing.assert_close(partial[name], value, rtol=1e-5, atol=1e-6, msg=name)
{%- endif %}
