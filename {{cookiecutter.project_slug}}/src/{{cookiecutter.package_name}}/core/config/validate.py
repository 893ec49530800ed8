"""The config check every entry point runs first: each group's checks, where that group's code
is (the shared groups in :mod:`.groups`, the task's data in ``tasks/<name>/``, ``qat`` and
``pruning`` in :mod:`..compress`, the optimizer in :mod:`..optim`), gathered into one
:class:`~..errors.ConfigError` that lists every problem, one per line (field, value, fix), before
anything is loaded.
"""

from __future__ import annotations

from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from ..compress.pruning import pruning_problems
from ..compress.qat import qat_problems
from ..errors import ConfigError
from ..optim import fused_problems
from ..task import Task
from .groups import LOSSES, group_problems, missing_key_problem


def validate_config(cfg: DictConfig, task: Task, required: tuple[str, ...] = (), runs_here: bool = True, resumes: bool = True) -> None:
    """Check a composed train/eval/predict/plan config before anything is loaded, and record its
    secret values (masked in everything written, :mod:`..run.secrets`).

    Args: ``task``: the config's task (the entry point resolved it: ``tasks.task_of``); the rest
        as :func:`.groups.group_problems` (``required``: keys the entry point needs;
        ``runs_here``: the machine must have the GPU and packages; ``resumes``: ``ckpt_path=last``
        names this run's ``last.ckpt``).

    Raises:
        ConfigError: with every problem found, one per line.
    """
    problems = group_problems(cfg, required, runs_here, resumes)
    try:
        if "task" in cfg:
            problems += task_problems(cfg, task)
        if cfg.get("qat") is not None:
            problems += qat_problems(cfg.qat, cfg.get("optimizer"), cfg.get("peft"), cfg.get("model"))
        if cfg.get("pruning") is not None:
            problems += pruning_problems(cfg.pruning, cfg.get("peft"), cfg.get("qat"), cfg.get("trainer"), cfg.get("model"))
        problems += fused_problems(cfg)
    except (ConfigAttributeError, ConfigKeyError) as error:  # a key the shipped group files have was removed (~key)
        problems.append(missing_key_problem(error))
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))


def task_problems(cfg: DictConfig, task: Task) -> list[str]:
    """The data config is one of the task's data modules, and passes its checks; the loss
    implementation is one the task's module has."""
    problems = []
    if "data" in cfg:
        expected, target = cfg.task.get("datamodules"), cfg.data.get("_target_")
        if expected and target not in expected:
            return [
                f"data._target_={target!r} is not a data module of task={task.name} ({', '.join(expected)}); "
                f"fix: a data config of that task (see configs/data/), or an experiment= that sets both"
            ]
        problems += task.data_problems(cfg.data)
    problems += task.config_problems(cfg)
    implementation = cfg.loss.implementation if "loss" in cfg else "plain"
    if implementation in LOSSES and implementation not in task.loss_implementations:
        problems.append(
            f"loss={implementation} does not apply to task={task.name} (its module implements {list(task.loss_implementations)}); "
            "fix: loss=plain"
        )
    return problems
