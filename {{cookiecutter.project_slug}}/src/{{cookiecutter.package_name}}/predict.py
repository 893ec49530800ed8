"""Predict with a trained checkpoint: a file of rows in, the task's predictions out.

    python -m <package>.predict experiment=demo_classification \
        ckpt_path=RUN/checkpoints/last.ckpt input=reviews.csv output=predictions.csv

The task writes the file (``Task.write_predictions``): sequence classification a CSV of the input's columns plus
``predicted_label`` and a ``prob_<label>`` per class; token classification a jsonl of words and tags; a reward model a
jsonl of the rows and each one's ``reward``. One row per
input row, in order, from one process whatever ``trainer`` says; exits 1 on bad config or data."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

from .core.checkpoints.io import data_kwargs, load_trained_module
from .core.config.instantiate import instantiate_trainer
from .core.config.resolvers import to_plain, world_size
from .core.errors import ConfigError
from .core.run.entry import atomic_write_path, exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main
from .core.run.outputs import claim_outputs
from .core.task import module_class
from .tasks import check_config


def output_path(cfg: DictConfig, suffix: str) -> Path:
    """``cfg.output``, or ``<paths.output_dir>/predictions<suffix>`` when it is null.

    Raises:
        ConfigError: an ``output`` of another file type than the task writes (``suffix``).
    """
    if cfg.output is None:
        return Path(cfg.paths.output_dir) / f"predictions{suffix}"
    output = Path(cfg.output)
    if output.suffix.lower() != suffix:
        raise ConfigError(
            f"output={str(cfg.output)!r}: task={cfg.task.name} writes a {suffix} file; fix: output={output.with_suffix(suffix)}"
        )
    return output


def predict(cfg: DictConfig) -> Path:
    """Write predictions for ``cfg.input`` to ``cfg.output`` (atomically); return the output path.

    Raises:
        ConfigError: invalid config, a missing or refused checkpoint/input, an ``output`` that is an input, exists
            without ``overwrite=true`` or has another file type than the task writes, or a task without predictions.
        DataError: bad input columns.
    """
    task = check_config(cfg, required=("ckpt_path", "input"), resumes=False)
    if not task.prediction_suffix:
        raise ConfigError(f"task={task.name} writes no predictions file; fix: eval for its metrics (a causal LM: generate for its text)")
    if not Path(cfg.input).is_file():  # after validate_config: input is set
        raise ConfigError(f"input={cfg.input!r} is not a file; fix: input=path/to/texts.csv (csv/tsv/jsonl/parquet)")
    if world_size(cfg) != (1, 1):
        # One process writes every row once, in order (several would each pad their share).
        print(f"predict runs in one process: trainer.devices={world_size(cfg)[0]} (the training trainer's) is not used")
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.strategy = 1, 1, "auto"
    output = output_path(cfg, task.prediction_suffix)
    claim_outputs(cfg, {"output": output}, {"input": cfg.input, "ckpt_path": cfg.ckpt_path}, run_files=())
    module = load_trained_module(module_class(cfg), cfg, cfg.ckpt_path)
    # Resolved first, so dropping the training-data download (fetch=None) cannot break paths interpolated from it.
    datamodule = hydra.utils.instantiate(
        to_plain(cfg.data), **data_kwargs(cfg, module, task.shaping_keys), predict_file=str(cfg.input), fetch=None
    )
    trainer = instantiate_trainer(cfg, callbacks=[], loggers=[])
    outputs = trainer.predict(module, datamodule=datamodule)

    with atomic_write_path(output) as partial:
        rows = task.write_predictions(module, datamodule, outputs, partial)
    print(f"Predictions: {output} ({rows} rows)")
    return output


@hydra_main("predict")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm("no predictions file is written"):
        predict(cfg)


if __name__ == "__main__":
    main()
