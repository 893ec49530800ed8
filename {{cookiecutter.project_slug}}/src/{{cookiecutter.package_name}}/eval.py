"""Evaluate a checkpoint on the test split of the configured data.

    python -m <package>.eval experiment=demo_classification ckpt_path=RUN/checkpoints/last.ckpt

Works for every task (classification: test/acc, test/f1_macro; causal LM: test/loss, test/ppl).
The model architecture, label mapping and tokenizer come from the checkpoint; the data from
the config (use the same ``experiment=``/``data=`` as in training).  Writes ``metrics.json``.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from .utils.config import validate_config
from .utils.instantiate import instantiate_loggers, instantiate_trainer, scalar_metrics
from .utils.run import close_loggers, exit_on_bad_input, print_config_tree, write_metrics


def evaluate(cfg: DictConfig) -> dict:
    """Test ``cfg.ckpt_path`` on ``cfg.data``'s test split; return the metrics.

    Raises:
        ConfigError: invalid config or missing checkpoint.  DataError: bad test data.
    """
    validate_config(cfg, required=("ckpt_path",))
    run_dir = Path(cfg.paths.output_dir)
    print_config_tree(cfg, save_to=run_dir / "config_tree.log")
    module = hydra.utils.get_class(cfg.task.module).load_from_checkpoint(cfg.ckpt_path, map_location="cpu")
    datamodule = hydra.utils.instantiate(cfg.data, **module.datamodule_kwargs())
    loggers = instantiate_loggers(cfg)
    trainer = instantiate_trainer(cfg, callbacks=[], loggers=loggers)
    failed = True
    try:
        trainer.test(module, datamodule=datamodule)
        metrics = scalar_metrics(trainer.callback_metrics)
        metrics.update(checkpoint=str(cfg.ckpt_path), rows=datamodule.split_sizes)
        write_metrics(run_dir / "metrics.json", metrics)
        failed = False
        return metrics
    finally:
        close_loggers(loggers, failed=failed)


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input():
        evaluate(cfg)


if __name__ == "__main__":
    main()
