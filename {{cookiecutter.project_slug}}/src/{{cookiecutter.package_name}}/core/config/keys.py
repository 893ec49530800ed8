"""Config typos caught by signature, before anything loads.

A key added with ``+`` or written in an experiment YAML (``weight_decy: 0.1``) reaches the config
past Hydra's struct mode, then fails deep in a library or is silently ignored.
:func:`unknown_key_problems` binds the keys of every ``_target_`` node to the callable's signature
(torchtune's ``tune validate`` habit) and checks the other nodes against the keys declared here:
:data:`OWN_KEYS` (read by this project, stripped before the call), :data:`NAMED_NODES` (named by a
word of the project's tables: :mod:`.named`), :data:`GROUP_KEYS` (groups without a ``_target_``, and
the top level), :data:`FREE_FORM` (someone else's keys: ``model.config``), :data:`FORWARDS` (where a
``**kwargs`` callable sends its extra keys).  A task's own groups are bound to its specs
(``Task.config_groups``).
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
from collections.abc import Callable, Iterator

import hydra
from omegaconf import DictConfig, OmegaConf

from .named import OPTIMIZERS, class_path_of, model_fetchers

# Config groups renamed where the old name misled (old -> new).  The old name still selects a file
# of the new group on the command line or in a defaults list (configs/<old>/ holds thin aliases,
# each warned about by config_warnings), but a node or a key under the old name reaches nothing:
# refused, naming the new key (here, and on the command line by core/run/entry.command_line_problems).
RENAMED_GROUPS: dict[str, str] = {"checkpointing": "activation_checkpointing", "scheduler": "lr_schedule"}

# Keys Hydra's instantiate reads itself.
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})

# Keys of a _target_ group that are ours: read by this project, not passed to the callable.
OWN_KEYS: dict[str, frozenset[str]] = {
    "optimizer": frozenset({"name", "fused", "step_in_backward"}),  # core/optim.py: the class by name; fused=null; step inside backward
}

# Groups (and the top level) without a _target_: every key they may hold.
GROUP_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {  # the top level that every entry point shares (ENTRY_KEYS adds each one's own)
            "task_name",
            "seed",
            "ckpt_path",
            "resume",
            "optimized_metric",
            "plan_before_fit",
            "test_after_fit",
            "print_config",
            "task",
            "model",
            "data",
            "peft",
            "pruning",
            "qat",
            "hardware",
            "batch",
            "attention",
            "activation_checkpointing",
            "compile",
            "loss",
            "optimizer",
            "lr_schedule",
            "callbacks",
            "logger",
            "trainer",
            "paths",
            "benchmarks",  # causal-LM projects: lm-eval tasks (eval benchmarks.tasks=..., callbacks=benchmarks)
        }
    ),
    "task": frozenset(
        {"name", "module", "module_args", "datamodules", "monitor", "monitor_mode", "objectives", "validate_before_fit", "requires"}
    ),
    "model": frozenset({"name_or_path", "tokenizer", "config", "fetch", "architecture", "finetune_lr"}),
    "peft": frozenset(
        {
            "method",
            "r",
            "alpha",
            "dropout",
            "target_modules",
            "use_dora",
            "use_rslora",
            "loraplus_lr_ratio",
            "init_lora_weights",
            "quant_type",
            "double_quant",
        }
    ),
    "pruning": frozenset({"method", "begin_step", "end_step", "final_sparsity", "frequency"}),
    "qat": frozenset({"scheme", "group_size"}),
    "resume": frozenset({"allow_changed"}),
    "hardware": frozenset(
        {
            "name",
            "budget_gib",
            "peak_tflops",
            "peak_tflops_fp32",
            "memory_gbps",
            "op_overhead_us",
            "step_overhead_ms",
            "kernels_overlap",
            "pcie_gbps",
            "bf16",
            "tf32",
            "context_gib",
            "host_budget_gib",
        }
    ),
    "plan": frozenset({"mode", "max_length", "length_step", "key", "max_value", "top", "train_examples"}),
    "batch": frozenset({"global_batch_size", "micro_batch_size", "device_batch_size", "accumulate_grad_batches"}),
    "attention": frozenset({"implementation"}),
    "activation_checkpointing": frozenset({"mode", "offload", "offload_min_bytes", "mlp_tiles"}),
    "compile": frozenset({"mode"}),
    "loss": frozenset({"implementation", "chunk_size"}),
    "paths": frozenset({"root_dir", "data_dir", "log_dir", "output_dir", "cache_dir"}),
    "benchmarks": frozenset({"tasks", "limit", "num_fewshot", "batch_size", "include_path", "apply_chat_template"}),
    "latency": frozenset({"device", "batch_size", "sequence_length", "warmup", "repeats"}),  # quantize
}
# Top-level keys that only one entry config reads (by task_name; train and eval read none extra).
ENTRY_KEYS: dict[str, frozenset[str]] = {
    "plan": frozenset({"plan"}),
    "eval": frozenset({"model_dir", "overwrite"}),
    "inspect_data": frozenset({"split", "rows", "first_row", "color"}),
    "predict": frozenset({"input", "output", "overwrite"}),
    "generate": frozenset({"model_dir", "prompts", "prompts_file", "output", "generation", "overwrite"}),
    "chat": frozenset({"model_dir", "max_length", "generation"}),
    "serve": frozenset({"model_dir", "host", "port", "allow_remote", "model_name", "generation"}),
    "export": frozenset({"output_dir", "format", "outtype", "dtype", "overwrite", "measure"}),
    "quantize": frozenset({"model_dir", "output_dir", "variants", "unavailable", "group_size", "latency", "overwrite"}),
}
# Arguments of a _target_ that this project passes itself: never from the config.
SET_BY_PROJECT: dict[str, frozenset[str]] = {
    "lightning.pytorch.Trainer": frozenset({"callbacks", "logger"}),  # from the callbacks and logger groups
    "optimizer": frozenset({"params"}),  # the parameter groups (optim.param_groups)
}
# Nodes that name what they build by a key of one of the project's tables (core/config/named.py), never by
# a class path (checkpoints store them): node -> (the naming key, the table, how to add an entry).
NAMED_NODES: dict[str, tuple[str, Callable[[], dict[str, str]], str]] = {
    "optimizer": ("name", lambda: OPTIMIZERS, "add yours to OPTIMIZERS in core/config/named.py"),
    "model.fetch": ("kind", model_fetchers, "declare yours as MODEL_FETCHER in a module of core/assets/"),
}
# Free-form nodes that hold a transformers config's fields (checked by its class), with the keys
# of ours they may hold besides.
HF_CONFIG_NODES: dict[str, frozenset[str]] = {
    "model.config": frozenset({"model_type"}),
    "model.architecture": frozenset({"model_type", "of"}),  # `of`: the model these numbers describe
    "generation": frozenset({"batch_size"}),  # (ours: prompts a generate call, not passed to transformers)
}
# Nodes whose own keys are not ours to check (dotted paths from the top).
FREE_FORM = frozenset(
    {
        *HF_CONFIG_NODES,  # transformers config fields: checked by their class (_hf_config_problem)
        "task.objectives",
        "task.requires",
        "callbacks",
        "logger",  # their entries are checked one by one as _target_ nodes
    }
)
PACKAGE = __package__.split(".")[0]
# Callables with **kwargs: where the extra keys go (checked against that signature as well).
# Keyed by where each is defined (``__module__.__qualname__``), so any import path finds it.
FORWARDS: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.loggers.wandb.WandbLogger": ("wandb.init",),
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger": ("torch.utils.tensorboard.SummaryWriter",),
    f"{PACKAGE}.core.loggers.csv_log.ResumableCSVLogger": ("lightning.pytorch.loggers.CSVLogger",),
    f"{PACKAGE}.core.loggers.trackers.WandbLogger": ("lightning.pytorch.loggers.WandbLogger", "wandb.init"),
    f"{PACKAGE}.core.loggers.trackers.TensorBoardLogger": (
        "lightning.pytorch.loggers.TensorBoardLogger",
        "torch.utils.tensorboard.SummaryWriter",
    ),
    f"{PACKAGE}.core.run.distributed.fsdp_strategy": (
        "lightning.pytorch.strategies.FSDPStrategy",
        "torch.distributed.fsdp.FullyShardedDataParallel",  # where FSDPStrategy sends its own **kwargs
    ),
}
# Packages whose absence another check names with its install line (optional extras).
OPTIONAL_PACKAGES = frozenset({"bitsandbytes", "liger_kernel", "flash_attn", "tensorboard", "hydra_plugins"})


def unknown_key_problems(cfg: DictConfig, task_groups: dict[str, type] | None = None) -> list[str]:
    """Every key of ``cfg`` that nothing reads: one line per node, naming the key, the node and
    the valid keys (the closest match first, when one is close).

    Reads keys only (no interpolation is resolved).  A ``_target_`` that cannot be imported is a
    problem too, unless its package is an optional extra (another check names its install line).
    """
    plain = OmegaConf.to_container(cfg, resolve=False)
    groups = {name: frozenset(inspect.signature(spec).parameters) for name, spec in (task_groups or {}).items()}
    problems = []
    for old in set(RENAMED_GROUPS) & set(plain):
        node = plain.pop(old)
        problems += [renamed_key_problem(f"{old}.{key}") for key in (node if isinstance(node, dict) else {"<key>": node})]
    for path, node in _nodes(plain, ""):
        if path in NAMED_NODES:
            problem = _named_problem(path, node)
        elif "_target_" in node:
            problem = _target_problem(path, node)
        else:
            problem = _group_problem(path, node, plain.get("task_name"), groups)
        if problem:
            problems.append(problem)
    for path in HF_CONFIG_NODES:
        node = _get(plain, path)
        problem = _hf_config_problem(path, node) if isinstance(node, dict) else None
        if problem:
            problems.append(problem)
    return problems


def renamed_key_problem(key: str, value: str | None = None) -> str | None:
    """The line refusing ``key`` (dotted, with ``value`` as typed on a command line) when it sits
    under a renamed group (:data:`RENAMED_GROUPS`), naming the key to use; ``None`` otherwise."""
    old, _, rest = key.partition(".")
    if old not in RENAMED_GROUPS or not rest:
        return None
    new = RENAMED_GROUPS[old]
    typed = f"{key}={value}" if value is not None else key
    return (
        f"{typed}: the {old} group is now named {new}, and nothing reads {old}.*; "
        f"fix: {new}.{rest}{'=' + value if value is not None else ''} (in a YAML file: rename its {old}: node to {new}:)"
    )


def _get(plain: dict, path: str) -> object:
    for key in path.split("."):
        plain = plain.get(key) if isinstance(plain, dict) else None
    return plain


def _hf_config_problem(path: str, node: dict) -> str | None:
    """Keys of a Hugging Face config node (``model.config``, ``model.architecture``) must be fields
    of the config class of its ``model_type`` (or their aliases, GPT-2's ``hidden_size`` for
    ``n_embd``); ``generation`` must hold GenerationConfig fields.  transformers' classes accept
    any attribute, so a typo would otherwise be kept and never read."""
    import transformers

    if path == "generation":
        config = transformers.GenerationConfig()
    else:
        model_type = node.get("model_type")
        if model_type is None:
            return (
                f"{path} has no model_type, so its keys ({', '.join(map(str, node))}) cannot be checked or used; "
                f"fix: {path}.model_type=<the transformers model family, e.g. bert, llama, gpt2>"
            )
        if not isinstance(model_type, str) or model_type.startswith("${"):
            return None
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except (ValueError, KeyError) as error:
            return f"{path}.model_type={model_type!r} is not a transformers model family ({str(error).splitlines()[0][:200]})"
    fields = {key for key in config.to_dict() if not key.startswith("_") and key != "transformers_version"}
    fields |= set(getattr(config, "attribute_map", {}))
    if "rope_parameters" in fields:  # the older spellings transformers still converts into rope_parameters
        fields |= {"rope_theta", "rope_scaling"}
    valid = frozenset(fields) | HF_CONFIG_NODES[path]
    return _unknown(path, set(node) - valid, valid, f"fields of transformers' {type(config).__name__}")


def accepted_keys(target: str) -> tuple[frozenset[str], bool]:
    """The keyword arguments ``target`` accepts, and whether that list is complete.

    A callable with ``**kwargs`` is complete only when :data:`FORWARDS` names where they go.

    Raises:
        ImportError: ``target`` (or what it forwards to) cannot be imported.
    """
    try:
        function = hydra.utils.get_object(target)
    except Exception as error:  # hydra wraps ImportError/AttributeError in its own type
        raise ImportError(" ".join(line.strip() for line in str(error).splitlines() if line.strip())[:400]) from error
    keys, complete = _parameters(function)
    defined_at = f"{function.__module__}.{function.__qualname__}"
    for forwarded in FORWARDS.get(defined_at, ()) if not complete else ():
        try:
            more, complete = _parameters(hydra.utils.get_object(forwarded))
        except Exception:  # an optional package (tensorboard for its SummaryWriter) is missing: unchecked
            return keys, False
        keys |= more
    if not complete and defined_at not in FORWARDS and inspect.isclass(function):
        # A class of this project passing **shared up to its base's __init__ (the data modules).
        for base in function.__mro__[1:]:
            if not base.__module__.startswith(f"{PACKAGE}.") or complete:
                break
            if "__init__" in vars(base):
                more, complete = _parameters(base.__init__)
                keys |= more - {"self"}
    return keys, complete


def _parameters(function: object) -> tuple[frozenset[str], bool]:
    parameters = inspect.signature(function).parameters.values()
    names = frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, not any(p.kind == p.VAR_KEYWORD for p in parameters)


def _nodes(node: object, path: str) -> Iterator[tuple[str, dict]]:
    """Every mapping below ``node`` (a plain container; lists walked too) with its dotted path;
    below a :data:`FREE_FORM` node only its ``_target_`` nodes."""
    if isinstance(node, dict):
        if path not in FREE_FORM or "_target_" in node:
            yield path, node
        for key, child in node.items():
            if path not in FREE_FORM or (isinstance(child, dict) and "_target_" in child):
                yield from _nodes(child, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from _nodes(child, f"{path}[{index}]")


def _target_problem(path: str, node: dict) -> str | None:
    target = str(node["_target_"])
    group = path.split(".")[0].split("[")[0]
    if target.startswith("${"):
        return None
    try:
        accepted, complete = accepted_keys(target)
    except ImportError as error:
        if target.split(".")[0] in OPTIONAL_PACKAGES and importlib.util.find_spec(target.split(".")[0]) is None:
            return None
        return f"{_name(path, '_target_')}={target!r} cannot be imported ({error}); fix: a dotted path to a class or function that exists"
    if not complete:
        return None  # a **kwargs callable with no known destination (or one whose package is missing)
    if path == group:
        accepted = accepted | OWN_KEYS.get(group, frozenset())
    set_here = SET_BY_PROJECT.get(target, frozenset()) | (SET_BY_PROJECT.get(group, frozenset()) if path == group else frozenset())
    valid = accepted - set_here
    clash = sorted(set(node) & set_here)
    if clash:
        return f"{_name(path, clash[0])} is set by this project, not by the config; fix: remove it (valid keys: {', '.join(sorted(valid))})"
    return _unknown(path, set(node) - HYDRA_KEYS - valid, valid, f"arguments of {target}")


def _named_problem(path: str, node: dict) -> str | None:
    """A :data:`NAMED_NODES` node: its name must be a key of its table, and its other keys
    arguments of what that key names (plus the group's own keys)."""
    key, table_of, how_to_add = NAMED_NODES[path]
    table = table_of()
    if "_target_" in node:
        return (
            f"{_name(path, '_target_')}={node['_target_']!r}: {path} names what it builds by {key}, not by a class path "
            f"(checkpoints store it); fix: {_name(path, key)}=<one of {sorted(table)}> ({how_to_add})"
        )
    name = node.get(key)
    if isinstance(name, str) and name.startswith("${"):
        return None
    if name not in table:
        close = difflib.get_close_matches(str(name), table, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{_name(path, key)}={name!r} is not one of {sorted(table)}: {hint}fix: one of those, or {how_to_add}"
    target = class_path_of(table, name)
    try:
        accepted, complete = accepted_keys(target)
    except ImportError:
        if target.split(".")[0] in OPTIONAL_PACKAGES and importlib.util.find_spec(target.split(".")[0]) is None:
            return None  # (another check names its install line)
        return f"{_name(path, key)}={name!r}: {target} is not in this project (a single-task bake?); fix: one of the others"
    if not complete:
        return None
    group = path.split(".")[0]
    own = OWN_KEYS.get(group, frozenset()) if path == group else frozenset({key})
    set_here = SET_BY_PROJECT.get(group, frozenset()) if path == group else frozenset()
    valid = (accepted | own | {key}) - set_here
    clash = sorted(set(node) & set_here)
    if clash:
        return f"{_name(path, clash[0])} is set by this project, not by the config; fix: remove it (valid keys: {', '.join(sorted(valid))})"
    return _unknown(path, set(node) - valid, valid, f"arguments of {target}")


def _group_problem(path: str, node: dict, entry: str | None = None, task_groups: dict[str, frozenset[str]] | None = None) -> str | None:
    known = {**GROUP_KEYS, **(task_groups or {})}
    if path not in known:
        return None  # an inner node (data.splits, ...): the group's own rules check it
    valid = known[path] | (frozenset(task_groups or ()) if path == "" else frozenset())
    if path == "":  # the shared keys, and those of this entry point (all of them for an unknown task_name)
        valid |= ENTRY_KEYS.get(entry, frozenset() if entry in ("train", "eval", "plan") else frozenset().union(*ENTRY_KEYS.values()))
    return _unknown(path, set(node) - valid, valid, "keys this project reads" + (f" in {entry}" if path == "" and entry else ""))


def _unknown(path: str, unknown: set, valid: frozenset[str], what: str) -> str | None:
    if not unknown:
        return None
    if not valid:
        return f"{_name(path, sorted(unknown, key=str)[0])} is not a key of {path}: there are no {what} (fix: remove it)"
    key = sorted(unknown, key=str)[0]
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f"did you mean {_name(path, close[0])}? " if close else ""
    others = f" (and {sorted(map(str, unknown))[1:]})" if len(unknown) > 1 else ""
    return f"{_name(path, key)} is not a key of {path or 'the top level'}{others}: {hint}valid keys ({what}): {', '.join(sorted(valid))}"


def _name(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)
