"""The task interface: what the framework asks a task, so that none of it compares a task's name.

A task is a folder ``tasks/<name>/`` whose ``__init__.py`` defines ``TASK``, a :class:`Task`; its module and data
modules are named in configs/task/<name>.yaml.  Methods import heavy dependencies when called, so config checks are cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from .config.resolvers import to_plain
from .errors import ConfigError
from .models.inputs import ModelInputs


def task_folder(cls: type) -> str:
    """The task folder a class is defined in (``<package>.tasks.<name>...``), the task's one name; ``""`` outside."""
    parts = cls.__module__.split(".")
    return parts[parts.index("tasks", 1) + 1] if "tasks" in parts[1:-1] else ""


class Task:
    """One task as the framework sees it: subclasses set the class attributes and override what does not fit.

    Attributes:
        name: the task's folder, ``tasks/<name>/`` (set from it).
        quantize_variants: the ``quantize`` variants made by default (``fp32`` is always one).
        latency_batch_size: rows of ``quantize``'s timed forward when ``latency.batch_size`` is null.
        quality: what ``quantize`` reports as the variants' quality, ``{metric: "max"|"min"}``.
        reads_exported_folders: ``eval``/``quantize`` accept ``model_dir=`` (an ``export`` folder).
        export_formats: the ``export`` formats this task's checkpoints are written in (``format=``); ``()``: refused.
        scores_test_split_only: ``quantize`` scores on ``data.splits.test`` (refused without); else on test or validation.
        prediction_suffix: the file type ``predict`` writes (``.csv``, ``.jsonl``); ``""``: no ``predict``.
        config_groups: the config groups only this task reads, each with the dataclass whose fields are its
            keys (the config check binds the group to that signature; ``config_problems`` checks the values).
        identity_keys: ``fnmatch`` patterns of config keys that are part of what a run is made of: ``model`` (what the
            trained model is, e.g. its label set) and ``data`` (how its data are read).  A resume refuses a change of either.
        shaping_keys: data settings that shape what the model sees; eval/predict/quantize/export take the checkpoint's
            unless the command line gives another (:func:`.checkpoints.io.data_kwargs`).
    """

    name: ClassVar[str] = ""
    loss_implementations: ClassVar[tuple[str, ...]] = ("plain",)
    quantize_variants: ClassVar[tuple[str, ...]] = ("fp32",)
    latency_batch_size: ClassVar[int] = 32
    quality: ClassVar[dict[str, str]] = {}
    reads_exported_folders: ClassVar[bool] = False
    export_formats: ClassVar[tuple[str, ...]] = ()
    scores_test_split_only: ClassVar[bool] = True
    prediction_suffix: ClassVar[str] = ""
    config_groups: ClassVar[dict[str, type]] = {}
    identity_keys: ClassVar[dict[str, tuple[str, ...]]] = {"model": (), "data": ()}
    shaping_keys: ClassVar[tuple[str, ...]] = ("data.max_length",)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = task_folder(cls)

    def resume_refuses(self) -> tuple[str, ...]:
        """The patterns of :attr:`identity_keys`, model and data together (a resume refuses both)."""
        return (*self.identity_keys.get("model", ()), *self.identity_keys.get("data", ()))

    # ------------------------------------------------------------------ config checks
    def data_problems(self, data: DictConfig) -> list[str]:
        """What is wrong with this task's own ``data`` keys, one line each (field, value, fix)."""
        return []

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        """What is wrong with the groups only this task reads, one line each (field, value, fix);
        ``runs_here``: the config runs on this machine (``plan`` passes ``False``)."""
        return []

    # ------------------------------------------------------------------ the planner
    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """The batch the planner traces: ``(micro_batch, data.max_length)`` token ids, and the targets its loss reads."""
        input_ids = torch.randint(0, vocab_size, (micro_batch, cfg.data.max_length))  # (B, T)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def planned_model(self, module: Any, cfg: DictConfig, config: Any, precision: str) -> tuple[torch.nn.Module, list[int]]:
        """The model as ``train`` builds it (fake weights of ``config``), and the numels a QLoRA base holds in 4 bits."""
        raise NotImplementedError

    def example_loss(self, module: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar the planner differentiates: the training loss of ``batch``."""
        loss_sum, items = module.model_step(batch)
        return loss_sum / items

    def length_changes(self, cfg: DictConfig, length: int) -> dict[str, int]:
        """The settings ``plan.mode=longest`` plans at a sequence ``length``: ``data.max_length`` (and any that follow it)."""
        return {"data.max_length": length}

    def memory_phases(self, cfg: DictConfig, config: Any, micro_batch: int, value_bytes: int) -> dict[str, dict]:
        """Phases of a run that hold other bytes than the traced forward/backward, by name: ``{"activations": bytes,
        "temporaries": bytes, "grads": bool}`` beside the weights and the optimizer state (``grads``: the last step's gradients
        are alive then), at ``value_bytes`` per activation value; the planner plans the largest phase. E.g. GRPO's sampling,
        an lm-eval pass at each validation (``callbacks=benchmarks``)."""
        return {}

    def resident_bytes(self, cfg: DictConfig) -> dict[str, int]:
        """Bytes a run holds on the GPU for its whole length beside the trained model, by what holds them (GRPO: a reward
        model's weights); read without loading anything."""
        return {}

    def memory_advice(self, cfg: DictConfig, weights_dominate: bool) -> tuple[dict[str, dict], list[str]]:
        """Levers for a run that does not fit: ``({advice: {key: value}}`` to try at micro-batch 1, ``[advice]`` to print)."""
        return {}, []

    # ------------------------------------------------------------------ after the fit
    def benchmark(self, cfg: DictConfig, load: Any, run_dir: Path) -> dict:
        """``eval benchmarks.tasks=[...]``: lm-evaluation-harness scores of the model ``load()`` returns, checked before it
        loads; writes ``run_dir/benchmarks.json`` (causal LMs: :mod:`..tasks.causal_lm.benchmarks`).

        Raises:
            ConfigError: this task's models are not causal LMs (lm-eval scores those).
        """
        raise ConfigError(f"benchmarks.tasks: lm-eval scores causal LMs, and task={self.name} models are not; fix: benchmarks.tasks=[]")

    def after_test(self, module: Any, datamodule: Any, trainer: Any, predictions: Path, split: str, key: str) -> dict:
        """Metrics beyond the test loop's, computed on the main process (chat: greedy answers' exact match)."""
        return {}

    # ------------------------------------------------------------------ predict
    def write_predictions(self, module: Any, datamodule: Any, outputs: list, path: Path) -> int:
        """Write ``predict``'s file to ``path`` (renamed into place after) and return its row count: one per input row.

        Raises:
            DataError: the input cannot be written back as it was read (e.g. a column named as a prediction).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ quantize
    def timing_inputs(self, input_ids: torch.Tensor, sample: dict[str, torch.Tensor]) -> dict[str, object]:
        """The timed inputs for ``input_ids`` (B, T), every position real; ``sample``: a batch of the task's data."""
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def score(self, forward: Callable[[dict], torch.Tensor], loader: Any, device: str, datamodule: Any) -> dict[str, float]:
        """The quality metrics (:attr:`quality`) of ``forward`` over an evaluation ``loader`` of ``datamodule``."""
        raise NotImplementedError


def to_device(inputs: dict[str, object], device: str) -> dict[str, object]:
    """``inputs`` with each tensor moved to ``device`` (flags such as ``use_cache`` kept as they are)."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def module_class(cfg: DictConfig) -> type[L.LightningModule]:
    """The task's LightningModule class, as the user's config names it (never a checkpoint's)."""
    return hydra.utils.get_class(cfg.task.module)


def build_module(cfg: DictConfig, **replace: dict) -> L.LightningModule:
    """The task module of a config, as train, plan and eval build it (``replace``: groups given instead), handed the
    config's facts (:meth:`.models.inputs.ModelInputs.before_data`)."""
    args = {group: to_plain(cfg[group]) for group in cfg.task.module_args}
    module = module_class(cfg)(**{**args, **replace})
    data = cfg.get("data") or {}
    module.connect(ModelInputs.before_data(str(cfg.trainer.precision), data.get("max_length"), int(data.get("batch_size") or 1)))
    return module
