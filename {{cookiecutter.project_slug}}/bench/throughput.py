"""Training throughput of what ``train`` runs, against a plain PyTorch loop and the HF Trainer.

    pip install -e ".[bench]"
    python bench/throughput.py                          # both workloads, 7 interleaved repeats
    python bench/throughput.py --steps 60 --repeats 3   # a quicker look
    python bench/throughput.py --overrides data.num_workers=1 callbacks.step_checkpoint=null

Two workloads, each a BERT classifier with random weights (``model=tiny_bert`` resized) on
rows of random words from a 30,522-token WordPiece vocabulary (BERT's size), every row
truncated to the same length so that every step does the same work:

- ``pinned``: 4 layers, hidden 256, 128 tokens, micro-batch 16 (``vs_loop``, ``vs_hf_trainer``);
- ``overhead``: 2 layers, hidden 64, 32 tokens, micro-batch 8: a step so short that the fixed
  cost per step of the framework shows (``overhead_vs_loop``, ``overhead_vs_hf_trainer``).

Each is trained four ways, with the same tokenised rows, collator, optimizer, LR schedule
(linear warmup 6 %, linear decay), gradient clipping (1.0) and seed:

- ``train``: :func:`<package>.train.train` itself on the composed config (``experiment``-free
  defaults: every callback, the CSV and W&B loggers -- W&B offline --, ``log_every_n_steps: 1``,
  the step checkpoint every 50 steps, the data module's loader); ``--overrides`` changes it as
  on the command line.  A timing callback is added last.
- ``loop``: a plain PyTorch loop over a ``DataLoader`` of the data module's tokenised rows and
  collator (same ``num_workers``): forward, loss, backward, clip, step, LR, zero_grad, and the
  loss read once per step.  No logging, no checkpoints: what the framework costs is the gap.
- ``lightning``: the ceiling of any Lightning project here: the same model, loss, optimizer and
  schedule in a bare ``LightningModule`` run by a ``Trainer`` with nothing else (no callbacks
  but the timer, no logger, no checkpoint, no progress bar, no validation), over the loop's
  ``DataLoader``.  ``lightning / loop`` is what Lightning itself costs; ``train / lightning``
  what this project adds.
- ``hf_trainer``: ``transformers.Trainer`` on the same rows and collator, doing the same work as
  ``train``: logs every step to W&B (offline), saves a checkpoint on the same schedule (keeping
  one), the same ``dataloader_num_workers``.

The four run ``--repeats`` times, interleaved, the order rotated each repeat so that machine
drift and warm-up hit all alike.  Each run times its optimizer steps from the start of the
second to the end of the last (not start-up); samples/s = ``(steps - 1) x micro-batch`` over
that time.  Prints each way's median with a 95 % bootstrap interval of the median, the ratios of
medians (with paired bootstrap intervals: the repeats resampled), and as the last line
``vs_loop=<r> vs_hf_trainer=<r> overhead_vs_loop=<r> overhead_vs_hf_trainer=<r>
overhead_ceiling=<r>`` (the last: ``lightning / loop`` on the ``overhead`` workload, the best
``overhead_vs_loop`` a Lightning project can reach).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict
from torch.utils.data import DataLoader
from transformers import BertTokenizerFast, Trainer, TrainerCallback, TrainingArguments

from {{ cookiecutter.package_name }}.core.callbacks import lr_factor
from {{ cookiecutter.package_name }}.core.models.inputs import ModelInputs
from {{ cookiecutter.package_name }}.core.optim import build_optimizer, lightning_allows_fused
from {{ cookiecutter.package_name }}.core.task import build_module
from {{ cookiecutter.package_name }}.train import train

WORKLOADS = {
    "pinned": {"layers": 4, "hidden": 256, "seq_len": 128, "micro_batch": 16},
    "overhead": {"layers": 2, "hidden": 64, "seq_len": 32, "micro_batch": 8},
}
VOCAB_SIZE = 30522  # bert-base-uncased's
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class StepTimer(L.Callback):
    """Seconds from the start of optimizer step 1 to the end of training (the last step and its
    checkpoint included); the latest run's figure is kept on the class (``train`` builds the
    instance from the config)."""

    seconds: float | None = None
    durations: dict[str, list[float]] = {}  # the profiler's, with ``--profile``
    steps = 0

    def on_fit_start(self, trainer, pl_module):
        StepTimer.durations = {}
        if getattr(trainer.profiler, "recorded_durations", None) is not None:  # --profile: time the loggers too
            for logger in trainer.loggers:
                for method in ("log_metrics", "save"):
                    setattr(logger, method, timed(getattr(logger, method), f"[Logger]{type(logger).__name__}.{method}"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        StepTimer.seconds = time.perf_counter() - self.start
        StepTimer.steps = trainer.global_step
        StepTimer.durations.update(getattr(trainer.profiler, "recorded_durations", None) or {})


def timed(method, name: str):
    """``method``, its call times (s) recorded in ``StepTimer.durations[name]``; a call made
    inside another timed call (a logger's ``save`` inside its ``log_metrics``) is not recorded
    again (its time is in the outer one)."""

    def call(*args, **kwargs):
        if timed.depth:
            return method(*args, **kwargs)
        timed.depth += 1
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timed.depth -= 1
            StepTimer.durations.setdefault(name, []).append(time.perf_counter() - start)

    return call


timed.depth = 0


class HFStepTimer(TrainerCallback):
    """The same window for ``transformers.Trainer`` (its save at the last step included)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def write_data(folder: Path, rows: int, seq_len: int) -> dict[str, Path]:
    """A WordPiece tokenizer of ``VOCAB_SIZE`` made-up words, and train/validation CSVs of rows
    of ``seq_len`` random words (each word one token: every row is ``seq_len`` tokens after
    truncation to ``seq_len``) with random labels ``a``/``b``."""
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS))]
    tokenizer_dir = folder / "tokenizer"
    BertTokenizerFast(vocab={t: i for i, t in enumerate(SPECIALS + words)}).save_pretrained(tokenizer_dir)
    rng = random.Random(0)
    paths = {}
    for split, count in (("train", rows), ("validation", 32)):
        lines = ["text,label"] + [" ".join(rng.choices(words, k=seq_len)) + "," + rng.choice("ab") for _ in range(count)]
        paths[split] = folder / f"{split}.csv"
        paths[split].write_text("\n".join(lines) + "\n")
    paths["tokenizer"] = tokenizer_dir
    return paths


def compose_train_config(workload: dict, data: dict[str, Path], steps: int, run_dir: Path, overrides: list[str]):
    """The ``train`` config a user would run on these files: defaults, the model resized."""
    hidden = workload["hidden"]
    with initialize_config_module(version_base="1.3", config_module="{{ cookiecutter.package_name }}.configs"):
        cfg = compose(
            config_name="train",
            overrides=[
                "task=classification",
                "model=tiny_bert",
                f"model.tokenizer={data['tokenizer']}",
                f"model.config.hidden_size={hidden}",
                f"model.config.num_hidden_layers={workload['layers']}",
                f"model.config.num_attention_heads={max(2, hidden // 64)}",
                f"model.config.intermediate_size={4 * hidden}",
                "data=local_files",
                f"data.splits.train={data['train']}",
                f"data.splits.validation={data['validation']}",
                f"data.max_length={workload['seq_len']}",
                f"batch.global_batch_size={workload['micro_batch']}",
                f"batch.micro_batch_size={workload['micro_batch']}",
                f"trainer.max_steps={steps}",
                f"paths.output_dir={run_dir}",
                f"paths.cache_dir={run_dir.parent / 'cache'}",
                *overrides,
            ],
        )
    with open_dict(cfg):
        cfg.callbacks.bench_step_timer = {"_target_": "__main__.StepTimer"}
    return cfg


def run_train(cfg) -> float:
    """``train(cfg)`` (its console output swallowed); seconds of steps 1..N."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg)
    return StepTimer.seconds


def prepared_data(cfg):
    """The data module of ``cfg``, set up for fit (its tokenised rows, collator, labels, tokenizer)."""
    import hydra

    datamodule = hydra.utils.instantiate(cfg.data)
    with contextlib.redirect_stderr(io.StringIO()):
        datamodule.prepare_data()
        datamodule.setup("fit")
    return datamodule


def plain_model(cfg, datamodule) -> torch.nn.Module:
    """The Hugging Face model alone, from the project's own builder (the same weights for a seed)."""
    module = build_module(cfg)
    module.connect(ModelInputs.of(datamodule, "32-true"))
    return module.build_model("32-true")


def model_and_optimizer(cfg, datamodule, device: torch.device):
    """The model ``train`` builds (random weights, seeded) and its optimizer."""
    torch.manual_seed(cfg.seed)
    model = plain_model(cfg, datamodule).to(device).train()
    fused = lightning_allows_fused(cfg.trainer.precision, cfg.trainer.gradient_clip_val)  # as train decides
    optimizer_cfg = OmegaConf.to_container(cfg.optimizer, resolve=True)
    return model, build_optimizer(model, optimizer_cfg, device.type, fused_allowed=fused)


def lr_schedule(optimizer: torch.optim.Optimizer, cfg, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(cfg.lr_schedule.warmup_ratio * steps)
    args = (steps, warmup, cfg.lr_schedule.decay, cfg.lr_schedule.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, *args))


def run_loop(cfg, prepared, steps: int) -> float:
    """The plain loop (see the module docstring); seconds of steps 1..N."""
    rows, collator, workers = prepared.datasets["train"], prepared.collator(), cfg.data.num_workers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer = model_and_optimizer(cfg, prepared, device)
    scheduler = lr_schedule(optimizer, cfg, steps)
    bf16 = cfg.trainer.precision == "bf16-mixed"
    loader = DataLoader(rows, batch_size=cfg.data.batch_size, shuffle=True, collate_fn=collator, num_workers=workers)
    start = None
    for step, batch in enumerate(loader):
        if step == steps:
            break
        if step == 1:
            start = time.perf_counter()  # step 0 pays one-off allocations in every way
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # read once per step, as the others log it
    return time.perf_counter() - start


class BareModule(L.LightningModule):
    """The ``lightning`` way: the model and its loss, the optimizer and the per-step LR schedule, nothing else."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        super().__init__()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def training_step(self, batch, batch_idx):
        labels = batch.pop("labels")
        return F.cross_entropy(self.model(**batch).logits.float(), labels)

    def configure_optimizers(self):
        return {"optimizer": self.optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}


def run_lightning(cfg, prepared, steps: int) -> float:
    """The bare Lightning run (see the module docstring); seconds of steps 1..N."""
    rows, collator, workers = prepared.datasets["train"], prepared.collator(), cfg.data.num_workers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer = model_and_optimizer(cfg, prepared, device)
    module = BareModule(model, optimizer, lr_schedule(optimizer, cfg, steps))
    loader = DataLoader(rows, batch_size=cfg.data.batch_size, shuffle=True, collate_fn=collator, num_workers=workers)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        max_steps=steps,
        precision=cfg.trainer.precision,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[StepTimer()],
        default_root_dir=str(Path(tempfile.gettempdir()) / "bench_bare_lightning"),
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit(module, train_dataloaders=loader)
    return StepTimer.seconds


def run_hf_trainer(cfg, prepared, steps: int, run_dir: Path) -> float:
    """``transformers.Trainer`` with the same work as ``train``; seconds of steps 1..N."""
    rows, collator, workers = prepared.datasets["train"], prepared.collator(), cfg.data.num_workers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer = model_and_optimizer(cfg, prepared, device)
    timer = HFStepTimer()
    every = cfg.callbacks.step_checkpoint.every_n_train_steps if cfg.callbacks.get("step_checkpoint") else None
    arguments = TrainingArguments(
        output_dir=str(run_dir / "hf"),
        per_device_train_batch_size=cfg.data.batch_size,
        max_steps=steps,
        max_grad_norm=cfg.trainer.gradient_clip_val,
        eval_strategy="no",
        save_strategy="steps" if every else "no",
        save_steps=every or 500,
        save_total_limit=1,
        logging_steps=1,
        report_to=["wandb"] if cfg.get("logger") and cfg.logger.get("wandb") else [],
        dataloader_num_workers=workers,
        bf16=cfg.trainer.precision == "bf16-mixed",
        seed=cfg.seed,
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=rows,
        data_collator=collator,
        optimizers=(optimizer, lr_schedule(optimizer, cfg, steps)),
        callbacks=[timer],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    if "wandb" in arguments.report_to:
        import wandb

        wandb.finish()
    return timer.seconds


def bootstrap_interval(values: list[float], statistic, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of ``statistic(resample)`` over ``draws`` resamples."""
    rng = random.Random(seed)
    estimates = sorted(statistic([rng.choice(values) for _ in values]) for _ in range(draws))
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws) - 1]


def ratio_interval(a: list[float], b: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of ``median(a) / median(b)``, resampling the repeats (paired: ``a[i]``
    and ``b[i]`` ran in the same repeat, side by side, so they share its machine state)."""
    rng = random.Random(seed)
    estimates = []
    for _ in range(draws):
        picks = [rng.randrange(len(a)) for _ in a]
        estimates.append(statistics.median(a[i] for i in picks) / statistics.median(b[i] for i in picks))
    estimates.sort()
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws) - 1]


def measure(name: str, workload: dict, args: argparse.Namespace, folder: Path) -> dict[str, list[float]]:
    """samples/s of each way, ``args.repeats`` interleaved runs."""
    steps = args.steps[name] if isinstance(args.steps, dict) else args.steps
    data = write_data(folder / name, (steps + 2) * workload["micro_batch"], workload["seq_len"])
    samples: dict[str, list[float]] = {"train": [], "loop": [], "lightning": [], "hf_trainer": []}
    for repeat in range(args.repeats):
        run_dir = folder / name / f"run{repeat}"
        cfg = compose_train_config(workload, data, steps, run_dir, args.overrides)
        if repeat == 0 and cfg.hardware.tf32:
            torch.set_float32_matmul_precision("high")  # what train sets: the same for all three
        prepared = prepared_data(cfg)
        ways = {
            "train": lambda: run_train(cfg),
            "loop": lambda: run_loop(cfg, prepared, steps),
            "lightning": lambda: run_lightning(cfg, prepared, steps),
            "hf_trainer": lambda: run_hf_trainer(cfg, prepared, steps, run_dir),
        }
        order = list(ways)[repeat % len(ways) :] + list(ways)[: repeat % len(ways)]
        for way in order:
            seconds = ways[way]()
            samples[way].append((steps - 1) * workload["micro_batch"] / seconds)
        print(f"{name} repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()), flush=True)
    return samples


def report(name: str, workload: dict, samples: dict[str, list[float]], steps: int) -> dict[str, float]:
    """Print the workload's table; return ``{"vs_loop": r, "vs_hf_trainer": r, "ceiling": r}``
    (ratios of medians; ``ceiling``: lightning / loop)."""
    print(
        f"\n{name}: {workload['layers']}-layer BERT, hidden {workload['hidden']}, {workload['seq_len']} tokens, "
        f"micro-batch {workload['micro_batch']}, {steps} steps, {len(samples['train'])} repeats"
    )
    for way, values in samples.items():
        low, high = bootstrap_interval(values, statistics.median)
        print(f"  {way:>10}: {statistics.median(values):8.2f} samples/s (95% CI {low:.2f}-{high:.2f})")
    ratios = {}
    for other in ("loop", "hf_trainer"):
        ratio = statistics.median(samples["train"]) / statistics.median(samples[other])
        low, high = ratio_interval(samples["train"], samples[other])
        print(f"  train / {other}: {ratio:.3f} (95% CI {low:.3f}-{high:.3f})")
        ratios[f"vs_{other}"] = ratio
    for way, other, key in (("lightning", "loop", "ceiling"), ("train", "lightning", "vs_lightning")):
        ratios[key] = statistics.median(samples[way]) / statistics.median(samples[other])
        low, high = ratio_interval(samples[way], samples[other])
        print(f"  {way} / {other}: {ratios[key]:.3f} (95% CI {low:.3f}-{high:.3f})")
    return ratios


# What the per-step cost table draws from Lightning's simple profiler (action names of Lightning 2.6).
LOOP_PARTS = {
    "forward + loss (training_step)": "[Strategy]SingleDeviceStrategy.training_step",
    "backward": "[Strategy]SingleDeviceStrategy.backward",
    "gradient clipping": "configure_gradient_clipping",
    "data loading (next batch)": "[_TrainingEpochLoop].train_dataloader_next",
    "batch to device": "[Strategy]SingleDeviceStrategy.batch_to_device",
    "zero_grad": "optimizer_zero_grad",
    "checkpoint saves": "save_checkpoint",
}


def cost_table(durations: dict[str, list[float]], steps: int, seconds_per_step: float) -> list[tuple[str, float]]:
    """Milliseconds per optimizer step of each part of a profiled run, as ``(label, ms)``:
    the loop's parts (:data:`LOOP_PARTS`), the module's hooks, each callback (all its hooks
    together, less the checkpoint saves made inside them), each logger (``log_metrics`` and
    ``save``, each call counted once), the optimizer's update
    (``optimizer_step`` less what runs inside it) and the rest (Lightning's loop, its logging
    connector) as the difference to the measured time per step."""

    def ms(*names: str) -> float:
        return 1000 * sum(sum(durations[k]) for k in names if k in durations) / steps

    def keys(predicate) -> list[str]:
        return [k for k in durations if predicate(k)]

    rows = [(label, ms(*keys(lambda k, n=name: n in k))) for label, name in LOOP_PARTS.items() if label != "checkpoint saves"]
    module_hooks = keys(lambda k: k.startswith("[LightningModule]") and k.endswith(".on_before_optimizer_step"))
    rows.append(("module: on_before_optimizer_step (loss normalisation, train/loss)", ms(*module_hooks)))
    saves = ms("save_checkpoint")
    callbacks = sorted({k.split(".")[0][len("[Callback]") :] for k in durations if k.startswith("[Callback]")})
    for name in callbacks:
        hooks = keys(lambda k, n=name: k.startswith(f"[Callback]{n}.") and len(durations[k]) >= steps)
        cost = ms(*hooks)
        if name.startswith("ModelCheckpoint") and "'every_n_train_steps': 0" not in name:
            rows.append(("checkpoint saves (every N steps, amortised)", saves))
            cost = max(0.0, cost - saves)
        if hooks:
            rows.append((f"callback {callback_label(name)}", cost))
    for key in sorted(keys(lambda k: k.startswith("[Logger]") and k.endswith(".log_metrics"))):
        name = key[len("[Logger]") : -len(".log_metrics")]
        rows.append((f"logger {name} (log_metrics, and save: writes)", ms(key, key.replace(".log_metrics", ".save"))))
    inside = ms(*keys(lambda k: any(n in k for n in ("SingleDeviceStrategy.training_step", "SingleDeviceStrategy.backward"))))
    inside += ms(*keys(lambda k: "configure_gradient_clipping" in k)) + ms(*module_hooks)
    inside += ms(*keys(lambda k: k.startswith("[Callback]") and any(h in k for h in ("before_optimizer_step", "backward"))))
    rows.append(("optimizer update (AdamW)", max(0.0, ms(*keys(lambda k: k.endswith(".optimizer_step"))) - inside)))
    listed = sum(value for _, value in rows)
    rows.append(("the rest: Lightning's loop and logging connector", max(0.0, 1000 * seconds_per_step - listed)))
    return rows


def callback_label(name: str) -> str:
    """A callback's profiler name, short: Lightning names a ModelCheckpoint by its state key
    (``ModelCheckpoint{'monitor': ..., 'every_n_train_steps': 50, ...}``)."""
    if not name.startswith("ModelCheckpoint"):
        return name
    return "ModelCheckpoint (best on the monitor)" if "'every_n_train_steps': 0" in name else "ModelCheckpoint (every N steps)"


def profile(args: argparse.Namespace) -> None:
    """``--profile``: one profiled ``train`` run of the overhead workload; print the cost table."""
    steps = args.steps if isinstance(args.steps, int) else 300
    workload = WORKLOADS["overhead"]
    with tempfile.TemporaryDirectory() as folder:
        os.environ["WANDB_DIR"] = folder
        data = write_data(Path(folder), (steps + 2) * workload["micro_batch"], workload["seq_len"])
        cfg = compose_train_config(workload, data, steps, Path(folder) / "run", ["+trainer.profiler=simple", *args.overrides])
        seconds = run_train(cfg)
    per_step = seconds / (steps - 1)
    print(f"\nper optimizer step, overhead workload, {steps} steps, Lightning simple profiler: {1000 * per_step:.2f} ms\n")
    print("| part | ms / step |\n|---|---|")
    for label, value in cost_table(StepTimer.durations, StepTimer.steps or steps, per_step):
        print(f"| {label} | {value:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: pinned 100, overhead 300)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved runs of each way")
    parser.add_argument("--overrides", nargs="*", default=[], help="train overrides (key=value), as on the command line")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS), help="(the last line needs both)")
    parser.add_argument("--profile", action="store_true", help="instead: the per-step cost table of one profiled train run")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = {"pinned": 100, "overhead": 300}
    elif args.steps < 3:
        parser.error(f"--steps={args.steps}: at least 3 (step 0 is not timed); fix: --steps 3 or more")

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="bench")  # before wandb reads its settings
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning.pytorch", "lightning.fabric", "transformers", "datasets", "wandb"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"{device}; train overrides: {' '.join(args.overrides) or '(none)'}", flush=True)
    if args.profile:
        profile(args)
        return
    ratios = {}
    with tempfile.TemporaryDirectory() as folder:
        os.environ["WANDB_DIR"] = folder  # (the HF Trainer's runs; train's go to their run folders)
        for name in args.workloads:
            samples = measure(name, WORKLOADS[name], args, Path(folder))
            steps = args.steps[name] if isinstance(args.steps, dict) else args.steps
            ratios[name] = report(name, WORKLOADS[name], samples, steps)
    if len(ratios) < len(WORKLOADS):
        return
    pinned, overhead = ratios["pinned"], ratios["overhead"]
    print(
        f"vs_loop={pinned['vs_loop']:.3f} vs_hf_trainer={pinned['vs_hf_trainer']:.3f} "
        f"overhead_vs_loop={overhead['vs_loop']:.3f} overhead_vs_hf_trainer={overhead['vs_hf_trainer']:.3f} "
        f"overhead_ceiling={overhead['ceiling']:.3f}",
        file=sys.stdout,
    )


if __name__ == "__main__":
    main()
