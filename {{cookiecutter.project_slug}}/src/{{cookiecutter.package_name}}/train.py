"""Fit a model, then test the best checkpoint.

    python -m <package>.train experiment=demo_classification   # or experiment=demo_lm_lora
    python -m <package>.train experiment=demo_lm_scratch trainer.max_steps=300

Writes ``metrics.json``, ``config_tree.log``, ``identity.json`` and ``checkpoints/`` into the run directory
(``hydra.run.dir=DIR``); ``ckpt_path=last`` there resumes exactly where ``last.ckpt`` left off, with the same
config, data and model (``resume.allow_changed=[key,...]``). In a multirun a failed job is a failed trial.

Exit codes: 0 done; 1 bad config or data (the message names the field and the fix); 3 CUDA out of memory
(``oom_report.txt``); 4 non-finite loss; 5 disk full during a checkpoint write; 128 + N stopped by signal N
(130 Ctrl-C, 143 SIGTERM, 138 SIGUSR1), with ``last.ckpt`` saved."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from .core.callbacks.build import instantiate_callbacks
from .core.callbacks.guards import EXIT_OUT_OF_MEMORY, OutOfMemoryGuard, StopOnSignal, signals_stop_the_run
from .core.callbacks.pruning import Pruning
from .core.callbacks.run_identity import RunIdentity
from .core.callbacks.step_time import StepTimeCheck
from .core.callbacks.terminal import RunHeader, print_results
from .core.checkpoints.io import best_checkpoint, flush_checkpoints, last_checkpoint, save_final_checkpoint, trained_checkpoint
from .core.config.instantiate import instantiate_loggers, instantiate_trainer, scalar_metrics
from .core.config.resolvers import to_plain, world_size
from .core.config.validate import config_warnings
from .core.errors import EXIT_DISK_FULL, ConfigError, DiskFull, RunStopped
from .core.identity.fingerprint import check_resume_config
from .core.memory.modes import predicted_step_ms
from .core.memory.oom import write_oom_report
from .core.memory.planner import check_memory_plan
from .core.memory.steptime import has_peaks
from .core.models.inputs import ConnectData
from .core.models.precision import precision_is_auto
from .core.run.distributed import ddp_child_argv, ddp_job_env, finish_ranks, rank_exit_code
from .core.run.entry import close_loggers, exit_on_bad_input, hydra_main, print_config_tree, save_run_config, write_metrics
from .core.run.folder import owned_run_folder
from .core.run.hub import hub_problems
from .core.run.secrets import mask
from .core.run.sweeps import is_multirun, objective, run_multirun_job
from .core.task import build_module
from .tasks import check_config, task_of


def train(cfg: DictConfig) -> dict:
    """Run fit (+ test on the best checkpoint) for a composed config; return the final metrics.

    Raises:
        ConfigError: an invalid config, a run folder that is not this launch's, a ``ckpt_path`` with
            nothing to resume or refused, or a resume that changes what the run is made of.
        DataError: the data does not match the config (before any weights load).
        RunStopped: a signal, CUDA out of memory or non-finite losses stopped training (``exit_code`` says which).
    """
    check_config(cfg)
    unreachable = hub_problems(cfg)  # (a Hub id on a machine that cannot fetch it: one line, not a traceback later)
    if unreachable:
        raise ConfigError("\n".join(unreachable))
    # The run folder is this launch's (its lock held) before anything is written into it.
    with owned_run_folder(cfg, last_checkpoint(cfg)) as ckpt_path:
        return fit_and_test(cfg, ckpt_path)


def fit_and_test(cfg: DictConfig, ckpt_path: Path | None) -> dict:
    """The body of :func:`train`, in a run folder this launch owns; ``ckpt_path=None``: a fresh start."""
    # Read the checkpoint once before anything loads: a damaged file or a changed config fails here, by name.
    task = task_of(cfg)
    resumed = trained_checkpoint(ckpt_path) if ckpt_path else None
    where = f"ckpt_path={str(ckpt_path)!r}"
    extended = check_resume_config(cfg, resumed, where, task.resume_refuses()) if resumed is not None else {}
    resumes_wandb_run = resumed.get("wandb_run_id") if resumed else None
    for warning in config_warnings(cfg):
        rank_zero_warn(warning)
    run_dir = Path(cfg.paths.output_dir)
    main_process = rank_zero_only.rank == 0  # the other ranks of a DDP/FSDP run write nothing of their own
    plan, predicted_ms = "planned on rank 0", None
    if main_process:
        save_run_config(cfg, run_dir)
        print_config_tree(cfg, save_to=run_dir / "config_tree.log", show=bool(cfg.get("print_config")))
        plan, memory_plan = check_memory_plan(cfg, task, run_dir, count=has_peaks(cfg.hardware))
        predicted_ms = predicted_step_ms(cfg, task, memory_plan)
    if cfg.hardware.tf32:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls (32-true, the fp32 parts of *-mixed) on TF32 tensor cores
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    module = build_module(cfg)
    module.restores_weights = ckpt_path is not None  # a resume: the checkpoint sets the weights (and a PiSSA residual)
    loggers = instantiate_loggers(cfg, resumes_wandb_run=resumes_wandb_run)
    header = RunHeader(run_dir, model_line(cfg), batch_line(cfg), plan, auto_precision=precision_is_auto(cfg))
    identity = RunIdentity(cfg, resumed, where)  # (after ConnectData: it compares the data's labels)
    timing = [StepTimeCheck(predicted_ms)] if predicted_ms else []  # (the roofline beside the measured step)
    trainer = instantiate_trainer(cfg, [ConnectData(), identity, *instantiate_callbacks(cfg), header, *timing], loggers)
    for logger in loggers:
        logger.log_hyperparams(to_plain(cfg))  # (our loggers mask secrets: core/run/secrets.py)

    stopper = next((c for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
    failed = True
    try:
        with signals_stop_the_run(stopper):  # a signal outside the fit's steps exits 128 + N too
            start = time.perf_counter()
            if cfg.task.validate_before_fit and ckpt_path is None:
                # The starting point; kept in the checkpoints (module.start_metrics) so a resumed run reports it too.
                trainer.validate(module, datamodule=datamodule, verbose=False)
                start_metrics = {
                    f"{k}_start": v for k, v in scalar_metrics(trainer.callback_metrics).items() if k.startswith(("val/", "lm_eval/"))
                }
                if cfg.test_after_fit and datamodule.has_test and main_process:  # e.g. the untuned model's answers, same prompts
                    start_metrics.update(
                        task.after_test(module, datamodule, trainer, run_dir / "predictions_start.jsonl", "test", "test/exact_match_start")
                    )
                module.start_metrics = start_metrics
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            except torch.OutOfMemoryError as error:
                guard = next((c for c in trainer.callbacks if isinstance(c, OutOfMemoryGuard)), None)
                text = write_oom_report(cfg, task, run_dir, guard.report if guard else None, error)
                raise RunStopped(text, EXIT_OUT_OF_MEMORY) from error
            # *_start, the last step's train/* metrics, train/* of the epoch, val/* of the last validation
            metrics = {**module.start_metrics, **module.final_step_metrics(), **scalar_metrics(trainer.callback_metrics)}
            step = "the final validation"  # what runs after the fit, for the message if it fails
            try:
                if cfg.task.validate_before_fit and module.validated_at_step != trainer.global_step:
                    # Stopped between validations (or a resume never validated): val/* must be the final weights'.
                    trainer.validate(module, datamodule=datamodule, verbose=False)
                    metrics.update(scalar_metrics(trainer.callback_metrics))
                step = "writing the checkpoints"
                flush_checkpoints(trainer)  # the fit's background writes are on disk before they are read
                final = save_final_checkpoint(trainer)  # last.ckpt = the weights the fit ended with
                best = best_checkpoint(trainer)
                pruning = next((c for c in trainer.callbacks if isinstance(c, Pruning)), None)
                if pruning is not None and best and final is not None:  # the pruned model, not an early best
                    best = pruning.checkpoint_to_test(best, str(final), trainer.global_step)
                tests = cfg.test_after_fit and datamodule.has_test
                tested_last = why_no_best(trainer) if tests and not best else None
                if tests:
                    step = f"the test of {best or 'the last weights'}"
                    trainer.test(module, datamodule=datamodule, ckpt_path=best or None, verbose=False)
                    metrics.update(scalar_metrics(trainer.callback_metrics))
                    if main_process:  # e.g. the tested (best) weights' answers
                        step = "the test's answers"
                        metrics.update(
                            task.after_test(module, datamodule, trainer, run_dir / "predictions.jsonl", "test", "test/exact_match")
                        )
            except RunStopped:
                raise  # (a signal or a guard stopped the run on purpose: no metrics.json, as for a stop during the fit)
            except Exception as error:
                if trainer.is_global_zero:
                    keep_after_failure(run_dir, metrics, step, error)
                raise
            metrics.update(
                best_checkpoint=best or None,
                rows=datamodule.split_sizes,  # rows (classification) or documents (causal LM) per split
                seconds=round(time.perf_counter() - start, 1),
            )
            if datamodule.token_counts is not None:
                metrics["tokens"] = datamodule.token_counts  # real tokens per split, EOS included
            if extended:  # not the uninterrupted longer run: say so where the figures are
                metrics["extended"] = {"from_step": resumed.get("global_step"), **extended}
            if trainer.is_global_zero:
                write_metrics(run_dir / "metrics.json", metrics, announce=False)
                lines = result_lines(cfg, run_dir, best or (str(final) if final else None), loggers)
                if tested_last:
                    lines.insert(0, ("test/*", f"of the last weights, not the best: {tested_last}"))
                print_results(metrics, lines)
        failed = False
        return metrics
    except DiskFull as error:
        raise RunStopped(disk_full_message(cfg, error), EXIT_DISK_FULL) from error
    finally:
        flush_checkpoints(trainer, raise_error=False)  # (before the run folder's lock is released)
        close_loggers(loggers, failed=failed)
        finish_ranks(trainer)  # DDP: rank 0 ends after the ranks it started (its own exit code, also in a sweep)


def keep_after_failure(run_dir: Path, metrics: dict, step: str, error: Exception) -> None:
    """A finished fit keeps its results when a step after it fails: ``metrics.json`` gets what was measured and
    ``after_fit_error`` (the step and the error), and the terminal says so; the caller re-raises (its exit code)."""
    metrics["after_fit_error"] = f"{step}: {type(error).__name__}: {error}"
    where = run_dir / "metrics.json"
    try:
        write_metrics(where, metrics, announce=False)
    except OSError as write_error:  # (e.g. the disk that is full)
        where = f"not written ({write_error}): {json.dumps(metrics, default=str)}"
    print(f"\nThe fit finished, then {step} failed: {type(error).__name__}: {error}\nWhat was measured: {where}", file=sys.stderr)


def model_line(cfg: DictConfig) -> str:
    """The model as the header names it: its folder or Hub id, or the architecture built from a config."""
    model = cfg.model
    if model.get("name_or_path"):
        return str(model.name_or_path)
    config = model.get("config") or {}
    return f"{config.get('model_type', 'a model')} from its config (random weights)"


def batch_line(cfg: DictConfig) -> str:
    """Global batch = micro-batch x accumulation x processes, as the header shows it."""
    batch, (devices, nodes) = cfg.batch, world_size(cfg)
    processes = f" x {devices * nodes} processes" if devices * nodes > 1 else ""
    return (
        f"global {batch.global_batch_size} = micro-batch {batch.device_batch_size} x {batch.accumulate_grad_batches} accumulated{processes}"
    )


def train_command(cfg: DictConfig, *more: str, overrides: list[str] | None = None) -> str:
    """This run's command line (``overrides``: Hydra's, by default) with ``more`` instead of its ``ckpt_path``/``hydra.run.dir``,
    each argument shell-quoted (pasted into bash/zsh, Hydra gets each as typed: braces, commas, spaces, ``$`` intact), secrets
    masked; a sweep trial's is that one run, without the sweep overrides (pasted, they would start the sweep again)."""
    if overrides is None:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    dropped = ("ckpt_path=", "hydra.run.dir=", "hparams_search=", "hydra.sweeper.", "hydra/sweeper=", "hydra.mode=", "hydra.sweep.")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
    return mask(shlex.join(["python", "-m", f"{__package__}.train", *kept, *more]))


def why_no_best(trainer: L.Trainer) -> str:
    """Why a fit left no best checkpoint to test (``test/*`` is then of the last weights)."""
    ranking = [c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
    if not ranking:
        return "no checkpoint callback keeps a best (callbacks.model_checkpoint is off)"
    return (
        f"no validation during the fit saved a best checkpoint ({trainer.global_step} optimizer steps, "
        f"trainer.val_check_interval={trainer.val_check_interval}); fix: trainer.val_check_interval=<steps> "
        "below the run's length"
    )


def result_lines(cfg: DictConfig, run_dir: Path, checkpoint: str | None, loggers: list) -> list[tuple[str, str]]:
    """Where the results are and what to run next: metrics.json, the W&B run, the checkpoint, the eval and resume commands."""
    lines = [("metrics.json", str(run_dir / "metrics.json"))]
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger.experiment is not None and logger.experiment.dir:
            run = logger.experiment  # (its dir: <save_dir>/wandb/<offline-run-...>/files)
            lines.append(("W&B", f"wandb sync {Path(run.dir).parent}" if run.offline else str(run.url)))
    if checkpoint:
        lines.append(("checkpoint", checkpoint))
        evaluate = train_command(cfg, f"ckpt_path={checkpoint}").replace(f"{__package__}.train", f"{__package__}.eval", 1)
        lines.append(("evaluate", evaluate))
    lines.append(("resume", train_command(cfg, "ckpt_path=last", f"hydra.run.dir={run_dir}")))
    return lines


def disk_full_message(cfg: DictConfig, error: DiskFull) -> str:
    """The disk-full message: bytes needed and free, the previous checkpoint intact, the resume command."""
    run_dir = Path(cfg.paths.output_dir)
    command = train_command(cfg, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    gib = 2**30
    return (
        f"Disk full: the checkpoint {error.path} needs about {error.needed / gib:.2f} GiB ({error.needed:,} bytes) and "
        f"{error.free / gib:.2f} GiB is free on its disk; the previous checkpoint there is intact.\n"
        f"fix: free at least {error.needed / gib:.2f} GiB on that disk (or move the run), then resume:\n  {mask(command)}"
    )


@hydra_main("train")
def run(cfg: DictConfig) -> float | None:
    """One Hydra job: train, return ``optimized_metric``. Alone, bad input exits 1 and a ``RunStopped`` its
    exit code; in a multirun a failure is a failed trial."""
    if is_multirun():
        job = HydraConfig.get()
        with ddp_job_env(list(job.overrides.task), job.runtime.output_dir):
            return run_multirun_job(lambda: objective(train(cfg), cfg), Path(job.runtime.output_dir))
    try:
        with exit_on_bad_input():
            return objective(train(cfg), cfg)
    except RunStopped as stop:
        print(f"\n{stop}", file=sys.stderr, flush=True)
        sys.exit(rank_exit_code(stop.exit_code, rank_zero_only.rank))


def main() -> None:
    """Console script / ``python -m`` entry; a DDP rank started for a multirun job runs that job alone."""
    child_argv = ddp_child_argv(sys.argv)
    if child_argv is not None:
        sys.argv = child_argv
    run()


if __name__ == "__main__":
    main()
