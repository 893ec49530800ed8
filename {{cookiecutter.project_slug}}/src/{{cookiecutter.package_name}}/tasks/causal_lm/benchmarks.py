"""lm-evaluation-harness tasks on a causal LM: ``eval benchmarks.tasks=[...]`` on a checkpoint or an exported folder,
and ``callbacks=benchmarks`` at each validation of a run (docs/tasks/causal_lm.md, "Benchmarks").

lm-eval's public API runs them: ``lm_eval.simple_evaluate`` on its ``HFLM`` wrapper, handed the model and tokenizer already
loaded (no second copy of the weights, nothing re-read from disk). Scores are named ``lm_eval/<task>/<metric>``; a metric
under a filter other than lm-eval's ``none`` gets the filter's name: ``lm_eval/gsm8k/exact_match_strict-match``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch
from lightning.pytorch import Callback
from omegaconf import DictConfig

from ...core.errors import ConfigError
from ...core.models.precision import compute_dtype, is_mixed
from ...core.run.hub import unreachable_reason

# The shipped local task (shakespeare_next_line), always on lm-eval's task path beside benchmarks.include_path.
LOCAL_TASKS = Path(__file__).with_name("lm_eval_tasks")
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' builders of local files
INSTALL = "pip install -e '.[lm_eval]'"


def settings_problems(settings: dict) -> list[str]:
    """What is wrong with the ``benchmarks`` settings (one line each, naming the key and the fix)."""
    problems = []
    tasks = settings.get("tasks")
    if not isinstance(tasks, list) or not tasks or not all(isinstance(name, str) and name for name in tasks):
        problems.append(
            f"benchmarks.tasks={tasks!r} must be a non-empty list of lm-eval task names; fix: benchmarks.tasks=[shakespeare_next_line]"
        )
    limit = settings.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        problems.append(f"benchmarks.limit={limit!r} must be null (every document), a count >= 1 or a share < 1; fix: benchmarks.limit=50")
    shots = settings.get("num_fewshot")
    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        problems.append(
            f"benchmarks.num_fewshot={shots!r} must be null (each task's own) or an integer >= 0; fix: benchmarks.num_fewshot=0"
        )
    batch = settings.get("batch_size")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        problems.append(f"benchmarks.batch_size={batch!r} must be an integer >= 1 (requests a forward pass); fix: benchmarks.batch_size=8")
    folder = settings.get("include_path")
    if folder is not None and not Path(str(folder)).is_dir():
        problems.append(f"benchmarks.include_path={folder!r} is not a folder; fix: a folder of lm-eval task YAML files, or null")
    chat = settings.get("apply_chat_template")
    if chat is not None and not isinstance(chat, bool):
        problems.append(f"benchmarks.apply_chat_template={chat!r} must be null (as the run trained), true or false")
    return problems


def checked_tasks(settings: dict):
    """The ``lm_eval.tasks.TaskManager`` of the shipped and ``include_path`` tasks, once every name in ``settings["tasks"]``
    is known and its data can be read here; called before any weights load.

    Raises:
        ConfigError: bad settings; lm-eval not installed; an unknown task (with the close names); a task whose data set
            is on the Hugging Face Hub while the Hub cannot be reached and the set is not in the local cache (one line,
            naming the task, the data set and how to get it).
    """
    problems = settings_problems(settings)
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ConfigError(f"benchmarks.tasks needs lm-evaluation-harness, which is not installed ({error}); fix: {INSTALL}") from error
    extra = settings.get("include_path")
    paths = [str(LOCAL_TASKS)] + ([str(extra)] if extra and Path(str(extra)).resolve() != LOCAL_TASKS.resolve() else [])
    manager = TaskManager(include_path=paths)
    for name in settings["tasks"]:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            raise ConfigError(
                f"benchmarks.tasks: {name!r} is not an lm-eval task, group or tag (nor in {' or '.join(paths)})"
                + (f"; close: {', '.join(close)}" if close else "")
                + "; fix: a name from `lm_eval ls tasks`, or a task folder in benchmarks.include_path"
            )
    hub = {task: path for task, path in hub_datasets(manager, settings["tasks"]).items() if not cached_dataset(path)}
    reason = unreachable_reason() if hub else None
    if reason is not None:
        named, many = ", ".join(f"{task!r} ({path})" for task, path in hub.items()), len(hub) > 1
        fetch = " && ".join(f"hf download {path} --repo-type dataset" for path in dict.fromkeys(hub.values()))
        raise ConfigError(
            f"benchmarks.tasks: lm-eval {'tasks' if many else 'task'} {named} {'read their data sets' if many else 'reads its data set'} "
            f"from the Hugging Face Hub, which cannot be reached ({reason}), and {'they are' if many else 'it is'} not in the local "
            "cache; fix: on a machine with "
            f"internet run `{fetch}`, copy its ~/.cache/huggingface here and set HF_HUB_OFFLINE=1, or use a local task "
            "(benchmarks.include_path)"
        )
    return manager


def hub_datasets(manager, names: list) -> dict[str, str]:
    """``{task: Hub data set}`` of every task the names select (groups and tags expanded) whose data is neither a local
    builder (``json``...), a local path, nor read by a task's own ``custom_dataset`` function; from lm-eval's task index."""
    index, found, seen, todo = manager.task_index, {}, set(), list(names)
    while todo:
        item = todo.pop(0)  # (in the order named)
        name = item.get("task") if isinstance(item, dict) else item
        if not isinstance(name, str) or name in seen or name not in index:
            continue
        seen.add(name)
        entry = index[name]
        config = entry.cfg or {}
        if entry.kind.name == "TAG":
            todo += [other for other, e in index.items() if name in (e.tags or ())]
        elif entry.kind.name == "GROUP":
            members = config.get("task") or []
            todo += members if isinstance(members, list) else [members]
        else:
            path = config.get("dataset_path")
            if path and not config.get("custom_dataset") and path not in LOCAL_BUILDERS and not os.path.exists(path):
                found[name] = path
    return found


def cached_dataset(path: str) -> bool:
    """A Hub data set in the Hugging Face Hub cache or in ``datasets``' cache (as ``org___name``)."""
    import datasets
    from huggingface_hub import scan_cache_dir

    if Path(datasets.config.HF_DATASETS_CACHE, path.replace("/", "___")).exists():
        return True
    try:
        return any(repo.repo_type == "dataset" and repo.repo_id == path for repo in scan_cache_dir().repos)
    except Exception:  # CacheNotFound (no Hub cache yet) and its kin: nothing cached
        return False


def run_benchmarks(model: torch.nn.Module, tokenizer, settings: dict, manager, chat: bool, system_prompt: str | None = None, **options):
    """lm-eval's results dict for ``settings["tasks"]`` on ``model`` (a ``*ForCausalLM``, adapters on or merged) as it is:
    its device and dtype; ``chat``: lm-eval's ``apply_chat_template=True`` (the tokenizer's template, ``system_prompt`` as its
    ``system_instruction``). ``options`` go to ``simple_evaluate`` (the callback: no seeding, no bootstrap); ``max_length``
    (its longest request, left-truncated) and ``mixed_precision_dtype`` (its autocast) to ``HFLM``."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    wrapper = {key: options.pop(key) for key in ("max_length", "mixed_precision_dtype") if key in options}
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings["batch_size"], **wrapper)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(settings["tasks"]),
        num_fewshot=settings.get("num_fewshot"),
        limit=settings.get("limit"),
        apply_chat_template=chat,
        system_instruction=system_prompt if chat else None,
        task_manager=manager,
        log_samples=False,
        **options,
    )


def scores(results: dict) -> dict[str, float]:
    """``{"lm_eval/<task>/<metric>": value}`` of every metric in lm-eval's results (``<metric>,<filter>`` keys; stderr
    included, "N/A" left out)."""
    found = {}
    for task, row in results["results"].items():
        for key, value in row.items():
            metric, comma, kind = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, (int, float)):  # (alias, sample_len, "N/A")
                continue
            found[f"lm_eval/{task}/{metric if kind in ('', 'none') else f'{metric}_{kind}'}"] = float(value)
    return found


def benchmark_report(results: dict, settings: dict, config: dict, source: str) -> dict:
    """What ``benchmarks.json`` holds: lm-eval's results, its version, the task versions and shots, the settings, and the
    sha256 of the run's resolved config (``config_hash``)."""
    return {
        "source": source,
        "lm_eval_version": version("lm_eval"),
        "settings": settings,
        "config_hash": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "results": results["results"],
        "groups": results.get("groups", {}),
        "versions": results.get("versions", {}),
        "n-shot": results.get("n-shot", {}),
        "n-samples": results.get("n-samples", {}),
        "higher_is_better": results.get("higher_is_better", {}),
    }


def print_table(results: dict) -> None:
    """One row per task and metric: value, stderr, shots and lm-eval's filter (rich; versions are in ``benchmarks.json``)."""
    from rich.console import Console
    from rich.table import Table

    shown = Table()
    shown.add_column("task", no_wrap=True)
    for name in ("metric", "value", "stderr", "n-shot", "filter"):
        shown.add_column(name)
    for task, row in results["results"].items():
        for key, value in row.items():
            metric, comma, kind = key.partition(",")
            if comma and "_stderr" not in metric and isinstance(value, (int, float)):
                stderr = row.get(f"{metric}_stderr,{kind}")
                error = f"{stderr:.4f}" if isinstance(stderr, (int, float)) else ""
                shown.add_row(task, metric, f"{value:.4f}", error, str(results.get("n-shot", {}).get(task, "")), kind)
    Console().print(shown)


def benchmark_phase(settings: DictConfig, config, value_bytes: int) -> dict:
    """An lm-eval pass's peak beside the weights, the last step's gradients and the optimizer state: ``batch_size``
    requests of ``max_length`` tokens under no grad, with their logits (B x L x V values) and lm-eval's fp32 log-softmax of
    them (B x L x V x 4 bytes), one layer's MLP activations (3 x intermediate values a token) and the residual stream."""
    rows, length = int(settings.batch_size), int(settings.max_length)
    logits = rows * length * config.vocab_size * (value_bytes + 4)
    mlp = 3 * rows * length * getattr(config, "intermediate_size", 4 * config.hidden_size) * value_bytes
    return {"activations": 2 * rows * length * config.hidden_size * value_bytes, "temporaries": logits + mlp, "grads": True}


class Benchmarks(Callback):
    """lm-eval tasks at each validation (the one before the first step included: ``lm_eval/..._start`` in ``metrics.json``),
    logged as ``lm_eval/<task>/<metric>`` at the step; ``limit`` documents a task (a small one: each call costs its
    requests' forward passes, docs/tasks/causal_lm.md). No seeding (the run's RNG streams are left as they are) and no
    stderr (lm-eval's ``bootstrap_iters=0``). Requests longer than ``max_length`` are cut from the left.

    Raises:
        ConfigError: bad settings, an unknown task or unreachable data (:func:`checked_tasks`), when built; more than one
            process (DDP/FSDP: run ``eval benchmarks.tasks=...`` on the checkpoint instead), at setup.
    """

    def __init__(
        self,
        tasks: list,
        max_length: int,
        limit: int | float | None = 50,
        num_fewshot: int | None = None,
        batch_size: int = 8,
        include_path: str | None = None,
        apply_chat_template: bool | None = None,
    ) -> None:
        self.settings = {
            "tasks": list(tasks),
            "limit": limit,
            "num_fewshot": num_fewshot,
            "batch_size": batch_size,
            "include_path": include_path,
            "apply_chat_template": apply_chat_template,
        }
        self.manager = checked_tasks(self.settings)
        self.max_length = max_length

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.world_size > 1:
            raise ConfigError(
                f"callbacks.benchmarks runs on one process, and this run has {trainer.world_size}; fix: callbacks=default, then "
                "eval ckpt_path=... benchmarks.tasks=[...] on the checkpoint"
            )

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        chat = self.settings["apply_chat_template"]
        chat = pl_module.chat if chat is None else chat
        precision = str(trainer.precision)  # *-mixed: lm-eval's own autocast (it switches any outer one off)
        results = run_benchmarks(
            pl_module.model,
            pl_module.tokenizer,
            self.settings,
            self.manager,
            chat,
            pl_module.inputs.system_prompt,
            max_length=self.max_length,
            mixed_precision_dtype=compute_dtype(precision) if is_mixed(precision) else None,
            bootstrap_iters=0,
            random_seed=None,
            numpy_random_seed=None,
            torch_random_seed=None,
        )
        for key, value in scores(results).items():
            pl_module.log(key, value)


def evaluate_benchmarks(cfg: DictConfig, load, run_dir: Path) -> dict:
    """``eval benchmarks.tasks=[...]``: check the tasks, then ``load()`` the module (a checkpoint's or an exported folder's;
    on the GPU when there is one), run them, print lm-eval's table, write ``run_dir/benchmarks.json`` and return the scores
    (``lm_eval/<task>/<metric>``). ``benchmarks.apply_chat_template: null`` applies the chat template when the model was
    trained on chat rows (lm-eval's ``--apply_chat_template``, the run's ``data.system_prompt`` as ``--system_instruction``).

    Raises:
        ConfigError: see :func:`checked_tasks` (before anything loads).
    """
    from ...core.config.resolvers import to_plain
    from ...core.run.entry import atomic_write_path

    settings = to_plain(cfg.benchmarks)
    manager = checked_tasks(settings)
    module = load()
    if torch.cuda.is_available():
        module.cuda()
    chat = module.chat if settings.get("apply_chat_template") is None else settings["apply_chat_template"]
    system_prompt = module.inputs.system_prompt if module.inputs is not None else None
    with torch.inference_mode():
        results = run_benchmarks(module.model.eval(), module.tokenizer, settings, manager, chat, system_prompt)
    print_table(results)
    source, used = str(cfg.ckpt_path or cfg.model_dir), {**settings, "apply_chat_template": chat}  # (null resolved)
    with atomic_write_path(run_dir / "benchmarks.json") as partial:
        partial.write_text(json.dumps(benchmark_report(results, used, to_plain(cfg), source), indent=2, default=str), encoding="utf-8")
    print(f"Benchmarks: {run_dir / 'benchmarks.json'}")
    return scores(results)
