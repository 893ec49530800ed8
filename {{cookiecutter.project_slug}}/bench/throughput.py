"""Training throughput: this project's LightningModule + Trainer vs a hand-written loop vs HF Trainer.

    pip install -e ".[bench]"
    python bench/throughput.py                     # 4-layer BERT, hidden 256, seq 128, micro-batch 16
    python bench/throughput.py --steps 50 --repeats 3   # a quicker look

The same model (random init from one config, same seed), the same batches (fixed length, so
every step does the same work), the same AdamW param groups, the same warmup + linear-decay
schedule, and global-norm clipping at 1.0, trained three ways:

- ``loop``: plain PyTorch: forward, loss, backward, clip, step, schedule, zero_grad.
- ``lightning``: ``SequenceClassificationModule`` under ``lightning.Trainer`` with the project's
  default callbacks (LR schedule, LR monitor, progress bar) and logger (W&B offline); checkpoint
  saving is off, since the other two do not save.
- ``hf_trainer``: ``transformers.Trainer`` (evaluation, saving and reporting off), given the same
  optimizer and schedule.

Each way runs ``--repeats`` times, interleaved, with the order rotated each repeat (loop first,
then lightning first, then hf_trainer first, ...), so drifts in machine speed and any advantage
of running later in a warmed-up process hit all three alike.  Timing covers the training steps only (from the first to the
last step), not start-up.  Prints the median samples/s with min-max of each, then the ratios of
medians; the last line is ``vs_loop=<ratio> vs_hf_trainer=<ratio>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertTokenizer, Trainer, TrainerCallback, TrainingArguments

from {{ cookiecutter.package_name }}.callbacks import WarmupDecayLR, lr_factor
from {{ cookiecutter.package_name }}.models.builder import config_to_dict, sequence_classifier_from_dict
from {{ cookiecutter.package_name }}.models.classification import SequenceClassificationModule
from {{ cookiecutter.package_name }}.optim import build_optimizer

OPTIMIZER = {"_target_": "torch.optim.AdamW", "lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
WARMUP_RATIO = 0.06
SEED = 0


class FixedBatches(Dataset):
    """``steps * micro_batch`` rows of random token ids, all ``seq_len`` long, 2 classes."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(SEED)
        self.input_ids = torch.randint(1, vocab_size, (rows, seq_len), generator=generator)
        self.labels = torch.randint(0, 2, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": torch.ones_like(self.input_ids[index]),
            "labels": self.labels[index],
        }


def model_config(args: argparse.Namespace) -> dict:
    config = BertConfig(
        vocab_size=30522,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        num_labels=2,
        id2label={0: "a", 1: "b"},
        label2id={"a": 0, "b": 1},
    )
    return config_to_dict(config)


def fresh_model(config: dict) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return sequence_classifier_from_dict(config)


def schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(WARMUP_RATIO * steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup, "linear", 0.0))


def run_loop(config: dict, data: FixedBatches, args: argparse.Namespace) -> float:
    model = fresh_model(config).train()
    optimizer = build_optimizer(model, OPTIMIZER)
    scheduler = schedule(optimizer, args.steps)
    loader = DataLoader(data, batch_size=args.micro_batch, shuffle=True)
    start = None
    for step, batch in enumerate(loader):
        if step == 1:
            start = time.perf_counter()  # step 0 pays one-off allocations in every way
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the loss is read every step by the other two as well (progress bar / logging)
    return (args.steps - 1) * args.micro_batch / (time.perf_counter() - start)


class StepTimer(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


def run_lightning(config: dict, data: FixedBatches, tokenizer, args: argparse.Namespace, run_dir: str) -> float:
    from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar
    from lightning.pytorch.loggers import WandbLogger

    module = SequenceClassificationModule(model={"fetch": None}, optimizer=OPTIMIZER, id2label={0: "a", 1: "b"}, hf_config=config)
    torch.manual_seed(SEED)
    module.configure_model()
    module.tokenizer = tokenizer
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.steps,
        precision="32-true",
        gradient_clip_val=1.0,
        logger=WandbLogger(save_dir=run_dir, mode="offline", project="bench"),
        log_every_n_steps=10,
        callbacks=[WarmupDecayLR(WARMUP_RATIO, "linear", 0.0), LearningRateMonitor("step"), TQDMProgressBar(refresh_rate=10), timer],
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=args.micro_batch, shuffle=True))
    trainer.logger.experiment.finish()
    return (args.steps - 1) * args.micro_batch / timer.seconds


class HFStepTimer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def run_hf_trainer(config: dict, data: FixedBatches, args: argparse.Namespace, run_dir: str) -> float:
    model = fresh_model(config).train()
    optimizer = build_optimizer(model, OPTIMIZER)
    timer = HFStepTimer()
    training_args = TrainingArguments(
        output_dir=run_dir,
        per_device_train_batch_size=args.micro_batch,
        max_steps=args.steps,
        max_grad_norm=1.0,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        logging_steps=10,
        dataloader_num_workers=0,
        seed=SEED,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=data, optimizers=(optimizer, schedule(optimizer, args.steps)), callbacks=[timer]
    )
    trainer.train()
    return (args.steps - 1) * args.micro_batch / timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each way")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()

    os.environ.setdefault("WANDB_SILENT", "true")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    config = model_config(args)
    data = FixedBatches(args.steps * args.micro_batch, args.seq_len, config["vocab_size"])
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])})
    samples: dict[str, list[float]] = {"loop": [], "lightning": [], "hf_trainer": []}
    with tempfile.TemporaryDirectory() as run_dir:
        ways = {
            "loop": lambda: run_loop(config, data, args),
            "lightning": lambda: run_lightning(config, data, tokenizer, args, run_dir),
            "hf_trainer": lambda: run_hf_trainer(config, data, args, run_dir),
        }
        names = list(ways)
        for repeat in range(args.repeats):
            # Rotate who goes first: a fixed order favours whichever runs on a warmed-up process.
            for name in names[repeat % 3 :] + names[: repeat % 3]:
                samples[name].append(ways[name]())
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()), flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\n{args.layers}-layer BERT, hidden {args.hidden}, seq {args.seq_len}, micro-batch {args.micro_batch}, "
        f"{args.steps} steps, {args.repeats} repeats, fp32, {device}"
    )
    medians = {k: statistics.median(v) for k, v in samples.items()}
    for name, values in samples.items():
        print(f"{name:>11}: {medians[name]:8.2f} samples/s (min {min(values):.2f}, max {max(values):.2f})")
    print(f"vs_loop={medians['lightning'] / medians['loop']:.3f} vs_hf_trainer={medians['lightning'] / medians['hf_trainer']:.3f}")


if __name__ == "__main__":
    main()
