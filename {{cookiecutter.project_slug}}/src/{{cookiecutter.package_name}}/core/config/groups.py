"""Config checks that run before any data or weights load.

``group_problems`` collects every problem of the shared groups (``.validate.validate_config`` adds
the task's and raises one ConfigError listing them all), each naming the field, the value and the fix (the litgpt/torchtune habit),
so a user fixes a bad command line in one round instead of one error per launch.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from ..errors import ConfigError
from ..run.secrets import credential_problems
from ..run.secrets import register as register_secrets
from .keys import RENAMED_GROUPS, unknown_key_problems
from .named import is_8bit_optimizer

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
DECAYS = ("linear", "cosine", "constant")
# Example values for the top-level keys an entry point may require.
REQUIRED_EXAMPLES = {"ckpt_path": "RUN/checkpoints/last.ckpt", "input": "path/to/texts.csv"}
# Values of the causal-LM groups (checked here, before anything imports the task's code).
TEXT_MODES = ("pack", "pad")
SAMPLE_BY = ("document", "paragraph")
CHAT_MODES = ("pad", "pack_rows")  # data=chat (tasks/causal_lm/chat.py)
TRAIN_ON = ("assistant", "last_assistant", "completion", "all")
TRUNCATION = ("right", "left")
# The peft group (both tasks).
PEFT_METHODS = ("none", "lora", "qlora")
# The memory levers (configs/attention, activation_checkpointing, compile).
ATTENTION = ("sdpa", "flash_attention_2", "flex_attention", "eager")
# Those that attend within packed rows with no dense (B, 1, T, T) mask: flash-attn's varlen kernel,
# FlexAttention's block mask (the planner traces them mask-free).
MASK_FREE_ATTENTION = ("flash_attention_2", "flex_attention")
CHECKPOINTING = ("none", "full")
COMPILE_MODES = ("off", "default", "max-autotune")
LOSSES = ("plain", "chunked", "liger")


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


def machine_precision(accelerator: str = "auto") -> str:
    """``precision=auto``: ``bf16-mixed`` on a CUDA GPU with native bf16 (compute capability 8.0
    and newer: Ampere, Ada, Hopper), ``32-true`` otherwise (the CPU, an older GPU, or
    ``trainer.accelerator=cpu``)."""
    if str(accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 8:
        return "bf16-mixed"
    return "32-true"


def precision_is_auto(cfg: DictConfig) -> bool:
    """Whether ``cfg.trainer.precision`` is the ``precision=auto`` choice (read unresolved)."""
    trainer = cfg.get("trainer")
    return trainer is not None and "machine_precision" in str(OmegaConf.to_container(trainer, resolve=False).get("precision", ""))


def epochs_unless_steps(max_steps: object, epochs: int) -> int:
    """``trainer.max_epochs`` as the shipped trainer config derives it: ``-1`` (no epoch limit)
    when ``max_steps`` is a positive number of optimizer steps, so that ``max_steps`` binds
    (Lightning stops at whichever limit comes first), else ``epochs``."""
    return -1 if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0 else epochs


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


def _finite_or_not_a_number(value: object) -> bool:
    """False for a NaN/infinite float (:func:`non_finite_problems` reports it once)."""
    return not (isinstance(value, float) and not math.isfinite(value))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def group_problems(cfg: DictConfig, required: tuple[str, ...] = (), runs_here: bool = True, resumes: bool = True) -> list[str]:
    """The problems of the shared groups of a composed config, one line each (the task's and the
    compression groups' own checks are added by :func:`.validate.validate_config`), and record its
    secret values (``${oc.env:...}`` of a secret-named variable: masked in everything written,
    :mod:`..run.secrets`).

    Reads raw values (no interpolation is resolved that could itself fail first).

    Args:
        required: top-level keys the entry point needs set (e.g. ``ckpt_path`` for eval).
        runs_here: the config will run on this machine, so its GPU and packages must be here
            (``16-mixed`` and ``loss=liger`` need CUDA; flash-attn, liger-kernel and bitsandbytes
            must be installed).  ``plan`` passes ``False``: it plans for ``hardware``, not for
            the machine it runs on.
        resumes: ``ckpt_path=last``/``auto`` name this run's ``last.ckpt`` (``train``); the entry points that
            read a finished checkpoint (eval, predict, generate, export, quantize) pass ``False``.

    Returns:
        every problem found, one per line (field, value, fix).
    """
    problems: list[str] = unknown_key_problems(cfg) + credential_problems(cfg) + non_finite_problems(cfg)
    register_secrets(cfg, HydraConfig.get() if HydraConfig.initialized() else None)  # masked in all we write (core/run/secrets.py)
    try:
        seed = cfg.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            problems.append(f"seed={seed!r} must be an integer (0 is a seed) or null for no seeding; fix: e.g. seed=42")

        if "batch" in cfg:
            problem = batch_problem(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, *world_size(cfg))
            if problem:
                problems.append(problem)
            problems += derived_batch_key_problems(cfg)

        if "trainer" in cfg:
            precision = str(cfg.trainer.get("precision"))
            if precision not in PRECISIONS:
                problems.append(f"trainer.precision={precision!r} is not one of {PRECISIONS}; fix: precision=bf16-mixed")
            elif precision.startswith("bf16") and "hardware" in cfg and not cfg.hardware.bf16:
                problems.append(
                    f"precision={precision} on hardware={cfg.hardware.name}, which has no bf16; "
                    "fix: precision=16-mixed (fp16 with loss scaling) or 32-true"
                )
            elif precision == "16-mixed" and runs_here and not uses_cuda(cfg):
                # Lightning would silently switch to bf16 on the CPU: say so instead.
                problems.append(
                    "precision=16-mixed needs a CUDA GPU (fp16 autocast with loss scaling), and none is in use; "
                    "fix: precision=bf16-mixed (or 32-true) on the CPU"
                )
        problems += _lever_problems(cfg, runs_here)
        if "trainer" in cfg:
            problems += _distributed_problems(cfg.trainer, runs_here)
            problems += stopping_problems(cfg.trainer)

        if "optimizer" in cfg:
            lr = cfg.optimizer.get("lr")
            if _finite_or_not_a_number(lr) and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0):
                problems.append(f"optimizer.lr={lr!r} must be a positive number, e.g. optimizer.lr=5e-5")
            weight_decay = cfg.optimizer.get("weight_decay")
            if _finite_or_not_a_number(weight_decay) and (not isinstance(weight_decay, (int, float)) or weight_decay < 0):
                problems.append(
                    f"optimizer.weight_decay={weight_decay!r} must be a number >= 0; fix: e.g. optimizer.weight_decay=0.01 (0: none)"
                )

        if "lr_schedule" in cfg:
            warmup = cfg.lr_schedule.warmup_ratio
            if not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
                problems.append(
                    f"lr_schedule.warmup_ratio={warmup!r} must be in [0, 1): the fraction of optimizer steps spent warming up; "
                    "fix: e.g. lr_schedule.warmup_ratio=0.06"
                )
            if cfg.lr_schedule.decay not in DECAYS:
                problems.append(f"lr_schedule.decay={cfg.lr_schedule.decay!r} is not one of {DECAYS}")
            min_ratio = cfg.lr_schedule.min_lr_ratio
            if not isinstance(min_ratio, (int, float)) or not 0 <= min_ratio <= 1:
                problems.append(
                    f"lr_schedule.min_lr_ratio={min_ratio!r} must be in [0, 1], the final LR as a fraction of the peak; "
                    "fix: e.g. lr_schedule.min_lr_ratio=0.1 (0: decay to zero)"
                )

        if "data" in cfg:
            problems += _data_problems(cfg.data)
        if cfg.get("peft") is not None:
            problems += _peft_problems(cfg.peft)

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


def missing_key_problem(error: ConfigAttributeError | ConfigKeyError) -> str:
    """The line for a key of the shipped group files that was removed (``~key``)."""
    return f"{error.full_key} is missing (removed with ~?); fix: put it back: every key of the shipped config files is read"


def uses_cuda(cfg: DictConfig) -> bool:
    """Whether ``trainer`` will run on a CUDA GPU (``accelerator`` gpu/cuda, or auto with one visible)."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def _distributed_problems(trainer: DictConfig, runs_here: bool) -> list[str]:
    """GPUs that are not there, said before anything loads (Lightning's own errors come later, and
    FSDP's only after the model is built): FSDP shards over CUDA GPUs (NCCL); ``accelerator: gpu``
    needs ``devices`` of them."""
    from ..run.distributed import is_fsdp

    if not runs_here:
        return []
    accelerator, devices = str(trainer.get("accelerator")), trainer.get("devices")
    if "SUBMITIT_LOCAL_JOB_ID" in os.environ and isinstance(devices, int) and devices > 1:
        return [
            f"launcher=local runs each job as one process of submitit's local executor, and trainer.devices={devices} needs "
            "Lightning to start the other ranks by re-running the command, which that executor cannot do; fix: drop "
            "launcher=local (Hydra's own launcher runs DDP multiruns), or launcher=slurm on a cluster"
        ]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if is_fsdp(trainer) and (accelerator == "cpu" or not visible):
        return [
            f"trainer=fsdp shards the model over CUDA GPUs, and this run has none (accelerator={accelerator}, "
            f"CUDA GPUs visible: {visible}); fix: trainer=ddp_cpu to test multi-process training on the CPU, "
            "or run on a machine with GPUs"
        ]
    if accelerator in ("gpu", "cuda") and isinstance(devices, int) and devices > visible:
        return [
            f"trainer.accelerator={accelerator} with trainer.devices={devices}, but this machine has {visible} CUDA GPU(s); "
            f"fix: trainer.devices={visible}"
            if visible
            else f"trainer.accelerator={accelerator} (trainer=gpu/ddp) needs a CUDA GPU and this machine has none; "
            "fix: trainer=cpu, or trainer=ddp_cpu for several processes on the CPU"
        ]
    return []


def _flex_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """``attention=flex_attention``: torch's ``torch.nn.attention.flex_attention`` must exist, and
    training needs a CUDA GPU (on the CPU, FlexAttention has a forward only: its backward raises)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return [
            f"attention=flex_attention needs torch.nn.attention.flex_attention (torch >= 2.5; this is {torch.__version__}); fix: attention=sdpa"
        ]
    if runs_here and cfg.get("task_name") == "train" and not uses_cuda(cfg):
        return [
            "attention=flex_attention trains on a CUDA GPU only: on the CPU its backward is not implemented (torch "
            f"{torch.__version__}); fix: attention=sdpa here (the same attention, with a dense mask for packed rows)"
        ]
    return []


def _checkpointing_problems(cfg: DictConfig) -> list[str]:
    """The ``activation_checkpointing`` group: its mode, offloading (needs checkpointing, not with
    compile), the offload threshold and the MLP tiles."""
    group = cfg.activation_checkpointing
    problems = []
    if group.mode not in CHECKPOINTING:
        problems.append(f"activation_checkpointing.mode={group.mode!r} is not one of {CHECKPOINTING}; fix: activation_checkpointing=full")
    offload = group.get("offload", False)
    if not isinstance(offload, bool):
        problems.append(f"activation_checkpointing.offload={offload!r} must be true or false")
    elif offload and group.mode != "full":
        problems.append(
            f"activation_checkpointing.offload=true with activation_checkpointing.mode={group.mode}: offloading moves the "
            "inputs checkpointing keeps, and without it every activation would cross PCIe; fix: activation_checkpointing=offload"
        )
    elif offload and "compile" in cfg and str(cfg.compile.mode) != "off":
        problems.append(
            f"activation_checkpointing.offload=true with compile={cfg.compile.mode}: the saved-tensor hooks are not traced "
            "by torch.compile here (not tested together); fix: compile=off, or activation_checkpointing=full"
        )
    threshold = group.get("offload_min_bytes", 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        problems.append(f"activation_checkpointing.offload_min_bytes={threshold!r} must be a whole number of bytes >= 0, e.g. 1048576")
    tiles = group.get("mlp_tiles", 1)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        problems.append(f"activation_checkpointing.mlp_tiles={tiles!r} must be a whole number >= 1 (1 = off); fix: e.g. mlp_tiles=8")
    elif "data" in cfg and isinstance(cfg.data.get("max_length"), int) and tiles > cfg.data.max_length:
        problems.append(
            f"activation_checkpointing.mlp_tiles={tiles} is more than data.max_length={cfg.data.max_length} tokens; "
            "fix: at most the block length (e.g. 8)"
        )
    return problems


def _lever_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """The attention / activation checkpointing / compile / loss / optimizer levers, and their conflicts."""
    problems = []
    attention = cfg.attention.implementation if "attention" in cfg else "sdpa"
    if attention not in ATTENTION:
        problems.append(f"attention.implementation={attention!r} is not one of {ATTENTION}; fix: attention=sdpa")
    elif (
        attention == "flash_attention_2" and runs_here and (importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available())
    ):
        problems.append(
            "attention=flash_attention_2 needs the flash-attn package and a CUDA GPU (Ampere or newer); "
            "fix: pip install flash-attn --no-build-isolation, or attention=sdpa (PyTorch's own flash kernel)"
        )
    elif attention == "flex_attention":
        problems += _flex_problems(cfg, runs_here)
    if "activation_checkpointing" in cfg:
        problems += _checkpointing_problems(cfg)
    if "compile" in cfg and str(cfg.compile.mode) not in COMPILE_MODES:
        problems.append(f"compile.mode={cfg.compile.mode!r} is not one of {COMPILE_MODES}; fix: compile=default")
    if "loss" in cfg:
        problems += _loss_problems(cfg, runs_here)
    optimizer = cfg.get("optimizer") or {}
    if runs_here and is_8bit_optimizer(optimizer.get("name")) and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"optimizer.name={optimizer.name} needs bitsandbytes; fix: pip install 'bitsandbytes>=0.45', or optimizer=adamw")
    if optimizer.get("step_in_backward"):
        problems += _step_in_backward_problems(cfg)
    ema = (cfg.get("callbacks") or {}).get("ema")
    if ema is not None:
        problems += _ema_problems(cfg, ema)
    return problems


def _ema_problems(cfg: DictConfig, ema: DictConfig) -> list[str]:
    """``callbacks=ema``: its decay, and the settings it cannot average under."""
    problems = []
    decay = ema.get("decay")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        problems.append(f"callbacks.ema.decay={decay!r} must be in (0, 1); fix: callbacks.ema.decay=0.999")
    precision = str(cfg.trainer.get("precision", "")) if "trainer" in cfg else ""
    if precision in ("bf16-true", "16-true"):
        problems.append(
            f"callbacks=ema with precision={precision}: the trained weights are half precision, where (1 - decay) x (weight - "
            "average) mostly rounds to nothing; fix: precision=bf16-mixed (fp32 trained weights), or callbacks=default"
        )
    if (cfg.get("optimizer") or {}).get("step_in_backward"):
        problems.append(
            "callbacks=ema with optimizer.step_in_backward=true: stepping in backward is for runs whose full gradients do not "
            "fit, where an fp32 copy of every trained weight fits even less; fix: optimizer.step_in_backward=false, or callbacks=default"
        )
    from ..run.distributed import is_fsdp

    if "trainer" in cfg and is_fsdp(cfg.trainer):
        problems.append(
            "callbacks=ema with trainer=fsdp: each rank holds a shard of every flattened parameter, and the average is kept "
            "and checkpointed per unsharded parameter name; fix: trainer=ddp (or one GPU), or callbacks=default"
        )
    if (cfg.get("pruning") or {}).get("method", "none") != "none":
        problems.append(
            f"callbacks=ema with pruning={cfg.pruning.method}: the average of the weights before and after each pruning step "
            "puts pruned weights back; fix: pruning=none, or callbacks=default"
        )
    return problems


def _loss_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    implementation, chunk_size = cfg.loss.implementation, cfg.loss.chunk_size
    if implementation not in LOSSES:
        return [f"loss.implementation={implementation!r} is not one of {LOSSES}; fix: loss=chunked"]
    if implementation == "plain":
        return []
    if implementation == "chunked" and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        return [f"loss.chunk_size={chunk_size!r} must be a positive integer (positions per chunk), e.g. loss.chunk_size=256"]
    if implementation == "liger" and runs_here and (importlib.util.find_spec("liger_kernel") is None or not uses_cuda(cfg)):
        return [
            'loss=liger needs a CUDA GPU and the liger-kernel package; fix: pip install -e ".[liger]" on a GPU '
            "machine, or loss=chunked (the same memory saving, in plain PyTorch)"
        ]
    return []


def _step_in_backward_problems(cfg: DictConfig) -> list[str]:
    """``optimizer.step_in_backward`` consumes each gradient as it is made: nothing can wait for
    the whole gradient (accumulation, global-norm clipping, loss scaling, a DDP all-reduce)."""
    problems = []
    devices, nodes = world_size(cfg)
    if "batch" in cfg and batch_problem(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, devices, nodes) is None:
        accumulate = accumulate_grad_batches(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, devices, nodes)
        if devices * nodes > 1:
            problems.append(
                f"optimizer.step_in_backward=true steps each parameter before DDP/FSDP can all-reduce its gradient "
                f"(trainer.devices={devices}, trainer.num_nodes={nodes}); fix: optimizer.step_in_backward=false"
            )
        elif accumulate != 1:
            problems.append(
                f"optimizer.step_in_backward=true steps on every micro-batch, but batch.global_batch_size="
                f"{cfg.batch.global_batch_size} / batch.micro_batch_size={cfg.batch.micro_batch_size} accumulates {accumulate}; "
                f"fix: batch.global_batch_size={cfg.batch.micro_batch_size}, or optimizer.step_in_backward=false"
            )
    if "trainer" in cfg:
        clip = cfg.trainer.get("gradient_clip_val")
        if clip not in (None, 0, 0.0):
            problems.append(
                f"optimizer.step_in_backward=true cannot clip by the global gradient norm (trainer.gradient_clip_val={clip}): "
                "the norm is known only after every parameter has stepped; fix: trainer.gradient_clip_val=null"
            )
        if str(cfg.trainer.get("precision")) == "16-mixed":
            problems.append(
                "optimizer.step_in_backward=true with precision=16-mixed: the loss scaler must see every gradient "
                "before any step; fix: precision=bf16-mixed"
            )
        devices = cfg.trainer.get("devices")
        if devices not in (1, "1", None) or cfg.trainer.get("num_nodes", 1) != 1:
            problems.append(
                f"optimizer.step_in_backward=true runs on one device (trainer.devices={devices}): DDP all-reduces "
                "gradients after backward; fix: trainer.devices=1"
            )
    return problems


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


def _peft_problems(peft: DictConfig) -> list[str]:
    method = peft.get("method")
    if method not in PEFT_METHODS:
        return [f"peft.method={method!r} is not one of {PEFT_METHODS}; fix: peft=lora (or none, qlora)"]
    if method == "none":
        return []
    problems = []
    r, alpha, dropout = peft.get("r"), peft.get("alpha"), peft.get("dropout")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"peft.r={r!r} must be a positive integer (the LoRA rank), e.g. peft.r=16")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"peft.alpha={alpha!r} must be a positive number (scale = alpha / r), e.g. peft.alpha=32")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"peft.dropout={dropout!r} must be in [0, 1); fix: e.g. peft.dropout=0.05")
    modules = peft.get("target_modules")
    if (
        modules is not None
        and modules != "all-linear"
        and (isinstance(modules, str) or not modules or not all(isinstance(m, str) and m for m in modules))
    ):
        problems.append(
            f"peft.target_modules={modules!r} must be all-linear (peft's selection) or a list of layer names; "
            "fix: peft.target_modules=all-linear, or e.g. peft.target_modules=[q_proj,v_proj]"
        )
    for key in ("use_dora", "use_rslora"):
        if not isinstance(peft.get(key, False), bool):
            problems.append(f"peft.{key}={peft.get(key)!r} must be true or false; fix: peft.{key}=true")
    problems += _lora_init_problems(peft)
    ratio = peft.get("loraplus_lr_ratio")
    if ratio is not None and (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio < 1):
        problems.append(
            f"peft.loraplus_lr_ratio={ratio!r} must be null or a number >= 1 (the B matrices' learning rate over A's, "
            "LoRA+); fix: e.g. peft.loraplus_lr_ratio=16"
        )
    return problems


# peft.init_lora_weights values that rewrite the base weights (and pissa_niter_<n>, PISSA_NITER).
BASE_REWRITING_INITS = ("pissa", "olora")
PISSA_NITER = re.compile(r"pissa_niter_[1-9][0-9]*")


def rewrites_base(peft: dict | DictConfig | None) -> bool:
    """Whether the ``peft`` group trains adapters initialised by PiSSA or OLoRA
    (``init_lora_weights``), which leave the frozen base as a residual."""
    peft = peft or {}
    init = peft.get("init_lora_weights", True)
    adapters = peft.get("method", "none") != "none"
    return adapters and isinstance(init, str) and (init in BASE_REWRITING_INITS or bool(PISSA_NITER.fullmatch(init)))


def _lora_init_problems(peft: DictConfig) -> list[str]:
    """``peft.init_lora_weights``: true, pissa, pissa_niter_<n> or olora, and what PiSSA/OLoRA cannot join."""
    init = peft.get("init_lora_weights", True)
    if init is True:
        return []
    if not rewrites_base(peft):
        return [
            f"peft.init_lora_weights={init!r} must be true, pissa, pissa_niter_<n> (e.g. pissa_niter_4) or olora; "
            "fix: peft.init_lora_weights=true"
        ]
    problems = []
    if peft.get("method") == "qlora":
        problems.append(
            f"peft.init_lora_weights={init} with peft=qlora: the residual base would be quantized to 4 bits again, so the "
            "checkpoint's initial adapter could not rebuild it exactly on a load; fix: peft=lora, or peft.init_lora_weights=true"
        )
    if peft.get("use_dora"):
        problems.append(
            f"peft.init_lora_weights={init} with peft.use_dora=true: the conversion of its adapter for the original base "
            "is not checked for DoRA here; fix: one of them"
        )
    return problems


def _data_problems(data: DictConfig) -> list[str]:
    """The keys every data config has; each task checks its own (``Task.data_problems``)."""
    problems = []
    max_length = data.get("max_length")
    if not isinstance(max_length, int) or max_length < 8:
        problems.append(f"data.max_length={max_length!r} must be an integer >= 8 (tokens per sequence); fix: e.g. data.max_length=512")
    fraction = data.get("val_fraction")
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        problems.append(
            f"data.val_fraction={fraction!r} must be in (0, 1), the share of train held out for validation; fix: e.g. data.val_fraction=0.1"
        )
    splits = data.get("splits") or {}
    unknown = sorted(set(splits) - {"train", "validation", "test"})
    if unknown:
        problems.append(f"data.splits has unknown keys {unknown}; allowed: train, validation, test")
    if not splits.get("train"):
        problems.append("data.splits.train is empty; fix: data.splits.train=path/to/train.csv (or a hub split name)")
    return problems


def to_plain(cfg: DictConfig) -> dict:
    """Resolve ``cfg`` into plain dicts/lists (checkpoints then load with ``weights_only=True``)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
