"""Fit a model, then test the best checkpoint.

    python -m <package>.train experiment=demo_classification
    python -m <package>.train experiment=demo_lm_lora
    python -m <package>.train experiment=demo_lm_scratch trainer.max_steps=300

Writes ``metrics.json``, ``config_tree.log`` and ``checkpoints/`` into the run directory
(``hydra.run.dir=DIR`` sets it).
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from .memory.planner import check_memory_plan
from .utils.config import config_warnings, to_plain, validate_config
from .utils.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_trainer, scalar_metrics
from .utils.run import close_loggers, print_config_tree, write_metrics


def train(cfg: DictConfig) -> dict:
    """Run fit (+ test on the best checkpoint) for a composed config; return the final metrics.

    Raises:
        ConfigError: the config is invalid (raised before any data or weights load).
        DataError: the data does not match the config (raised before any weights load).
    """
    validate_config(cfg)
    for warning in config_warnings(cfg):
        rank_zero_warn(warning)
    run_dir = Path(cfg.paths.output_dir)
    print_config_tree(cfg, save_to=run_dir / "config_tree.log")
    check_memory_plan(cfg, run_dir)
    if cfg.hardware.tf32:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls (32-true, the fp32 parts of *-mixed) on TF32 tensor cores
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.get_class(cfg.task.module)(**{group: to_plain(cfg[group]) for group in cfg.task.module_args})
    loggers = instantiate_loggers(cfg)
    trainer = instantiate_trainer(cfg, instantiate_callbacks(cfg), loggers)
    for logger in loggers:
        logger.log_hyperparams(to_plain(cfg))

    failed = True
    try:
        start = time.perf_counter()
        metrics = {}
        if cfg.task.validate_before_fit and cfg.ckpt_path is None:
            # The starting point, from the same validation loop as the final figures.
            trainer.validate(module, datamodule=datamodule)
            metrics = {f"{k}_start": v for k, v in scalar_metrics(trainer.callback_metrics).items() if k.startswith("val/")}
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        if metrics and getattr(module, "validated_at_step", None) != trainer.global_step:
            # Training stopped between validations: validate the final weights, so val/* never
            # repeats the *_start figures (or an older pass) as if it were the result.
            trainer.validate(module, datamodule=datamodule)
        metrics.update(scalar_metrics(trainer.callback_metrics))
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if cfg.test_after_fit and datamodule.has_test:
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None)
            metrics.update(scalar_metrics(trainer.callback_metrics))
        metrics.update(
            best_checkpoint=best or None,
            rows=datamodule.split_sizes,  # rows (classification) or documents (causal LM) per split
            seconds=round(time.perf_counter() - start, 1),
        )
        if hasattr(datamodule, "token_counts"):
            metrics["tokens"] = datamodule.token_counts  # real tokens per split, EOS included
        write_metrics(run_dir / "metrics.json", metrics)
        failed = False
        return metrics
    finally:
        close_loggers(loggers, failed=failed)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Console script / ``python -m`` entry; returns the monitored metric (for sweeps)."""
    return train(cfg).get(cfg.task.monitor)


if __name__ == "__main__":
    main()
