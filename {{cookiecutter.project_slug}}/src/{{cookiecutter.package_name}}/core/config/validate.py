"""The one config check every entry point runs first, before anything is loaded: each group's own
check (beside the code that reads the group), the task's (:class:`..task.Task`: its data, its
groups), the cross-field rules here, gathered into one :class:`~..errors.ConfigError` that lists
every problem, one per line (field, value, fix).
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from ..callbacks.ema import ema_problems
from ..callbacks.lr_schedule import schedule_problems
from ..compress.pruning import pruning_problems
from ..compress.qat import qat_problems
from ..data.batching import data_problems
from ..errors import ConfigError
from ..models.adapters import peft_problems
from ..models.levers import lever_problems
from ..models.precision import precision_problems
from ..optim import fused_problems, optimizer_problems
from ..run.distributed import distributed_problems
from ..run.secrets import credential_problems
from ..run.secrets import register as register_secrets
from ..task import Task
from .keys import RENAMED_GROUPS, unknown_key_problems
from .named import is_8bit_optimizer
from .resolvers import batch_problem, batch_problems, device_batch_size, world_size


def validate_config(cfg: DictConfig, task: Task, required: tuple[str, ...] = (), runs_here: bool = True, resumes: bool = True) -> None:
    """Check a composed train/eval/predict/plan config before anything is loaded, and record its
    secret values (masked in everything written, :mod:`..run.secrets`).

    Args: ``task``: the config's task (the entry point resolved it: ``tasks.task_of``); the rest
        as :func:`group_problems` (``required``: keys the entry point needs;
        ``runs_here``: the machine must have the GPU and packages; ``resumes``: ``ckpt_path=last``
        names this run's ``last.ckpt``).

    Raises:
        ConfigError: with every problem found, one per line.
    """
    problems = group_problems(cfg, required, runs_here, resumes, task.config_groups)
    try:
        if "task" in cfg:
            problems += task_problems(cfg, task, runs_here)
        if cfg.get("qat") is not None:
            problems += qat_problems(cfg.qat, cfg.get("optimizer"), cfg.get("peft"), cfg.get("model"))
        if cfg.get("pruning") is not None:
            problems += pruning_problems(cfg.pruning, cfg.get("peft"), cfg.get("qat"), cfg.get("trainer"), cfg.get("model"))
        problems += fused_problems(cfg)
    except (ConfigAttributeError, ConfigKeyError) as error:  # a key the shipped group files have was removed (~key)
        problems.append(missing_key_problem(error))
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))


def data_configs_of(targets: list[str]) -> list[str]:
    """The shipped ``configs/data/`` files that name one of ``targets`` as their ``_target_`` (a file inheriting its target
    from another is not listed)."""
    folder = Path(__file__).resolve().parents[2] / "configs" / "data"
    found = {path.stem: re.search(r"^_target_:\s*(\S+)", path.read_text(encoding="utf-8"), re.MULTILINE) for path in folder.glob("*.yaml")}
    return sorted(name for name, match in found.items() if match and match.group(1) in targets)


def task_problems(cfg: DictConfig, task: Task, runs_here: bool) -> list[str]:
    """The data config is one of the task's data modules, and passes its checks; the loss
    implementation is one the task's module has."""
    problems = []
    if "data" in cfg:
        expected, target = cfg.task.get("datamodules"), cfg.data.get("_target_")
        if expected and target not in expected:
            names = data_configs_of(expected)
            fix = " or ".join(f"data={name}" for name in names) if names else "a data config of that task (see configs/data/)"
            return [
                f"data._target_={target!r} is not a data module of task={task.name} ({', '.join(expected)}); "
                f"fix: {fix}, or an experiment= that sets both"
            ]
        problems += task.data_problems(cfg.data)
    problems += task.config_problems(cfg, runs_here)
    implementation = cfg.loss.implementation if "loss" in cfg else "plain"
    if implementation not in task.loss_implementations:
        problems.append(
            f"loss.implementation={implementation!r} does not apply to task={task.name} (its module implements {list(task.loss_implementations)}); "
            "fix: loss=plain"
        )
    return problems


def group_problems(
    cfg: DictConfig,
    required: tuple[str, ...] = (),
    runs_here: bool = True,
    resumes: bool = True,
    task_groups: dict[str, type] | None = None,
) -> list[str]:
    """The problems of the shared groups of a composed config, one line each (each group's check
    sits beside the code that reads it: :mod:`..models.precision`, :mod:`..models.levers`,
    :mod:`..models.adapters`, :mod:`..optim`, ...), and record its secret values (``${oc.env:...}`` of a
    secret-named variable: masked in everything written, :mod:`..run.secrets`).

    Reads raw values (no interpolation is resolved that could itself fail first).

    Args:
        required: top-level keys the entry point needs set (e.g. ``ckpt_path`` for eval).
        runs_here: the config will run on this machine, so its GPU and packages must be here
            (``16-mixed`` and ``loss=liger`` need CUDA; flash-attn, liger-kernel and bitsandbytes
            must be installed).  ``plan`` passes ``False``: it plans for ``hardware``, not for
            the machine it runs on.
        resumes: ``ckpt_path=last``/``auto`` name this run's ``last.ckpt`` (``train``); the entry points that
            read a finished checkpoint (eval, predict, generate, export, quantize) pass ``False``.
        task_groups: the config groups the task declares (``Task.config_groups``), bound to their specs.

    Returns:
        every problem found, one per line (field, value, fix).
    """
    problems: list[str] = unknown_key_problems(cfg, task_groups) + credential_problems(cfg) + non_finite_problems(cfg)
    register_secrets(cfg, HydraConfig.get() if HydraConfig.initialized() else None)  # masked in all we write (core/run/secrets.py)
    try:
        seed = cfg.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            problems.append(f"seed={seed!r} must be an integer (0 is a seed) or null for no seeding; fix: e.g. seed=42")

        if "batch" in cfg:
            problems += batch_problems(cfg)
        if "trainer" in cfg:
            problems += precision_problems(cfg, runs_here) + distributed_problems(cfg.trainer, runs_here) + stopping_problems(cfg.trainer)
        problems += lever_problems(cfg, runs_here)
        if "optimizer" in cfg:
            problems += optimizer_problems(cfg, runs_here)
        if "lr_schedule" in cfg:
            problems += schedule_problems(cfg.lr_schedule)
        if "data" in cfg:
            problems += data_problems(cfg.data)
        if cfg.get("peft") is not None:
            problems += peft_problems(cfg.peft)
        if (cfg.get("callbacks") or {}).get("ema") is not None:
            problems += ema_problems(cfg, cfg.callbacks.ema)

        for group in ("callbacks", "logger"):
            entries = cfg.get(group) or {}
            for name, node in entries.items():
                if node is not None and not isinstance(node, DictConfig):
                    problems.append(
                        f"{group}.{name}={node!r}: an entry is a config with a _target_, or null; fix: {group}.{name}=null to turn it off"
                    )
                elif node is not None and "_target_" not in node:
                    named = [other for other in entries if other != name and entries[other] is not None]
                    close = difflib.get_close_matches(str(name), named, n=1)
                    hint = f"did you mean {group}.{close[0]}? " if close else ""
                    problems.append(
                        f"{group}.{name} has no _target_: {hint}fix: give it one, or disable it with {group}.{name}=null "
                        f"(entries: {', '.join(map(str, named)) or 'none'})"
                    )

        missing = [key for key in required if cfg.get(key) is None]
        for key in missing:
            problems.append(f"{key} is required; fix: {key}={REQUIRED_EXAMPLES[key]}")
        ckpt_path = cfg.get("ckpt_path")
        resumes_last = ckpt_path in ("last", "auto") and resumes and "ckpt_path" not in required  # train: this run's last.ckpt
        if ckpt_path is not None and not resumes_last and not Path(ckpt_path).is_file():
            problems.append(
                f"ckpt_path={ckpt_path!r} is not a file; fix: point it at a .ckpt written by train (RUN/checkpoints/*.ckpt)"
                + ("" if "ckpt_path" in required or not resumes else ", or ckpt_path=last (or auto) to resume the run in hydra.run.dir")
            )

    except (ConfigAttributeError, ConfigKeyError) as error:  # a key the shipped group files have was removed (~key)
        problems.append(missing_key_problem(error))
    return problems


# Example values for the top-level keys an entry point may require.
REQUIRED_EXAMPLES = {"ckpt_path": "RUN/checkpoints/last.ckpt", "input": "path/to/texts.csv"}


def stopping_problems(trainer: DictConfig) -> list[str]:
    """What is wrong with ``trainer.max_steps``/``trainer.max_epochs`` (read raw).

    The rule: ``max_steps > 0`` binds: ``max_epochs`` must then be lifted, ``-1`` or ``null`` (no
    epoch limit), which the shipped configs derive (``${epochs_unless_steps:...}``: the trainer
    group, the experiments, the debug groups); ``max_steps=-1`` leaves the stop to
    ``max_epochs``, a positive number.  A number of epochs set by hand next to ``max_steps > 0``
    is refused, naming both: Lightning would stop at the first limit reached and exit 0 with
    fewer steps than asked.
    """
    problems = []
    steps = trainer.get("max_steps")
    if not _is_int(steps) or (steps != -1 and steps <= 0):
        problems.append(
            f"trainer.max_steps={steps!r} must be -1 (no step limit: max_epochs ends the run) or a positive number of "
            "optimizer steps; fix: e.g. trainer.max_steps=100, or trainer.max_steps=-1"
        )
        return problems
    if "max_epochs" not in trainer or OmegaConf.is_interpolation(trainer, "max_epochs"):
        return problems
    epochs = trainer.max_epochs
    if steps > 0:
        if epochs is not None and epochs != -1:
            problems.append(
                f"trainer.max_steps={steps} and trainer.max_epochs={epochs!r} are both set (command line, your own "
                "experiment or debug file): Lightning stops at whichever comes first, so the run could end short of "
                f"either; fix: trainer.max_epochs=-1 to run exactly {steps} optimizer steps, or trainer.max_steps=-1 "
                f"to stop after max_epochs"
            )
    elif not _is_int(epochs) or epochs <= 0:
        problems.append(
            f"trainer.max_epochs={epochs!r} must be a positive number of epochs when trainer.max_steps=-1 "
            "(-1 or null only with trainer.max_steps > 0); fix: e.g. trainer.max_epochs=3"
        )
    return problems


def non_finite_problems(cfg: DictConfig) -> list[str]:
    """One line for each number in the config (read raw) that is NaN or infinite: no setting of
    this project takes one, and ``optimizer.lr=inf`` would otherwise train NaN weights and exit 0."""
    problems = []

    def visit(node: object, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                visit(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                visit(value, f"{key}[{index}]")
        elif isinstance(node, float) and not math.isfinite(node):
            problems.append(f"{key}={node!r} is not a finite number; fix: give {key} a finite value (see its config file)")

    visit(OmegaConf.to_container(cfg, resolve=False), "")
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def missing_key_problem(error: ConfigAttributeError | ConfigKeyError) -> str:
    """The line for a key of the shipped group files that was removed (``~key``)."""
    return f"{error.full_key} is missing (removed with ~?); fix: put it back: every key of the shipped config files is read"


def config_warnings(cfg: DictConfig) -> list[str]:
    """Valid but risky choices, said out loud by train and plan (never silently).

    - On several processes, a micro-batch lowered to keep the global batch (:func:`device_batch_size`).
    - A renamed group selected by its old name (``scheduler=cosine_warmup``: :data:`.keys.RENAMED_GROUPS`).
    - ``bf16-true`` with a full fine-tune: weights and AdamW state are bf16 (8 significant bits),
      so an update smaller than ~1/256 of a weight rounds to nothing; at a fine-tuning LR of 2e-5
      most updates are that small and most weights never change.  We warn rather than keep
      hidden fp32 master copies: the point of bf16-true is the memory those copies would take.
    """
    warnings = []
    trainer = cfg.get("trainer") or {}
    peft = cfg.get("peft") or {}
    full_fine_tune = peft.get("method", "none") == "none" and bool((cfg.get("model") or {}).get("name_or_path"))
    if str(trainer.get("precision")) == "bf16-true" and full_fine_tune:
        optimizer = cfg.get("optimizer") or {}
        unused = [
            lever
            for lever, on in (
                ("optimizer=adamw_8bit", is_8bit_optimizer(optimizer.get("name"))),
                ("activation_checkpointing=full", (cfg.get("activation_checkpointing") or {}).get("mode") == "full"),
                ("optimizer.step_in_backward=true", bool(optimizer.get("step_in_backward"))),
            )
            if not on
        ] + ["peft=lora"]
        warnings.append(
            f"precision=bf16-true with a full fine-tune: weights and optimizer state are bf16, and an update "
            f"below ~1/256 of a weight rounds away (at optimizer.lr={optimizer.get('lr')} most do: many weights never "
            f"change). Prefer precision=bf16-mixed (fp32 master weights) if it fits; to save memory instead: {', '.join(unused)}."
        )
    devices, nodes = world_size(cfg)
    batch = cfg.get("batch") or {}
    if "global_batch_size" in batch and batch_problem(batch.global_batch_size, batch.micro_batch_size, devices, nodes) is None:
        size = device_batch_size(batch.global_batch_size, batch.micro_batch_size, devices, nodes)
        if size != batch.micro_batch_size:
            warnings.append(
                f"batch.micro_batch_size={batch.micro_batch_size} x {devices * nodes} processes is more than the global batch "
                f"of {batch.global_batch_size} allows: each process runs micro-batches of {size} (same global batch, less memory)"
            )
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    for old, new in RENAMED_GROUPS.items():
        if choices.get(old):
            warnings.append(
                f"{old}={choices[old]} is the deprecated name of {new}={choices[old]} (the alias goes in a later release); fix: {new}={choices[old]}"
            )
    return warnings
