"""The task interface: what the framework (train, eval, predict, plan, quantize, the config
checks) asks a task, so that none of them compares a task's name.

A task is a folder ``tasks/<name>/`` whose ``__init__.py`` defines ``TASK``, an instance of a
:class:`Task` subclass; :func:`..tasks.task_of` finds it by ``task.name`` (configs/task/<name>.yaml).
Its LightningModule and data module(s) are named in that YAML file (``task.module``,
``task.datamodules``).  Methods import their heavy dependencies (transformers, the module) when
called, so reading a task to check a config costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from .config.groups import to_plain
from .models.inputs import ModelInputs


def task_folder(cls: type) -> str:
    """The task folder a class is defined in (``<package>.tasks.<name>...``): a task's one name,
    also its module's (stored in checkpoints); ``""`` outside ``tasks/``."""
    parts = cls.__module__.split(".")
    return parts[parts.index("tasks", 1) + 1] if "tasks" in parts[1:-1] else ""


class Task:
    """One task as the framework sees it.  Subclasses set the class attributes and override the
    methods whose default does not fit.

    Attributes:
        name: the task's folder, ``tasks/<name>/`` (set from it: :func:`task_folder`); the
            ``task.name`` of configs/task/<name>.yaml.
        loss_implementations: the ``loss.implementation`` values the task's module implements.
        quantize_variants: the ``quantize`` variants offered (names in
            :data:`.compress.quantization.VARIANTS`), made by default (``variants`` null);
            ``fp32`` is always one.
        latency_batch_size: rows of ``quantize``'s timed forward when ``latency.batch_size`` is null.
        quality: what ``quantize`` reports as the variants' quality, ``{metric: "max"|"min"}``.
        reads_exported_folders: ``eval``/``quantize`` accept ``model_dir=`` (a folder written by
            ``export``) besides ``ckpt_path=``.
        scores_test_split_only: ``quantize`` scores on ``data.splits.test`` (refused without it);
            otherwise on the test split when there is one, else the validation split.
        prediction_suffix: the file type ``predict`` writes (``.csv``, ``.jsonl``); ``""``: the
            task has no ``predict`` (:meth:`write_predictions`).
        identity_keys: this task's config keys (``fnmatch`` patterns over dotted keys) that are
            part of what a run is made of (:mod:`.identity.fingerprint`), besides the framework's
            (model, tokenizer, ``peft``, ``max_length``, data content...): ``model``, what the
            trained model is (its label set: e.g. the label column, the tag scheme), and
            ``data``, how its data are read (columns, format, the held-out split).  A resume
            refuses a change of either; eval, predict and export read the model's from the checkpoint.
    """

    name: ClassVar[str] = ""
    loss_implementations: ClassVar[tuple[str, ...]] = ("plain",)
    quantize_variants: ClassVar[tuple[str, ...]] = ("fp32",)
    latency_batch_size: ClassVar[int] = 32
    quality: ClassVar[dict[str, str]] = {}
    reads_exported_folders: ClassVar[bool] = False
    scores_test_split_only: ClassVar[bool] = True
    prediction_suffix: ClassVar[str] = ""
    identity_keys: ClassVar[dict[str, tuple[str, ...]]] = {"model": (), "data": ()}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = task_folder(cls)

    def resume_refuses(self) -> tuple[str, ...]:
        """The patterns of :attr:`identity_keys`, model and data together (a resume refuses both)."""
        return (*self.identity_keys.get("model", ()), *self.identity_keys.get("data", ()))

    # ------------------------------------------------------------------ config checks
    def data_problems(self, data: DictConfig) -> list[str]:
        """What is wrong with this task's ``data`` group, one line each (field, value, fix).
        The shared keys (``max_length``, ``splits``, ``val_fraction``) are checked elsewhere."""
        return []

    def config_problems(self, cfg: DictConfig) -> list[str]:
        """What is wrong with the groups only this task reads (e.g. the preference ``objective``),
        one line each (field, value, fix)."""
        return []

    # ------------------------------------------------------------------ the planner
    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """The batch the planner traces: ``(micro_batch, data.max_length)`` token ids and what
        else the task's data gives, including the targets its loss reads."""
        input_ids = torch.randint(0, vocab_size, (micro_batch, cfg.data.max_length))  # (B, T)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def planned_model(self, module: Any, cfg: DictConfig, config: Any, precision: str) -> tuple[torch.nn.Module, list[int]]:
        """The model as ``train`` builds it, from ``config`` (random fake weights) through the
        module's own builder, and the numels of the weights a QLoRA base holds in 4 bits."""
        raise NotImplementedError

    def example_loss(self, module: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar the planner differentiates: the training loss of ``batch``."""
        loss_sum, items = module.model_step(batch)
        return loss_sum / items

    def memory_advice(self, cfg: DictConfig, weights_dominate: bool) -> tuple[dict[str, dict], list[str]]:
        """Levers of this task for a run that does not fit: ``({advice: {key: value}}`` the
        planner tries at micro-batch 1, ``[advice]`` it cannot try itself)."""
        return {}, []

    # ------------------------------------------------------------------ after the fit
    def after_test(self, module: Any, datamodule: Any, trainer: Any, predictions: Path, split: str, key: str) -> dict:
        """Metrics beyond the test loop's, computed on the main process after a test pass
        (chat data: the greedy answers' exact match, written to ``predictions``)."""
        return {}

    # ------------------------------------------------------------------ predict
    def write_predictions(self, module: Any, datamodule: Any, outputs: list, path: Path) -> int:
        """Write ``predict``'s file to ``path`` (a temporary name, renamed when this returns) and
        return its number of rows: one per row of ``datamodule.predict_rows``, in their order, the
        input's cells as read.  ``outputs``: what ``module.predict_step`` returned per batch.

        Raises:
            DataError: the input cannot be written back as it was read (e.g. a column of the name
                a prediction takes).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ quantize
    def timing_inputs(self, input_ids: torch.Tensor, sample: dict[str, torch.Tensor]) -> dict[str, object]:
        """The timed inputs for ``input_ids`` (B, T), every position real; ``sample``: a batch of
        the task's data (for the other inputs it carries)."""
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def score(self, forward: Callable[[dict], torch.Tensor], loader: Any, device: str, datamodule: Any) -> dict[str, float]:
        """The quality metrics (:attr:`quality`) of ``forward`` over ``loader``, one of the
        evaluation loaders of ``datamodule`` (set up: its labels are mapped)."""
        raise NotImplementedError


def to_device(inputs: dict[str, object], device: str) -> dict[str, object]:
    """``inputs`` with each tensor moved to ``device`` (flags such as ``use_cache`` kept as they are)."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def module_class(cfg: DictConfig) -> type[L.LightningModule]:
    """The task's LightningModule class, as the user's config names it (``task.module``; never a
    checkpoint's)."""
    return hydra.utils.get_class(cfg.task.module)


def build_module(cfg: DictConfig, **replace: dict) -> L.LightningModule:
    """The task module of a config, as train, plan and eval build it: the class of ``task.module``
    with each group of ``task.module_args`` as a plain dict (``replace``: groups given instead),
    handed the facts the config gives before any data is read (:meth:`.models.inputs.ModelInputs.before_data`:
    ``trainer.precision``, ``data.max_length``, ``data.batch_size``); the data's follow when it is
    set up (:class:`.models.inputs.ConnectData`)."""
    args = {group: to_plain(cfg[group]) for group in cfg.task.module_args}
    module = module_class(cfg)(**{**args, **replace})
    data = cfg.get("data") or {}
    module.connect(ModelInputs.before_data(str(cfg.trainer.precision), data.get("max_length"), int(data.get("batch_size") or 1)))
    return module
