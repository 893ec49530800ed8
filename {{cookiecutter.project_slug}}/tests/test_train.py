"""End-to-end runs of train, eval and predict on a 2-layer BERT (seconds on a CPU)."""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
from pathlib import Path
from types import SimpleNamespace

import hydra
import pandas as pd
import pytest
import torch
from tqdm import tqdm
from transformers import AutoConfig

from {{ cookiecutter.package_name }}.core.callbacks.terminal import ProgressBar
from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics
from {{ cookiecutter.package_name }}.core.models import builder
from {{ cookiecutter.package_name }}.core.models.inputs import ModelInputs
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.predict import predict
from {{ cookiecutter.package_name }}.train import train


def logged(run_dir: Path, key: str) -> list[float]:
    """The values of ``key`` in the run's CSV log, in step order."""
    return [float(row[key]) for row in read_metrics(run_dir / "csv") if row.get(key)]


def test_fast_dev_run_writes_metrics(make_cfg, tmp_path):
    metrics = train(make_cfg("debug=fdr"))
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["test/acc"] == pytest.approx(metrics["test/acc"])
    assert 0.0 <= written["test/acc"] <= 1.0
    assert written["rows"] == {"train": 96, "validation": 32, "test": 40}


def test_a_step_after_the_fit_that_fails_keeps_what_the_fit_measured(make_cfg, tmp_path, monkeypatch):
    import lightning as L

    def broken_test(*args, **kwargs):
        raise RuntimeError("the test loader broke")

    monkeypatch.setattr(L.Trainer, "test", broken_test)
    with pytest.raises(RuntimeError, match="the test loader broke"):
        train(make_cfg("debug=fdr"))
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["after_fit_error"].startswith("the test of ") and written["after_fit_error"].endswith(
        "RuntimeError: the test loader broke"
    )
    assert math.isfinite(written["val/loss"]) and "val/acc" in written and "test/acc" not in written


def test_the_printed_commands_pasted_into_a_shell_run_what_ran(make_cfg):
    """Braces, commas, spaces, ``$`` and quotes in an override survive bash: the pasted command's argv is the run's, so
    Hydra composes the same config."""
    import subprocess
    import sys

    from {{ cookiecutter.package_name }}.train import train_command

    ran = ["+judge={_target_:json.loads,_partial_:true}", "+notes=a b", "+step=${trainer.max_steps}", "+glob=*.csv", '+q="it\'s here"']
    ran += ["+list=[1,2]", "trainer.max_steps=3", "ckpt_path=old.ckpt"]
    more = ["ckpt_path=last", "hydra.run.dir=/tmp/a run"]
    command = train_command(make_cfg(), *more, overrides=ran)
    echo = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    pasted = subprocess.run(["bash", "-c", command.replace("python -m {{ cookiecutter.package_name }}.train", echo, 1)], capture_output=True, text=True)
    argv = json.loads(pasted.stdout)
    assert argv == [*ran[:-1], *more]
    assert make_cfg(*argv[:-2]) == make_cfg(*ran[:-1])


@pytest.fixture(scope="module")
def trained_run(tokenizer_dir, toy_data, tmp_path_factory):
    """Eight epochs on the toy data (accumulating 2 micro-batches of 8); returns (run_dir, metrics)."""
    from .conftest import compose_config, tiny_overrides

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    overrides = tiny_overrides(tokenizer_dir, toy_data, run_dir) + [
        "trainer.max_epochs=8",
        "optimizer.lr=2e-3",
        "batch.micro_batch_size=8",
        "trainer.log_every_n_steps=1",
    ]
    return run_dir, train(compose_config("train", overrides))


def test_train_learns_the_toy_task_and_tests_the_best_checkpoint(trained_run):
    run_dir, metrics = trained_run
    assert metrics["test/acc"] >= 0.9, metrics
    assert Path(metrics["best_checkpoint"]).name.startswith("best-")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert "hidden_size: 64" in (run_dir / "config_tree.log").read_text()
    assert metrics["val/acc_best"] >= metrics["val/acc"] - 1e-6


def test_checkpoint_loads_with_weights_only_and_holds_the_model_inputs(trained_run):
    run_dir, metrics = trained_run
    checkpoint = torch.load(metrics["best_checkpoint"], map_location="cpu", weights_only=True)
    inputs = checkpoint["model_inputs"]
    assert inputs["id2label"] == {0: "negative", 1: "positive"}
    assert (inputs["max_length"], inputs["micro_batch_size"], inputs["precision"]) == (32, 8, "32-true")
    assert checkpoint["hyper_parameters"]["hf_config"]["id2label"] == {"0": "negative", "1": "positive"}
    restored = ModelInputs.from_state_dict(inputs)
    assert restored.tokenizer.convert_tokens_to_ids("good") != restored.tokenizer.unk_token_id
    assert restored.label2id == {"negative": 0, "positive": 1} and restored.compute_dtype == torch.float32


def test_last_checkpoint_holds_the_weights_the_fit_ended_with(trained_run):
    # 48 optimizer steps, last.ckpt every 50 (and at each new best): the end of the fit writes it too.
    run_dir, metrics = trained_run
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 48


@pytest.mark.parametrize("entry", ["eval", "quantize"])
def test_a_file_that_is_not_a_trained_checkpoint_is_refused_by_name(make_cfg, toy_data, tmp_path, entry):
    from {{ cookiecutter.package_name }}.quantize import quantize

    run = {"eval": evaluate, "quantize": quantize}[entry]
    with pytest.raises(ConfigError, match=r"is not a readable checkpoint .*fix: ckpt_path=RUN/checkpoints/last.ckpt"):
        run(make_cfg(f"ckpt_path={toy_data['test']}", config_name=entry))
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")  # another project's checkpoint
    with pytest.raises(ConfigError, match="is not a checkpoint written by train"):
        run(make_cfg(f"ckpt_path={tmp_path / 'other.ckpt'}", config_name=entry))
    with pytest.raises(ConfigError, match="ckpt_path='last' is not a file") as refused:
        run(make_cfg("ckpt_path=last", config_name=entry))  # `last` resumes a training run; it names no file here
    assert "resume" not in str(refused.value)


def test_the_best_so_far_is_in_the_checkpoint_so_a_resume_keeps_it(trained_run):
    run_dir, metrics = trained_run
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert float(state["val_acc_best.max_value"]) == pytest.approx(metrics["val/acc_best"])


def test_max_length_beyond_the_encoders_positions_fails_before_the_data_or_weights_load(make_cfg, monkeypatch):
    from {{ cookiecutter.package_name }}.tasks.classification.data import ClassificationDataModule
    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule

    def refuse(*args, **kwargs):
        raise AssertionError("reached after the check should have failed")

    monkeypatch.setattr(SequenceClassificationModule, "build_model", refuse)
    monkeypatch.setattr(ClassificationDataModule, "setup", refuse)
    fix = r"data.max_length=1024 is longer than this model's maximum positions \(512, bert\); fix: data.max_length=512 or less"
    with pytest.raises(ConfigError, match=fix):
        train(make_cfg("data.max_length=1024"))


def test_the_module_is_handed_the_configs_facts_then_the_datas_and_refuses_to_run_without(make_cfg, tokenizer_dir, toy_data):
    """build_module hands the config's facts (no data read yet); ConnectData the data's, once set
    up; a trainer without it stops with the fix before any weights are built."""
    import lightning as L

    from {{ cookiecutter.package_name }}.core.models.inputs import ConnectData
    from {{ cookiecutter.package_name }}.core.task import build_module

    cfg = make_cfg("data.max_length=24", "batch.global_batch_size=8", "batch.micro_batch_size=4")
    module = build_module(cfg)
    assert (module.inputs.precision, module.inputs.max_length, module.inputs.micro_batch_size) == ("32-true", 24, 4)
    assert module.inputs.tokenizer is None and module.tokenizer is None
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match=r"was not handed its data's facts .*add core.models.inputs.ConnectData\(\)"):
        trainer.fit(module, datamodule=hydra.utils.instantiate(cfg.data))
    assert module.model is None
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[ConnectData()]
    )
    trainer.fit(module, datamodule=hydra.utils.instantiate(cfg.data))
    assert module.inputs.id2label == {0: "negative", 1: "positive"} and module.tokenizer is module.inputs.tokenizer
    assert module.inputs.tokenizer.convert_tokens_to_ids("good") != module.inputs.tokenizer.unk_token_id


@pytest.mark.parametrize(
    "model_type, fields, positions",
    [
        ("bert", {"max_position_embeddings": 512}, 512),
        ("roberta", {"max_position_embeddings": 514, "pad_token_id": 1}, 512),  # position ids start after the padding index
        ("xlm-roberta", {"max_position_embeddings": 514, "pad_token_id": 1}, 512),
        ("gpt2", {"n_positions": 256}, 256),
    ],
)
def test_max_positions_counts_the_tokens_a_model_can_take(model_type, fields, positions):
    assert builder.max_positions(AutoConfig.for_model(model_type, **fields)) == positions


@pytest.mark.parametrize("interval, fix", [("3", "2"), ("5", "4"), ("0.25", "2")])
def test_a_validation_inside_an_optimizer_step_is_refused_before_weights_load(make_cfg, monkeypatch, interval, fix):
    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was built before the interval was checked")

    monkeypatch.setattr(SequenceClassificationModule, "build_model", no_weights)
    # 96 rows / micro-batch 8 = 12 micro-batches per epoch, 2 per optimizer step (global batch 16)
    cfg = make_cfg("batch.global_batch_size=16", "batch.micro_batch_size=8", f"trainer.val_check_interval={interval}")
    refusal = rf"inside an optimizer step of accumulate_grad_batches=2 .* fix: trainer.val_check_interval={fix} "
    with pytest.raises(ConfigError, match=refusal):
        train(cfg)


def test_eval_reproduces_the_test_metrics(trained_run, make_cfg, tmp_path):
    run_dir, metrics = trained_run
    evaluated = evaluate(make_cfg(f"ckpt_path={metrics['best_checkpoint']}", config_name="eval"))
    for key in ("test/acc", "test/f1_macro", "test/loss"):
        assert evaluated[key] == pytest.approx(metrics[key], abs=1e-6), key
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test/acc"] == pytest.approx(metrics["test/acc"])


def test_predict_writes_labels_and_probabilities(trained_run, make_cfg, toy_data, tmp_path):
    _, metrics = trained_run
    out = tmp_path / "predictions.csv"
    predict(make_cfg(f"ckpt_path={metrics['best_checkpoint']}", f"input={toy_data['test']}", f"output={out}", config_name="predict"))
    frame = pd.read_csv(out)
    assert list(frame.columns) == ["text", "label", "predicted_label", "prob_negative", "prob_positive"]
    assert len(frame) == 40
    assert ((frame.prob_negative + frame.prob_positive) - 1).abs().max() < 1e-5
    assert set(frame.predicted_label) <= {"negative", "positive"}
    assert (frame.predicted_label == frame.label).mean() == pytest.approx(metrics["test/acc"], abs=1e-6)


def test_predict_writes_the_inputs_cells_back_as_written(trained_run, make_cfg, tmp_path):
    _, metrics = trained_run
    source = tmp_path / "texts.csv"
    cells = [["null", "007"], ["NA", "1.50"], ["None", ""], ["n/a", "nan"], ["a good film", "N/A"]]
    source.write_text("text,note\n" + "".join(f"{text},{note}\n" for text, note in cells))
    out = tmp_path / "predictions.csv"
    predict(make_cfg(f"ckpt_path={metrics['best_checkpoint']}", f"input={source}", f"output={out}", config_name="predict"))
    with out.open(newline="") as file:
        written = list(csv.reader(file))
    assert written[0][:2] == ["text", "note"] and [row[:2] for row in written[1:]] == cells


@pytest.mark.parametrize(
    ("entry", "step", "written"), [("eval", "test_step", "metrics.json"), ("predict", "predict_step", "predictions.csv")]
)
def test_sigterm_inside_the_loop_of_eval_and_predict_exits_143_and_writes_nothing(
    trained_run, make_cfg, toy_data, tmp_path, monkeypatch, capsys, entry, step, written
):
    """Lightning alone ends a SIGTERM in its test loop with exit code 0 and ignores one in its
    predict loop: a killed eval or predict would count as done (and predict would finish)."""
    import importlib
    import os
    import signal

    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule

    original = getattr(SequenceClassificationModule, step)

    def killed(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a scheduler's time limit, mid-loop
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SequenceClassificationModule, step, killed)
    _, metrics = trained_run
    args = [f"ckpt_path={metrics['best_checkpoint']}", f"paths.output_dir={tmp_path / 'out'}"]
    if entry == "predict":
        args.append(f"input={toy_data['test']}")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"{{ cookiecutter.package_name }}.{entry}").main(make_cfg(*args, config_name=entry))  # Hydra passes a cfg through
    assert stop.value.code == 128 + signal.SIGTERM
    assert "Stopped by SIGTERM" in capsys.readouterr().err
    assert not (tmp_path / "out" / written).exists()
    assert signal.getsignal(signal.SIGTERM) == before


def test_predict_under_the_training_runs_ddp_trainer_writes_every_row_once_in_order(trained_run, make_cfg, toy_data, tmp_path):
    _, metrics = trained_run
    outputs = {}
    for trainer in ("default", "ddp_cpu"):
        outputs[trainer] = tmp_path / f"{trainer}.csv"
        args = [f"ckpt_path={metrics['best_checkpoint']}", f"input={toy_data['test']}", f"output={outputs[trainer]}", f"trainer={trainer}"]
        predict(make_cfg(*args, config_name="predict"))
    assert outputs["ddp_cpu"].read_text() == outputs["default"].read_text()
    assert len(pd.read_csv(outputs["ddp_cpu"])) == 40


def test_overfitting_one_batch_drives_the_loss_down(make_cfg, tmp_path):
    train(make_cfg("debug=overfit", "optimizer.lr=2e-3", "trainer.log_every_n_steps=1", "test_after_fit=false"))
    losses = logged(tmp_path / "run", "train/loss")
    assert len(losses) == 30
    assert losses[-1] < 0.3 * losses[0], losses


def test_each_optimizer_steps_row_reaches_the_loggers_once_at_their_pace(make_cfg, tmp_path, monkeypatch):
    # The module sends its per-step row itself (not through self.log): every 3rd optimizer step
    # here, once, whole (loss, lr, epoch), with accumulation counting optimizer steps, and the
    # last step's loss is metrics.json's train/loss and the progress bar's loss.
    shown = []
    get_metrics = ProgressBar.get_metrics
    monkeypatch.setattr(
        ProgressBar, "get_metrics", lambda self, trainer, module: shown.append(get_metrics(self, trainer, module)) or shown[-1]
    )
    cfg = make_cfg(
        "batch.global_batch_size=16", "batch.micro_batch_size=8", "trainer.max_steps=6", "trainer.log_every_n_steps=3",
        "trainer.val_check_interval=4", "test_after_fit=false", "callbacks.progress_bar.refresh_rate=1",
    )  # fmt: skip
    metrics = train(cfg)
    rows = [row for row in read_metrics(tmp_path / "run" / "csv") if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == [2, 5]  # optimizer steps 3 and 6, each once
    assert all(row["epoch"] == "0" for row in rows)
    lr_steps = [int(row["step"]) for row in read_metrics(tmp_path / "run" / "csv") if row.get("train/lr")]
    assert lr_steps == [2, 5] and all(row["train/lr"] for row in rows)  # train/lr in the same rows as train/loss
    assert metrics["train/loss"] == pytest.approx(float(rows[-1]["train/loss"]))
    assert any(set(postfix) >= {"loss"} for postfix in shown) and shown[-1]["loss"] == pytest.approx(metrics["train/loss"])


def test_the_training_bar_draws_by_time_once_per_redraw_with_the_count_and_the_shown_metrics(monkeypatch):
    # Lightning's bar draws the count, then the postfix (two terminal writes per refresh); ours
    # draws once, at the first batch, then at most every refresh_seconds, and at the last batch.
    from {{ cookiecutter.package_name }}.core.callbacks import terminal

    clock = iter([0.0, 0.2, 0.45, 0.5, 0.9, 1.05, 1.1])  # time.monotonic() at each batch's end
    monkeypatch.setattr(terminal, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    bar = ProgressBar(metrics=["train/loss", "val/acc"], refresh_rate=2, refresh_seconds=0.5)
    bar.train_progress_bar = tqdm(total=7, file=io.StringIO())
    draws = []
    bar.train_progress_bar.refresh = lambda *args, **kwargs: draws.append((bar.train_progress_bar.n, str(bar.train_progress_bar.postfix)))
    trainer = SimpleNamespace(progress_bar_metrics={"val/acc": 0.5, "val/loss": 0.7})
    step_metrics = {"train/loss": torch.tensor(0.25), "train/lr": 0.1}
    # a module keeping the callbacks' contract (core/models/contract.py): its step row is what the bar shows
    module = SimpleNamespace(
        inputs=None, skipped_steps=0, step_metrics=step_metrics, log_step_metric=print, step_row=dict, sends_step_row=bool
    )
    for batch_idx in range(7):
        bar.on_train_batch_end(trainer, module, None, None, batch_idx)
    # batch 1 at 0 s; 4 at 0.5 s (0.5 after the last draw); 6 at 1.05 s; 7: the last; never refresh_rate's 2, 4, 6
    assert [n for n, _ in draws] == [1, 4, 6, 7]
    assert draws[-1][1] == "loss=0.25, val/acc=0.5"  # the shown names only, train/ dropped


def test_the_trainer_wraps_each_hook_in_a_free_context_unless_a_profiler_is_asked_for(make_cfg):
    from lightning.pytorch.profilers import SimpleProfiler
    from omegaconf import open_dict

    from {{ cookiecutter.package_name }}.core.config.instantiate import NoProfiler, instantiate_trainer

    cfg = make_cfg()
    profiler = instantiate_trainer(cfg, [], []).profiler
    assert isinstance(profiler, NoProfiler)
    with profiler.profile("[Callback]ProgressBar.on_train_batch_end") as inside:  # as Lightning's loop uses it
        assert inside is None
    with open_dict(cfg):
        cfg.trainer.profiler = "simple"  # +trainer.profiler=simple (bench/throughput.py --profile)
    assert isinstance(instantiate_trainer(cfg, [], []).profiler, SimpleProfiler)


@pytest.mark.parametrize("seconds", [-1, "often", None, True])
def test_the_progress_bar_refuses_a_refresh_time_that_is_not_a_number_of_seconds(seconds):
    with pytest.raises(ConfigError, match=r"callbacks.progress_bar.refresh_seconds=.*fix: a number of seconds >= 0"):
        ProgressBar(refresh_seconds=seconds)


def test_a_run_too_short_to_validate_says_its_test_figures_are_of_the_last_weights(make_cfg, capsys):
    metrics = train(make_cfg("trainer.max_steps=2", "callbacks.progress_bar=null"))
    assert metrics["best_checkpoint"] is None and "test/acc" in metrics
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "of the last weights" in line]
    assert "no validation during the fit saved a best checkpoint (2 optimizer steps" in line
    assert "fix: trainer.val_check_interval=" in line


def test_a_run_that_validated_tests_its_best_checkpoint_without_that_line(make_cfg, capsys):
    metrics = train(make_cfg("trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.progress_bar=null"))
    assert metrics["best_checkpoint"] and "test/acc" in metrics
    assert "of the last weights" not in capsys.readouterr().out


def test_bad_data_fails_before_any_weights_load(make_cfg, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr("{{ cookiecutter.package_name }}.core.models.base.HFModule.build_model", no_weights)
    with pytest.raises(DataError, match=r"data.text_column='review' is not a column"):
        train(make_cfg("data.text_column=review"))


@pytest.mark.parametrize("fails", [False, True], ids=["success", "failure"])
def test_each_job_closes_its_offline_wandb_run(make_cfg, tmp_path, monkeypatch, fails):
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default, not an environment setting
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_cfg("logger=wandb", "debug=fdr", *(["data.label_column=sentiment"] if fails else []))
    if fails:
        with pytest.raises(DataError):
            train(cfg)
    else:
        train(cfg)
    assert wandb.run is None  # finished, so the next job of a multirun starts its own run
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize(
    "levers",
    [
        ("activation_checkpointing=full", "attention=eager"),
        ("optimizer=adamw_8bit",),
        ("optimizer.step_in_backward=true", "trainer.gradient_clip_val=null"),
    ],
    ids=lambda levers: "+".join(levers),
)
def test_memory_levers_train_the_classifier(make_cfg, levers):
    metrics = train(make_cfg("debug=fdr", *levers))
    assert math.isfinite(metrics["train/loss"])
    assert 0.0 <= metrics["test/acc"] <= 1.0
