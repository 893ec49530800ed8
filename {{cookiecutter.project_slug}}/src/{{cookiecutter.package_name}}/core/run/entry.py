"""What every run writes and prints: the config tree, ``metrics.json``, closed loggers."""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
import rich.syntax
import rich.tree
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import InstantiationException, OverrideParseException
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ..config.keys import renamed_key_problem
from ..errors import ConfigError, DataError
from .secrets import mask

log = logging.getLogger(__name__)

# Printed first, in this order; the rest follow alphabetically.
TREE_ORDER = ("task", "model", "data", "batch", "optimizer", "lr_schedule", "trainer", "callbacks", "logger", "paths")


# Overrides whose value is a folder this run creates or writes into.
FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "paths.output_dir", "paths.log_dir", "paths.cache_dir")
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def command_line_problems(args: list[str]) -> list[str]:
    """One line for each command-line override that Hydra would refuse with a parser message
    naming no key, or whose folder is a file (Hydra would fail creating it, with a traceback).

    Flags (``-m``, ``--cfg job``, ``--config-name=...``) are left to Hydra.  Only the typed value
    is seen here: a folder that an interpolation builds is checked where it is used.
    """
    problems, parser = [], OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as error:
            reason = str(error).strip().splitlines()[0]
            problems.append(
                f"{arg!r}: the value of {key} is not valid override syntax ({reason}); fix: quote a value holding spaces, "
                f"brackets, commas or quotes, e.g. {key}='\"...\"' in the shell (grammar: {GRAMMAR})"
            )
            continue
        renamed = renamed_key_problem(key, arg.split("=", 1)[1])
        if renamed:
            problems.append(renamed)
            continue
        value = override.value()
        if key in FOLDER_KEYS and isinstance(value, str) and Path(value).exists() and not Path(value).is_dir():
            problems.append(f"{key}={value!r} is a file, not a folder; fix: {key}=<a folder path> (it is created if missing)")
    return problems


# Warnings a user can do nothing about, by the start of their message: Lightning's own use of a
# torch API that torch 2.10 deprecated (lightning/pytorch/utilities/_pytree.py), once per run.
IGNORED_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)


def quiet_terminal() -> None:
    """What an entry point leaves off the terminal: the ``datasets`` progress bars ("Generating
    train split", one per split and map) and :data:`IGNORED_WARNINGS`.  Log lines go by level
    (``configs/hydra/default.yaml``); the config tree by ``print_config``."""
    import warnings

    import datasets

    datasets.disable_progress_bars()
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def hydra_main(config_name: str):
    """``hydra.main`` for an entry point of this package (its ``configs/``, version_base 1.3),
    with the command line checked first (:func:`command_line_problems`): a bad override exits 1
    with one line per problem naming the key, before Hydra composes or creates anything."""

    def decorate(task_function):
        hydra_entry = hydra.main(version_base="1.3", config_path="configs", config_name=config_name)(task_function)

        @functools.wraps(task_function)
        def main(cfg_passthrough: DictConfig | None = None):
            quiet_terminal()
            if cfg_passthrough is None:
                problems = command_line_problems(sys.argv[1:])
                if problems:
                    print("Error: invalid command line:\n  - " + "\n  - ".join(problems), file=sys.stderr, flush=True)
                    sys.exit(1)
            return hydra_entry(cfg_passthrough)

        return main

    return decorate


def print_config_tree(cfg: DictConfig, save_to: Path, show: bool = True) -> None:
    """Save the resolved config as a rich tree to ``save_to`` and, with ``show``, print it
    (``train`` shows it only with ``print_config=true``), secrets masked (:func:`.secrets.mask`)."""
    tree = rich.tree.Tree("CONFIG", style="dim")
    keys = [k for k in TREE_ORDER if k in cfg] + sorted(k for k in cfg if k not in TREE_ORDER and k != "hydra")
    for key in keys:
        node = cfg[key]
        text = mask(OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node))
        tree.add(key, style="bold").add(rich.syntax.Syntax(text, "yaml"))
    if show:
        Console().print(tree)
    save_to.parent.mkdir(parents=True, exist_ok=True)
    with save_to.open("w") as file:
        Console(file=file, width=120, color_system=None).print(tree)


# The copy of the composed config Hydra would write (hydra.output_subdir): written by us instead
# (configs/hydra/default.yaml turns Hydra's off), after the run folder is checked and secrets masked.
RUN_CONFIG_DIR = ".hydra"
RUN_CONFIG_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def save_run_config(cfg: DictConfig, run_dir: Path) -> None:
    """Write ``.hydra/config.yaml`` (the task's config as composed, interpolations unresolved),
    ``hydra.yaml`` and ``overrides.yaml`` into ``run_dir``, as Hydra does, with secrets masked
    (:func:`.secrets.mask`); nothing outside a Hydra app (tests composing configs)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    folder = run_dir / RUN_CONFIG_DIR
    folder.mkdir(parents=True, exist_ok=True)
    contents = {
        "config.yaml": OmegaConf.to_container(cfg, resolve=False),
        "hydra.yaml": {"hydra": OmegaConf.to_container(hydra_cfg, resolve=False)},
        "overrides.yaml": list(hydra_cfg.overrides.task),
    }
    for name, content in contents.items():
        OmegaConf.save(OmegaConf.create(mask(content)), folder / name)


def write_metrics(path: Path, metrics: dict, announce: bool = True) -> Path:
    """Write ``metrics`` as JSON (NaN/inf become null, which JSON cannot hold) and, with
    ``announce``, print where (``train`` shows it in its results instead)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    log.info("Metrics written to %s", path)
    if announce:
        print(f"Metrics: {path}")
    return path


def close_loggers(loggers: list[Logger], failed: bool) -> None:
    """Finish each W&B run of this Hydra job, with a failing exit code if the job failed.

    One W&B run per job: without this, the next job of a multirun would re-use the open run.
    """
    for logger in loggers:
        logger.finalize("failed" if failed else "success")  # (our WandbLogger sends its held row here)
        if isinstance(logger, WandbLogger):
            import wandb

            if wandb.run is not None:  # the run this job's logger started (logger.experiment would start one)
                wandb.run.finish(exit_code=1 if failed else 0)


@contextmanager
def atomic_write_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (``.<name>.partial``) to write; on success it is
    flushed to disk and renamed onto ``path`` (``os.replace``: atomic on one file system), on
    error it is deleted.  So ``path`` is either the complete new file or what it was before,
    never half-written (a kill leaves at most the ``.partial`` file, which the next write of the
    same path replaces)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        with partial.open("rb+") as file:
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Around an entry point's work: a :class:`ConfigError` or :class:`DataError` (bad input; its
    message names the field, the value and the fix) is printed alone and exits with code 1,
    instead of under the traceback Hydra prints for other errors.  Also when Hydra's
    ``instantiate`` wrapped it (a callback refusing its arguments).  A full disk (``ENOSPC``,
    ``EDQUOT``) is one line too, with the fix."""
    try:
        yield
    except (ConfigError, DataError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        if not isinstance(cause, (ConfigError, DataError)):
            raise
        print(f"Error: {cause}", file=sys.stderr, flush=True)
        sys.exit(1)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {error.filename}" if error.filename else ""
        print(
            f"Error: the disk is full{where} ({error.strerror}); fix: free space on that disk and run the command again",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


@contextmanager
def exit_cleanly_on_sigterm(outcome: str = "the partial output is removed") -> Iterator[None]:
    """Around an entry point's work: SIGTERM (``kill``, a scheduler's time limit) raises
    ``SystemExit(143)`` in the main thread, printing ``Stopped by SIGTERM: <outcome>``, so the
    ``with`` blocks unwind (``export``/``quantize`` remove their temporary folder) and the exit
    code says "killed".  Inside Lightning's test and predict loops this matters twice over:
    Lightning alone would end a SIGTERM there with exit code 0 (test) or not at all (predict),
    so a killed ``eval`` or ``predict`` would count as done.  The previous handler is restored on
    the way out."""

    def stop(signum: int, frame: object) -> None:
        print(f"Stopped by {signal.Signals(signum).name}: {outcome}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
