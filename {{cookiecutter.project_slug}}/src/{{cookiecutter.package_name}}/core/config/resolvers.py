"""The config's computed values (Hydra resolvers: ``${accumulate:...}``, ``${machine_precision:...}``,
``${epochs_unless_steps:...}``, ...), the batch group's arithmetic and its checks, and ``to_plain``."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..models.precision import machine_precision


def accumulate_grad_batches(global_batch_size: int, micro_batch_size: int, devices: object = 1, num_nodes: object = 1) -> int:
    """Return the number of micro-batches per optimizer step, per process.

    ``global_batch_size`` samples are seen per optimizer step, all processes together; each of
    the ``devices x num_nodes`` processes (DDP/FSDP) runs micro-batches of
    :func:`device_batch_size` and accumulates ``global / (device batch x processes)`` of them,
    so a recipe keeps its optimization when it moves from one GPU to several (Goyal et al. 2017,
    "Accurate, Large Minibatch SGD": the learning rate belongs to the global batch).

    Raises:
        ConfigError: see :func:`batch_problem`.
    """
    return global_batch_size // (device_batch_size(global_batch_size, micro_batch_size, devices, num_nodes) * devices * num_nodes)


def device_batch_size(global_batch_size: int, micro_batch_size: int, devices: object = 1, num_nodes: object = 1) -> int:
    """Samples per forward/backward pass of one process: ``micro_batch_size``, or on several
    processes the largest size below it for which ``size x processes`` divides the global batch
    (``experiment=...`` with 32 = 32 x 1 runs on 2 GPUs as 16 x 2: same global batch, less memory).

    Raises:
        ConfigError: see :func:`batch_problem`.
    """
    problem = batch_problem(global_batch_size, micro_batch_size, devices, num_nodes)
    if problem:
        raise ConfigError(problem)
    processes = devices * num_nodes
    return next(size for size in range(micro_batch_size, 0, -1) if global_batch_size % (size * processes) == 0)


def batch_problem(global_batch_size: object, micro_batch_size: object, devices: object = 1, num_nodes: object = 1) -> str | None:
    """Describe what is wrong with a global/micro-batch pair on ``devices x num_nodes``
    processes, or return ``None``: a size that is not a positive integer; on one process, a
    micro-batch that does not divide the global batch; on several, a global batch that is not a
    multiple of the number of processes."""
    for field, value in (
        ("batch.global_batch_size", global_batch_size),
        ("batch.micro_batch_size", micro_batch_size),
        ("trainer.devices", devices),
        ("trainer.num_nodes", num_nodes),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            why = " (the global batch is divided over the devices, so give their number)" if field.startswith("trainer") else ""
            return f"{field}={value!r} must be a positive integer{why}; fix: e.g. {field}={2 if why else 8}"
    processes = devices * num_nodes
    if processes > 1 and global_batch_size % processes:
        return (
            f"batch.global_batch_size={global_batch_size} cannot be split over {processes} processes "
            f"(trainer.devices={devices} x trainer.num_nodes={num_nodes}); fix: a global batch that is a multiple of {processes}"
        )
    if processes == 1 and global_batch_size % micro_batch_size:
        divisors = [d for d in range(1, micro_batch_size + 1) if global_batch_size % d == 0]
        return (
            f"batch.global_batch_size={global_batch_size} is not divisible by "
            f"batch.micro_batch_size={micro_batch_size}; fix: batch.micro_batch_size={divisors[-1]} "
            f"(the largest divisor not above it), or a global batch that is a multiple of {micro_batch_size}"
        )
    return None


# Keys the batch group derives from global_batch_size, micro_batch_size and the processes: set by
# hand, they would silently change the global batch (accumulation on top of the batch group).
DERIVED_BATCH_KEYS = (
    ("batch", "accumulate_grad_batches"),
    ("batch", "device_batch_size"),
    ("trainer", "accumulate_grad_batches"),
    ("data", "batch_size"),
)


def derived_batch_key_problems(cfg: DictConfig) -> list[str]:
    """One line for each of :data:`DERIVED_BATCH_KEYS` that holds a value instead of the
    interpolation the shipped configs give it (read raw: nothing is resolved), with the
    batch-group setting that does what the value meant."""
    problems = []
    micro = cfg.batch.get("micro_batch_size")
    for group, key in DERIVED_BATCH_KEYS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or key not in node or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        number = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if key == "accumulate_grad_batches":
            meant = (
                f"batch.global_batch_size={micro * value}"
                if number and isinstance(micro, int)
                else "batch.global_batch_size=<micro-batch x accumulation>"
            )
        else:
            meant = f"batch.micro_batch_size={value}" if number else "batch.micro_batch_size=<samples per forward pass>"
        problems.append(
            f"{group}.{key}={value!r} is derived by the batch group (global batch = micro-batch x accumulate_grad_batches "
            f"x processes) and is not set by hand: it would change the global batch behind batch.global_batch_size's back; "
            f"fix: drop it and set {meant}"
        )
    return problems


def world_size(cfg: DictConfig) -> tuple[object, object]:
    """``(trainer.devices, trainer.num_nodes)`` of a config (1, 1 without a trainer group)."""
    trainer = cfg.get("trainer") or {}
    return trainer.get("devices", 1), trainer.get("num_nodes", 1)


def epochs_unless_steps(max_steps: object, epochs: int) -> int:
    """``trainer.max_epochs`` as the shipped trainer config derives it: ``-1`` (no epoch limit)
    when ``max_steps`` is a positive number of optimizer steps, so that ``max_steps`` binds
    (Lightning stops at whichever limit comes first), else ``epochs``."""
    return -1 if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0 else epochs


def register_resolvers() -> None:
    """Register ``${accumulate:global,micro,devices,nodes}``, ``${device_batch:...}`` (same arguments), ``${pid:}`` and ``${or:value,default}``
    (idempotent).  ``or`` gives ``default`` where ``value`` is null (``oc.select`` only does so
    for a missing key), e.g. a config group left at ``null`` in a folder name.

    ``${pid:}`` is this process's id, cached in the config like Hydra's ``${now:}``: the run and
    sweep folders carry it, so two runs started in the same second never share a folder, and a
    job launched elsewhere (submitit) keeps the folder its sweep named.
    """
    if not OmegaConf.has_resolver("accumulate"):
        OmegaConf.register_new_resolver("accumulate", accumulate_grad_batches)
    if not OmegaConf.has_resolver("device_batch"):
        OmegaConf.register_new_resolver("device_batch", device_batch_size)
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)
    if not OmegaConf.has_resolver("machine_precision"):
        OmegaConf.register_new_resolver("machine_precision", machine_precision)
    if not OmegaConf.has_resolver("epochs_unless_steps"):
        OmegaConf.register_new_resolver("epochs_unless_steps", epochs_unless_steps)
    if not OmegaConf.has_resolver("or"):
        OmegaConf.register_new_resolver("or", lambda value, default: default if value is None else value)


def to_plain(cfg: DictConfig) -> dict:
    """Resolve ``cfg`` into plain dicts/lists (checkpoints then load with ``weights_only=True``)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def batch_problems(cfg: DictConfig) -> list[str]:
    """The ``batch`` group: its sizes on this run's processes, and no derived key set by hand."""
    problem = batch_problem(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, *world_size(cfg))
    return ([problem] if problem else []) + derived_batch_key_problems(cfg)
