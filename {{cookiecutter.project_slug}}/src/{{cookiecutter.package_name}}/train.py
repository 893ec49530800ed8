"""Fit a model, then test the best checkpoint.

    python -m <package>.train experiment=demo_classification
    python -m <package>.train model=bert_base_uncased data=glue_sst2 precision=bf16-mixed

Writes ``metrics.json``, ``config_tree.log`` and ``checkpoints/`` into the run directory
(``hydra.run.dir=DIR`` sets it).
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig

from .utils.config import to_plain, validate_config
from .utils.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_trainer, scalar_metrics
from .utils.run import close_loggers, print_config_tree, write_metrics


def train(cfg: DictConfig) -> dict:
    """Run fit (+ test on the best checkpoint) for a composed config; return the final metrics.

    Raises:
        ConfigError: the config is invalid (raised before any data or weights load).
        DataError: the data does not match the config (raised before any weights load).
    """
    validate_config(cfg)
    run_dir = Path(cfg.paths.output_dir)
    print_config_tree(cfg, save_to=run_dir / "config_tree.log")
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.get_class(cfg.task.module)(model=to_plain(cfg.model), optimizer=to_plain(cfg.optimizer))
    loggers = instantiate_loggers(cfg)
    trainer = instantiate_trainer(cfg, instantiate_callbacks(cfg), loggers)
    for logger in loggers:
        logger.log_hyperparams(to_plain(cfg))

    failed = True
    try:
        start = time.perf_counter()
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        metrics = scalar_metrics(trainer.callback_metrics)
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if cfg.test_after_fit and datamodule.has_test:
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None)
            metrics.update(scalar_metrics(trainer.callback_metrics))
        metrics.update(
            best_checkpoint=best or None,
            rows=datamodule.split_sizes,
            seconds=round(time.perf_counter() - start, 1),
        )
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
