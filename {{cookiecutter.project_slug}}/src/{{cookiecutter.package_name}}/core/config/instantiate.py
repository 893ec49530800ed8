"""Build callbacks and loggers from their config groups; an entry set to ``null`` is off."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from ..run.secrets import mask
from ..run.sweeps import is_multirun
from .resolvers import to_plain

log = logging.getLogger(__name__)


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate each non-null entry of a ``callbacks`` or ``logger`` group, in order."""
    return [hydra.utils.instantiate(node) for node in (group or {}).values() if node is not None]


def instantiate_loggers(cfg: DictConfig, resumes_wandb_run: str | None = None) -> list[Logger]:
    """Loggers of the ``logger`` group.  W&B: one run per launch, grouped by sweep, named after the run folder; a resume is
    a new run noting ``resumes_wandb_run`` (an offline run cannot continue another's history: wandb restarts ``_step``)."""
    loggers = []
    for name, node in (cfg.get("logger") or {}).items():
        if node is None:
            continue
        extra = {}
        if str(node.get("_target_", "")).endswith("WandbLogger"):
            extra = wandb_run_fields(cfg, node)
            if resumes_wandb_run:
                extra["notes"] = f"resumes W&B run {resumes_wandb_run} (ckpt_path={cfg.get('ckpt_path')})"
            if rank_zero_only.rank == 0:  # (the other ranks of a DDP run log nothing)
                extra["experiment"] = start_wandb_run(node, extra)
        loggers.append(hydra.utils.instantiate(node, **extra))
    return loggers


# WandbLogger arguments that are Lightning's own, not wandb.init's (see start_wandb_run).
LIGHTNING_WANDB_ARGS = (
    "_target_",
    "save_dir",
    "dir",
    "version",
    "id",
    "offline",
    "anonymous",
    "log_model",
    "prefix",
    "checkpoint_name",
    "experiment",
    "add_file_policy",
    "log_every_n_steps",  # ours (core.loggers.trackers.WandbLogger)
    "quiet",  # ours: W&B's quiet setting (below)
)


# wandb.init settings that W&B writes into the run (its name, notes, tags, group, config): secrets masked.
MASKED_WANDB_SETTINGS = ("name", "notes", "tags", "group", "config", "job_type", "project")


def start_wandb_run(node: DictConfig, fields: dict):
    """Start this job's W&B run for ``WandbLogger(experiment=...)`` as Lightning would, less the ``anonymous=None`` it
    always passes (wandb then warns on every run)."""
    import wandb

    settings = {key: value for key, value in to_plain(node).items() if key not in LIGHTNING_WANDB_ARGS and value is not None}
    settings.update(fields)
    settings = {key: mask(value) if key in MASKED_WANDB_SETTINGS else value for key, value in settings.items()}
    if node.get("offline"):
        settings["mode"] = "offline"
    if node.get("quiet", True) and "settings" not in settings:  # W&B prints nothing: train's results name its folder
        settings["settings"] = wandb.Settings(silent=True)
    run = wandb.init(dir=node.get("save_dir") or node.get("dir"), id=node.get("version") or node.get("id"), **settings)
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    return run


def wandb_run_fields(cfg: DictConfig, node: DictConfig) -> dict:
    """``group``, ``name`` and ``tags`` of this job's W&B run (see :func:`instantiate_loggers`)."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    group = node.get("group")
    if group is None:
        group = Path(HydraConfig.get().sweep.dir).name if is_multirun() else cfg.get("task_name")
    tags = [
        f"task:{cfg.task.name}" if "task" in cfg else None,
        f"model:{choices['model']}" if choices.get("model") else None,
        f"precision:{cfg.trainer.precision}" if "trainer" in cfg else None,
        f"experiment:{choices['experiment']}" if choices.get("experiment") else None,
    ]
    name = node.get("name") or Path(cfg.paths.output_dir).name
    return {"group": group, "name": name, "tags": [*(node.get("tags") or []), *filter(None, tags)]}


class NoProfiler(PassThroughProfiler):
    """Lightning's "no profiler" with one shared ``nullcontext`` instead of a generator context manager per hook call."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return self._nothing


def instantiate_trainer(cfg: DictConfig, callbacks: list[Callback], loggers: list[Logger]):
    """The ``lightning.Trainer`` of ``cfg.trainer``; :class:`NoProfiler` unless ``trainer.profiler`` is set."""
    extra = {} if cfg.trainer.get("profiler") is not None else {"profiler": NoProfiler()}
    return hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **extra)


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """``trainer.callback_metrics`` as plain floats (for ``metrics.json``)."""
    return {name: float(value) for name, value in metrics.items() if getattr(value, "numel", lambda: 1)() == 1}
