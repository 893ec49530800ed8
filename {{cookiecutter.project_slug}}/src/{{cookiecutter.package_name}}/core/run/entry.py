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
from .secrets import credential_problem, mask

log = logging.getLogger(__name__)

# Printed first, in this order; the rest follow alphabetically.
TREE_ORDER = ("task", "model", "data", "batch", "optimizer", "lr_schedule", "trainer", "callbacks", "logger", "paths")


# Overrides whose value is a folder this run creates or writes into.
FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "paths.output_dir", "paths.log_dir", "paths.cache_dir")
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def command_line_problems(args: list[str]) -> list[str]:
    """One line per override Hydra would refuse without naming the key (bad syntax, renamed key, a folder key that is a file).

    Flags (``-m``, ``--cfg job``...) are left to Hydra; folders built by interpolation are checked where used.
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
        credential = credential_problem(key, arg.split("=", 1)[1])  # (as typed: before Hydra writes it anywhere)
        if credential:
            problems.append(credential)
            continue
        if key in FOLDER_KEYS and isinstance(value, str) and Path(value).exists() and not Path(value).is_dir():
            problems.append(f"{key}={value!r} is a file, not a folder; fix: {key}=<a folder path> (it is created if missing)")
    return problems


# Unactionable warnings (message start): Lightning's use of an API torch 2.10 deprecated (lightning/pytorch/utilities/_pytree.py).
IGNORED_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)


def quiet_terminal() -> None:
    """Keep the ``datasets`` progress bars and :data:`IGNORED_WARNINGS` off the terminal."""
    import warnings

    import datasets

    datasets.disable_progress_bars()
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def hydra_main(config_name: str):
    """``hydra.main`` (``configs/``, version_base 1.3) that first exits 1 on :func:`command_line_problems`, before Hydra
    composes or creates anything."""

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
    """Save the resolved config as a rich tree to ``save_to`` (and print it with ``show``), secrets masked."""
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


# Hydra's output_subdir, written by us instead (Hydra's is off) after the run folder is checked and secrets masked.
RUN_CONFIG_DIR = ".hydra"
RUN_CONFIG_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def save_run_config(cfg: DictConfig, run_dir: Path) -> None:
    """Write ``.hydra/{config,hydra,overrides}.yaml`` into ``run_dir`` as Hydra does (unresolved), secrets masked; no-op
    outside a Hydra app."""
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
    """Write ``metrics`` as JSON (NaN/inf become null, which JSON cannot hold); print the path with ``announce``."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    log.info("Metrics written to %s", path)
    if announce:
        print(f"Metrics: {path}")
    return path


def close_loggers(loggers: list[Logger], failed: bool) -> None:
    """Finish this job's loggers and W&B run (failing exit code if ``failed``); else a multirun's next job reuses the run."""
    for logger in loggers:
        logger.finalize("failed" if failed else "success")  # (our WandbLogger sends its held row here)
        if isinstance(logger, WandbLogger):
            import wandb

            if wandb.run is not None:  # the run this job's logger started (logger.experiment would start one)
                wandb.run.finish(exit_code=1 if failed else 0)


@contextmanager
def atomic_write_path(path: Path) -> Iterator[Path]:
    """Yield ``.<name>.partial`` to write; on success fsync and ``os.replace`` it onto ``path`` (atomic on one file system),
    on error delete it.  So ``path`` is never half-written."""
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
    """Print a :class:`ConfigError`/:class:`DataError` (also wrapped by ``instantiate``) or a full disk (``ENOSPC``,
    ``EDQUOT``) as one line and exit 1, without Hydra's traceback."""
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
    """Make SIGTERM raise ``SystemExit(143)`` (printing ``Stopped by SIGTERM: <outcome>``) so ``with`` blocks unwind; the
    previous handler is restored after.  Lightning alone ends a SIGTERM in test with exit 0 and ignores it in predict."""

    def stop(signum: int, frame: object) -> None:
        print(f"Stopped by {signal.Signals(signum).name}: {outcome}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
