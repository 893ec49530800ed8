"""Several processes per run: Lightning's DDP and FSDP start and join them; this module makes them meet Hydra correctly.

Lightning's DDP launcher starts ranks 1..N-1 by rerunning the command line, which in a multirun is the whole sweep.  So a
job publishes its overrides and folder in an environment variable (:func:`ddp_job_env`) and a child rewrites its command
line into that one job (:func:`ddp_child_argv`).  Between jobs the process group is destroyed and Lightning's variables
removed (else the next trainer sees ``LOCAL_RANK``, takes itself for a child and hangs); :func:`finish_ranks` reaps ranks.
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
    """Around one multirun job: publish it to DDP children, then restore launch variables and destroy the process group."""
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
    """On rank 0 after a run: wait for Lightning's child ranks (killed after ``timeout_s``), log failures, and clear
    ``trainer.strategy.launcher.procs``: Lightning's observer SIGKILLs us when a listed child exited non-zero, which would
    end a sweep after a failed trial.  No-op without children.
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


def rank_exit_code(exit_code: int, rank: int) -> int:
    """The exit code of a rank that stops on purpose: rank 0's is the run's; another rank stopping on a signal (128 + N:
    every rank agreed to stop at that step boundary, :class:`..callbacks.guards.StopOnSignal`) exits 0, since Lightning's
    process observer in rank 0 SIGKILLs it when a child exits non-zero, possibly before rank 0 has written its checkpoint.
    Other stops keep their code (a rank stopping alone must still bring the others down)."""
    return 0 if rank != 0 and exit_code >= 128 else exit_code


def ddp_child_argv(argv: list[str], environ: dict[str, str] | None = None) -> list[str] | None:
    """The command line a multirun job's DDP child must run (``None``: not such a child): ``argv``'s config flags (not the
    sweep), the job's overrides and folder, ``hydra.mode=RUN``.  ``environ`` defaults to ``os.environ``."""
    environ = os.environ if environ is None else environ
    job, local_rank = environ.get(JOB_ENV), environ.get("LOCAL_RANK", "0")
    if not job or local_rank == "0":
        return None
    job = json.loads(job)
    # Keep the config flags (`--config-dir X`, `-cd X`, `--config-dir=X`...); the rest is the sweep, replaced by the job.
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
    """Lightning's ``FSDPStrategy`` (``kwargs`` passed on) with each transformers block (a ``GradientCheckpointingLayer``) in
    its own FSDP unit: one all-gather per block (PyTorch FSDP tutorial, "transformer_auto_wrap_policy")."""
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.modeling_layers import GradientCheckpointingLayer

    return FSDPStrategy(auto_wrap_policy={GradientCheckpointingLayer}, **kwargs)


def uses_cuda(cfg: DictConfig) -> bool:
    """Whether ``trainer`` will run on a CUDA GPU (``accelerator`` gpu/cuda, or auto with one visible)."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def distributed_problems(trainer: DictConfig, runs_here: bool) -> list[str]:
    """GPUs that are not there, said before anything loads (Lightning's own errors come later, and
    FSDP's only after the model is built): FSDP shards over CUDA GPUs (NCCL); ``accelerator: gpu``
    needs ``devices`` of them."""
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
