"""Several processes per run: Lightning's DDP and FSDP start and join them; this module only
makes them meet Hydra correctly.

**Multirun + DDP.**  Lightning's DDP launcher starts ranks 1..N-1 by running the same command
line again (``python -m <package>.train <argv> hydra.run.dir=...``).  In a Hydra multirun that
command line is the whole sweep: each child would run every job of the sweep (an Optuna sweep
would even suggest its own parameters) into a second sweep folder.  So a multirun job hands its
own overrides and folder to its children in an environment variable (:func:`ddp_job_env`), and a
child started that way rewrites its command line into that one job (:func:`ddp_child_argv`)
before Hydra parses it: every rank trains the same job, in the job's folder, and nothing else.

Between two jobs of one multirun the process group is destroyed and the variables Lightning set
(``LOCAL_RANK``, ``MASTER_PORT``, ...) are removed; otherwise the next job's trainer would find
``LOCAL_RANK`` set, take itself for a child and wait forever for ranks that never start.  The
job's ranks are waited for, and taken off the list Lightning's watcher of them reads (see
:func:`finish_ranks`): it would kill the whole sweep after a failed trial.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)

# The job a DDP child must run: {"overrides": [...], "output_dir": "..."} as JSON.
JOB_ENV = "LIGHTNING_HYDRA_DDP_JOB"
# Hydra's command-line flags that select the config, long and short form (`python -m ... --help`).
CONFIG_FLAGS = (("--config-dir", "-cd"), ("--config-name", "-cn"), ("--config-path", "-cp"))
# What Lightning's launcher and the process group leave in os.environ.
LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", JOB_ENV)


@contextmanager
def ddp_job_env(overrides: list[str], output_dir: str) -> Iterator[None]:
    """Around one multirun job: publish the job (its ``overrides`` and ``output_dir``) to the
    DDP children Lightning may start, then leave the process as it was (launch variables removed,
    process group destroyed), so the next job launches its own ranks."""
    before = {key: os.environ.get(key) for key in LAUNCH_ENV}
    os.environ[JOB_ENV] = json.dumps({"overrides": list(overrides), "output_dir": output_dir})
    try:
        yield
    finally:
        # (train() has waited for the job's ranks: finish_ranks)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def finish_ranks(trainer: object, timeout_s: float = 60.0) -> None:
    """After a run (or a multirun job) on rank 0: wait for the ranks Lightning started for it
    (killed after ``timeout_s``, e.g. one left waiting in a collective), log any that failed,
    and take them off the launcher's list of children (``trainer.strategy.launcher.procs``).

    Lightning's observer thread watches that same list and SIGKILLs this process when a child
    exited non-zero: right while ranks run (no hang), fatal after the job, for a sweep whose next
    trial must run after a failed one.  The job's outcome is rank 0's, already recorded; with the
    list empty the observer has nothing left to watch and ends.  ``trainer``: a Lightning
    ``Trainer`` (anything else, or a launcher with no children, is a no-op).
    """
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    children = getattr(launcher, "procs", None)
    if not isinstance(children, list):
        return
    for rank, child in enumerate(children, start=1):
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.returncode:
            log.warning("rank %d (pid %d) exited with code %d", rank, child.pid, child.returncode)
    children.clear()


def ddp_child_argv(argv: list[str], environ: dict[str, str] | None = None) -> list[str] | None:
    """The command line a DDP child of a multirun job must run, or ``None`` when this process is
    not such a child (no job published, or rank 0).

    Keeps the config flags of ``argv`` (``--config-dir``/``-cd``, ``--config-name``/``-cn``,
    ``--config-path``/``-cp``), drops the sweep (``-m`` and the sweep overrides), and adds the
    job's overrides, its folder and ``hydra.mode=RUN``.

    Args:
        argv: ``sys.argv`` as the child received it (Lightning's re-launch command).
        environ: ``os.environ`` (a parameter for tests).
    """
    environ = os.environ if environ is None else environ
    job, local_rank = environ.get(JOB_ENV), environ.get("LOCAL_RANK", "0")
    if not job or local_rank == "0":
        return None
    job = json.loads(job)
    # Hydra's own flags that choose the config (`--config-dir X`, `-cd X`, `--config-dir=X`, ...);
    # the rest of the line (-m, the sweep's overrides) is the sweep, replaced by the job.
    found: dict[str, str] = {}
    rest = iter(argv[1:])
    for token in rest:
        for flag, short in CONFIG_FLAGS:
            if token in (flag, short):
                found[flag] = next(rest, "")
            elif token.startswith((f"{flag}=", f"{short}=")):
                found[flag] = token.split("=", 1)[1]
    flags = [part for flag, _short in CONFIG_FLAGS if flag in found for part in (flag, found[flag])]
    return [
        argv[0],
        *flags,
        *job["overrides"],
        "hydra.mode=RUN",
        f"hydra.run.dir={job['output_dir']}",
        "hydra.output_subdir=null",
        f"hydra.job.name=train_ddp_process_{local_rank}",  # Lightning's name for a rank: its log is <job>/train_ddp_process_1.log
    ]


def is_fsdp(trainer: DictConfig) -> bool:
    """Whether a ``trainer`` config shards the model with FSDP (``strategy: fsdp`` or an FSDP ``_target_``)."""
    strategy = trainer.get("strategy")
    name = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy or "")
    return "fsdp" in name.lower()


def fsdp_strategy(**kwargs):
    """Lightning's ``FSDPStrategy`` wrapping each transformer block in its own FSDP unit.

    Every block of a transformers model (``BertLayer``, ``LlamaDecoderLayer``, ``GPT2Block``, ...)
    subclasses ``transformers.modeling_layers.GradientCheckpointingLayer``: wrapping that class
    gives one all-gather per block, the usual policy for transformers (PyTorch FSDP tutorial,
    "transformer_auto_wrap_policy").  ``kwargs`` go to ``FSDPStrategy`` (``sharding_strategy``,
    ``state_dict_type``, ...).

    Returns:
        lightning.pytorch.strategies.FSDPStrategy
    """
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.modeling_layers import GradientCheckpointingLayer

    return FSDPStrategy(auto_wrap_policy={GradientCheckpointingLayer}, **kwargs)
