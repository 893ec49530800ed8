"""Predict labels for a file of texts with a trained checkpoint.

    python -m <package>.predict experiment=demo_classification \
        ckpt_path=RUN/checkpoints/last.ckpt input=reviews.csv output=predictions.csv

The output is the input's columns plus ``predicted_label`` and one ``prob_<label>`` column per
class (probabilities summing to 1), one row per input row in the input's order; the text columns
are those of the data config.  It runs in one process whatever ``trainer`` says.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import pandas as pd
import torch
from omegaconf import DictConfig, open_dict

from .checks import validate_config
from .errors import ConfigError, DataError
from .tasks import module_class
from .utils.checkpoints import load_trained_module
from .utils.config import to_plain, world_size
from .utils.instantiate import instantiate_trainer
from .utils.outputs import claim_outputs
from .utils.run import atomic_write_path, exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main


def prediction_frame(rows: pd.DataFrame, probabilities: torch.Tensor, names: list[str]) -> pd.DataFrame:
    """The input's rows (their cells as read), then ``predicted_label`` and ``prob_<label>`` for
    each of the ``len(names)`` classes; ``probabilities`` is (N, num_labels).  The columns are
    joined at once: inserted one by one, 10,000 classes took minutes and a pandas warning each.

    Raises:
        DataError: the input already has a column of those names (it would be overwritten or doubled).
    """
    added = ["predicted_label", *(f"prob_{name}" for name in names)]
    taken = [column for column in added if column in rows.columns]
    if taken:
        raise DataError(
            f"input has column(s) {taken[:5]} that predict writes; fix: rename them in the input (its cells are copied as they are)"
        )
    predicted = pd.DataFrame({"predicted_label": [names[i] for i in probabilities.argmax(dim=-1).tolist()]}, index=rows.index)
    scores = pd.DataFrame(probabilities.float().numpy(), columns=[f"prob_{name}" for name in names], index=rows.index)
    return pd.concat([rows, predicted, scores], axis=1)


def predict(cfg: DictConfig) -> Path:
    """Write predictions for ``cfg.input`` to ``cfg.output``; return the output path.

    The file is written to a temporary name and renamed, so it is never left half-written.

    Raises:
        ConfigError: invalid config, missing checkpoint/input, a refused checkpoint, an ``output``
            that is the input or a checkpoint, or that exists without ``overwrite=true``
            (:mod:`.utils.outputs`).  DataError: bad input columns.
    """
    validate_config(cfg, required=("ckpt_path", "input"), resumes=False)
    if not Path(cfg.input).is_file():  # after validate_config: input is set
        raise ConfigError(f"input={cfg.input!r} is not a file; fix: input=path/to/texts.csv (csv/tsv/jsonl/parquet)")
    if world_size(cfg) != (1, 1):
        # Several processes would each predict a share of the rows (and pad the last batches):
        # one process writes every row once, in the input's order.
        print(f"predict runs in one process: trainer.devices={world_size(cfg)[0]} (the training trainer's) is not used")
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.strategy = 1, 1, "auto"
    output = Path(cfg.output)
    claim_outputs(cfg, {"output": output}, {"input": cfg.input, "ckpt_path": cfg.ckpt_path}, run_files=())
    module = load_trained_module(module_class(cfg), cfg, cfg.ckpt_path)
    # Resolved first, so that dropping the training-data download (fetch=None) cannot break
    # paths that interpolate from it.
    datamodule = hydra.utils.instantiate(
        to_plain(cfg.data), tokenizer=module.tokenizer, label2id=module.label2id, predict_file=str(cfg.input), fetch=None
    )
    trainer = instantiate_trainer(cfg, callbacks=[], loggers=[])
    probabilities = torch.cat(trainer.predict(module, datamodule=datamodule))  # (N, num_labels)

    names = [module.inputs.id2label[i] for i in range(probabilities.shape[1])]
    frame = prediction_frame(datamodule.predict_rows.to_pandas(), probabilities, names)

    with atomic_write_path(output) as partial:
        frame.to_csv(partial, index=False)
    print(f"Predictions: {output} ({len(frame)} rows)")
    return output


@hydra_main("predict")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm("no predictions file is written"):
        predict(cfg)


if __name__ == "__main__":
    main()
