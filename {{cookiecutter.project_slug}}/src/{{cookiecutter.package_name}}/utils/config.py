"""Config checks that run before any data or weights load.

``validate_config`` collects every problem it finds and raises one :class:`ConfigError`
listing them all, each naming the field, the value and the fix (the litgpt/torchtune habit),
so a user fixes a bad command line in one round instead of one error per launch.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
DECAYS = ("linear", "cosine", "constant")
# Example values for the top-level keys an entry point may require.
REQUIRED_EXAMPLES = {"ckpt_path": "RUN/checkpoints/last.ckpt", "input": "path/to/texts.csv"}
# Values of the causal-LM groups (checked here, before anything imports the task's code).
TEXT_MODES = ("pack", "pad")
SAMPLE_BY = ("document", "paragraph")
PEFT_METHODS = ("none", "lora", "qlora")


class ConfigError(ValueError):
    """A config value is invalid; the message lists every problem found, one per line."""


def accumulate_grad_batches(global_batch_size: int, micro_batch_size: int) -> int:
    """Return the number of micro-batches per optimizer step.

    ``global_batch_size`` samples are seen per optimizer step; ``micro_batch_size`` samples per
    forward/backward pass.  On several GPUs the global batch is also divided by the number of
    devices; on one GPU it is ``global_batch_size // micro_batch_size``.

    Raises:
        ConfigError: a size is not a positive integer, or the micro-batch does not divide the
            global batch.
    """
    problem = batch_problem(global_batch_size, micro_batch_size)
    if problem:
        raise ConfigError(problem)
    return global_batch_size // micro_batch_size


def batch_problem(global_batch_size: object, micro_batch_size: object) -> str | None:
    """Describe what is wrong with a global/micro-batch pair, or return ``None``."""
    for field, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"batch.{field}={value!r} must be a positive integer"
    if global_batch_size % micro_batch_size:
        divisors = [d for d in range(1, micro_batch_size + 1) if global_batch_size % d == 0]
        return (
            f"batch.global_batch_size={global_batch_size} is not divisible by "
            f"batch.micro_batch_size={micro_batch_size}; fix: batch.micro_batch_size={divisors[-1]} "
            f"(the largest divisor not above it), or a global batch that is a multiple of {micro_batch_size}"
        )
    return None


def register_resolvers() -> None:
    """Register ``${accumulate:global,micro}`` (idempotent)."""
    if not OmegaConf.has_resolver("accumulate"):
        OmegaConf.register_new_resolver("accumulate", accumulate_grad_batches)


def validate_config(cfg: DictConfig, required: tuple[str, ...] = ()) -> None:
    """Check a composed train/eval/predict config before anything is loaded.

    Reads raw values (no interpolation is resolved that could itself fail first).

    Args:
        required: top-level keys the entry point needs set (e.g. ``ckpt_path`` for eval).

    Raises:
        ConfigError: with every problem found, one per line.
    """
    problems: list[str] = []

    seed = cfg.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        problems.append(f"seed={seed!r} must be an integer (0 is a seed) or null for no seeding")

    if "batch" in cfg:
        problem = batch_problem(cfg.batch.global_batch_size, cfg.batch.micro_batch_size)
        if problem:
            problems.append(problem)

    if "trainer" in cfg:
        precision = str(cfg.trainer.get("precision"))
        if precision not in PRECISIONS:
            problems.append(f"trainer.precision={precision!r} is not one of {PRECISIONS}; fix: precision=bf16-mixed")

    if "optimizer" in cfg:
        lr = cfg.optimizer.get("lr")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            problems.append(f"optimizer.lr={lr!r} must be a positive number, e.g. optimizer.lr=5e-5")
        weight_decay = cfg.optimizer.get("weight_decay")
        if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            problems.append(f"optimizer.weight_decay={weight_decay!r} must be a number >= 0")

    if "scheduler" in cfg:
        warmup = cfg.scheduler.warmup_ratio
        if not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
            problems.append(f"scheduler.warmup_ratio={warmup!r} must be in [0, 1): the fraction of optimizer steps spent warming up")
        if cfg.scheduler.decay not in DECAYS:
            problems.append(f"scheduler.decay={cfg.scheduler.decay!r} is not one of {DECAYS}")
        min_ratio = cfg.scheduler.min_lr_ratio
        if not isinstance(min_ratio, (int, float)) or not 0 <= min_ratio <= 1:
            problems.append(f"scheduler.min_lr_ratio={min_ratio!r} must be in [0, 1]")

    if "task" in cfg and "data" in cfg:
        problems += _task_problems(cfg)
    if "data" in cfg:
        problems += _data_problems(cfg.data)
    if cfg.get("peft") is not None:
        problems += _peft_problems(cfg.peft, task=cfg.task.name if "task" in cfg else None)

    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if node is not None and "_target_" not in node:
                problems.append(f"{group}.{name} has no _target_; fix: give it one, or disable it with {group}.{name}=null")

    missing = [key for key in required if cfg.get(key) is None]
    for key in missing:
        problems.append(f"{key} is required; fix: {key}={REQUIRED_EXAMPLES[key]}")
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and not Path(ckpt_path).is_file():
        problems.append(f"ckpt_path={ckpt_path!r} is not a file; fix: point it at a .ckpt written by train (RUN/checkpoints/*.ckpt)")

    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))


def _task_problems(cfg: DictConfig) -> list[str]:
    """The data config must be one the task reads (e.g. no classification CSVs for a causal LM)."""
    expected, target = cfg.task.get("datamodule"), cfg.data.get("_target_")
    if expected and target != expected:
        return [
            f"data._target_={target!r} is not the data module of task={cfg.task.name} ({expected}); "
            f"fix: a data config of that task (see configs/data/), or an experiment= that sets both"
        ]
    return []


def _peft_problems(peft: DictConfig, task: str | None) -> list[str]:
    method = peft.get("method")
    if method not in PEFT_METHODS:
        return [f"peft.method={method!r} is not one of {PEFT_METHODS}; fix: peft=lora (or none, qlora)"]
    if method == "none":
        return []
    if task != "causal_lm":
        return [f"peft={method} applies to task=causal_lm only (task={task}); fix: peft=none"]
    problems = []
    r, alpha, dropout = peft.get("r"), peft.get("alpha"), peft.get("dropout")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"peft.r={r!r} must be a positive integer (the LoRA rank), e.g. peft.r=16")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"peft.alpha={alpha!r} must be a positive number (scale = alpha / r), e.g. peft.alpha=32")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"peft.dropout={dropout!r} must be in [0, 1)")
    modules = peft.get("target_modules")
    if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules)):
        problems.append(f"peft.target_modules={modules!r} must be a list of layer names, e.g. peft.target_modules=[q_proj,v_proj]")
    return problems


def _data_problems(data: DictConfig) -> list[str]:
    problems = []
    text_lm = "mode" in data  # the causal-LM text data module; otherwise classification
    for field in ("text_column",) if text_lm else ("text_column", "label_column"):
        value = data.get(field)
        if not isinstance(value, str) or not value:
            problems.append(f"data.{field}={value!r} must name a column of your data, e.g. data.{field}=text")
    if text_lm:
        if data.mode not in TEXT_MODES:
            problems.append(f"data.mode={data.mode!r} is not one of {TEXT_MODES}; fix: data.mode=pack (pretraining) or pad")
        if data.get("sample_by") not in SAMPLE_BY:
            problems.append(f"data.sample_by={data.get('sample_by')!r} is not one of {SAMPLE_BY}")
    max_length = data.get("max_length")
    if not isinstance(max_length, int) or max_length < 8:
        problems.append(f"data.max_length={max_length!r} must be an integer >= 8 (tokens per sequence)")
    fraction = data.get("val_fraction")
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        problems.append(f"data.val_fraction={fraction!r} must be in (0, 1)")
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
