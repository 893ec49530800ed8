"""Evaluate a checkpoint on the test split of the configured data.

    python -m <package>.eval experiment=demo_classification ckpt_path=RUN/checkpoints/last.ckpt
    python -m <package>.eval experiment=demo_sft_sentiment model_dir=models/sft   # an exported folder
    python -m <package>.eval ckpt_path=RUN/checkpoints/last.ckpt benchmarks.tasks=[arc_easy]   # lm-eval tasks (causal LMs)

Model, labels and tokenizer come from the checkpoint (or folder), and so do the settings that shape what the model sees
(``data.max_length``...; the command line may give others); the data files from the config (use training's
``experiment=``/``data=``). Writes ``metrics.json`` (chat answers: ``predictions.jsonl``); exits 1 on bad config or data.
With ``benchmarks.tasks`` (causal LMs), lm-evaluation-harness tasks instead of the test split: ``benchmarks.json`` too."""

from __future__ import annotations

from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig

from .core.checkpoints.io import data_kwargs, load_trained_module, trained_checkpoint
from .core.config.instantiate import instantiate_loggers, instantiate_trainer, scalar_metrics
from .core.config.resolvers import to_plain
from .core.errors import ConfigError
from .core.models.inputs import ConnectData
from .core.run.entry import close_loggers, exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main, print_config_tree, write_metrics
from .core.run.outputs import claim_outputs
from .core.task import build_module, module_class
from .tasks import check_config, task_of, tasks


def full_precision_overrides(hparams: dict) -> dict:
    """Module arguments that load a checkpoint as full-precision weights (``export``, ``quantize``): QLoRA as LoRA
    on the unquantized base, QAT without fake quantisation; ``{}`` otherwise."""
    overrides = {}
    if (hparams.get("peft") or {}).get("method") == "qlora":
        overrides["peft"] = {**hparams["peft"], "method": "lora"}
    if (hparams.get("qat") or {}).get("scheme", "none") != "none":
        overrides["qat"] = {**hparams["qat"], "scheme": "none"}
    return overrides


def exported_folder_problem(cfg: DictConfig) -> None:
    """Check that ``model_dir`` is an ``export`` folder, for a task that reads them.

    Raises:
        ConfigError: naming ``model_dir`` and the fix.
    """
    task = task_of(cfg)
    if not task.reads_exported_folders:
        raise ConfigError(
            f"model_dir={cfg.model_dir!r}: task={task.name} is evaluated from its checkpoint; fix: ckpt_path=RUN/checkpoints/last.ckpt"
        )
    if not Path(cfg.model_dir, "config.json").is_file():
        raise ConfigError(
            f"model_dir={cfg.model_dir!r} is not a folder written by export (no config.json); fix: ckpt_path=RUN/checkpoints/last.ckpt"
        )


def load_module(cfg: DictConfig) -> L.LightningModule:
    """The task module of ``cfg.ckpt_path``, or (causal LM) one loading the exported folder ``cfg.model_dir``.

    Raises:
        ConfigError: a ``model_dir`` without ``config.json``, or for a task that reads no exported folders.
    """
    if cfg.ckpt_path is not None:  # (the user's config names the class, never the checkpoint)
        return load_trained_module(module_class(cfg), cfg, cfg.ckpt_path)
    exported_folder_problem(cfg)
    model = {**to_plain(cfg.model), "name_or_path": str(cfg.model_dir), "tokenizer": str(cfg.model_dir), "config": None, "fetch": None}
    return build_module(cfg, model=model, peft={"method": "none"})  # (export merged the adapters)


def evaluate(cfg: DictConfig) -> dict:
    """Test ``cfg.ckpt_path`` on ``cfg.data``'s test split; return the metrics.

    Raises:
        ConfigError: invalid config, a missing or refused checkpoint, or an existing output without ``overwrite=true``.
        DataError: bad test data.
    """
    check_config(cfg, resumes=False)
    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        raise ConfigError("give exactly one of ckpt_path=RUN/checkpoints/last.ckpt or model_dir=<folder written by export>")
    run_dir = Path(cfg.paths.output_dir)
    inputs = {"ckpt_path": cfg.ckpt_path, "model_dir": cfg.model_dir}
    claim_outputs(cfg, {}, inputs, run_files=("config_tree.log", "metrics.json", "predictions.jsonl", "benchmarks.json"))
    if (cfg.get("benchmarks") or {}).get("tasks"):  # (causal-LM projects) lm-eval tasks, checked before the model loads
        from .generate import load_generator, source_problems

        if source_problems(cfg):
            raise ConfigError(source_problems(cfg)[0])
        # The model's task, whatever the config's (no experiment= needed): a checkpoint's stored one (a name of this
        # project's tasks, nothing imported), an exported folder's (a causal LM).
        if cfg.ckpt_path is not None:
            task = task_of(trained_checkpoint(cfg.ckpt_path).get("task") or cfg)
        else:
            task = next(t for t in tasks().values() if t.reads_exported_folders)
        return benchmark(cfg, task, lambda: load_generator(cfg), run_dir)
    module = load_module(cfg)  # (a refused checkpoint stops here, before the first output)
    print_config_tree(cfg, save_to=run_dir / "config_tree.log", show=bool(cfg.get("print_config")))
    datamodule = hydra.utils.instantiate(cfg.data, **data_kwargs(cfg, module, task_of(cfg).shaping_keys))
    loggers = instantiate_loggers(cfg)
    trainer = instantiate_trainer(cfg, callbacks=[ConnectData()], loggers=loggers)  # (an exported folder's module: the data's facts)
    failed = True
    try:
        trainer.test(module, datamodule=datamodule)
        metrics = scalar_metrics(trainer.callback_metrics)
        metrics.update(task_of(cfg).after_test(module, datamodule, trainer, run_dir / "predictions.jsonl", "test", "test/exact_match"))
        metrics.update(checkpoint=str(cfg.ckpt_path or cfg.model_dir), rows=datamodule.split_sizes)
        write_metrics(run_dir / "metrics.json", metrics)
        failed = False
        return metrics
    finally:
        close_loggers(loggers, failed=failed)


def benchmark(cfg: DictConfig, task, load, run_dir: Path) -> dict:
    """``task``'s lm-eval scores of the model ``load()`` returns, logged at step 0 and written to ``metrics.json``."""
    print_config_tree(cfg, save_to=run_dir / "config_tree.log", show=bool(cfg.get("print_config")))
    metrics = {**task.benchmark(cfg, load, run_dir), "checkpoint": str(cfg.ckpt_path or cfg.model_dir)}
    loggers = instantiate_loggers(cfg)
    for logger in loggers:
        logger.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)}, step=0)
    close_loggers(loggers, failed=False)
    write_metrics(run_dir / "metrics.json", metrics)
    return metrics


@hydra_main("eval")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm("no metrics.json is written"):
        evaluate(cfg)


if __name__ == "__main__":
    main()
