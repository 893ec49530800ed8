"""The report a CUDA out-of-memory stop leaves: where, how full the card was, what was saved, and the planner's fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from ..run.entry import atomic_write_path
from ..task import Task
from .planner import plan_memory, process_batch

log = logging.getLogger(__name__)


def suggest_batch(cfg: DictConfig, task: Task) -> tuple[int | None, list[str], str]:
    """``(micro_batch, other levers, planner line)`` after an OOM: the largest divisor of the process's batch share
    (:func:`.planner.process_batch`) below the failed one that the planner says fits (the divisors alone when it cannot
    plan); ``None`` when there is none.
    """
    micro_batch, global_batch, _ = process_batch(cfg)  # one process's share under DDP
    smaller = [d for d in range(1, micro_batch) if global_batch % d == 0]
    try:
        plan = plan_memory(cfg, task)
    except Exception as error:  # the report must be written whatever the planner thinks
        log.warning("memory planner failed while writing the OOM report: %s", error)
        return (max(smaller) if smaller else None), [], f"planner unavailable ({type(error).__name__}: {error})"
    fitting = [d for d in smaller if d <= plan.max_micro_batch]  # none when not even micro-batch 1 plans to fit
    levers = [] if fitting else plan.advice
    line = (
        f"planner ({cfg.hardware.name}, budget {cfg.hardware.budget_gib} GiB): micro-batch {micro_batch} plans at "
        f"{plan.total / 2**30:.2f} GiB; the largest that plans to fit is {plan.max_micro_batch or 'none'}"
    )
    return (max(fitting) if fitting else None), levers, line


def write_oom_report(cfg: DictConfig, task: Task, run_dir: Path, report: dict | None, error: BaseException) -> str:
    """Write ``oom_report.txt``/``.json`` into ``run_dir`` and return the text; ``report``:
    :attr:`..callbacks.guards.OutOfMemoryGuard.report` (``None`` when that callback is off).
    """
    facts = dict(report or {})
    micro_batch, levers, planner_line = suggest_batch(cfg, task)
    global_batch, share = cfg.batch.global_batch_size, process_batch(cfg)[1]  # share: one process's part of it
    lines = [
        f"CUDA out of memory at optimizer step {facts.get('optimizer_step', '?')} "
        f"(epoch {facts.get('epoch', '?')}, batch {facts.get('batch_idx', '?')} of the epoch, "
        f"micro-batch {facts.get('micro_batch_of_step', '?')} of {facts.get('accumulate_grad_batches', '?')} in the step"
        f"{', in the optimizer update' if facts.get('in_optimizer_update') else ''})"
    ]
    shape = facts.get("batch_shape")
    if shape:
        lines.append(f"  batch: {shape[0]} sequences x {shape[1] if len(shape) > 1 else '?'} tokens")
    if facts.get("peak_allocated_gib") is not None:
        lines.append(f"  peak allocated: {facts['peak_allocated_gib']} GiB of {facts.get('device_total_gib')} GiB on the card")
    lines.append(f"  error: {facts.get('error') or str(error).splitlines()[0][:300]}")
    if facts.get("checkpoint"):
        lines.append(f"saved: {facts['checkpoint']} (step {facts.get('checkpoint_step')}); resume with ckpt_path=last and the fix below")
    else:
        lines.append("saved: nothing (no checkpoint yet, and the state at the error was not a clean step boundary)")
    lines.append(planner_line)
    if micro_batch:
        fix = f"batch.micro_batch_size={micro_batch} (accumulation {share // micro_batch} keeps the global batch of {global_batch})"
    else:
        fix = "; ".join(levers) or "a shorter data.max_length, activation_checkpointing=full, optimizer=adamw_8bit or peft=lora"
    lines.append(f"fix: {fix}")
    text = "\n".join(lines)
    facts.update(
        suggested_micro_batch=micro_batch,
        suggested_accumulation=share // micro_batch if micro_batch else None,
        advice=levers,
        planner=planner_line,
        fix=fix,
    )
    with atomic_write_path(run_dir / "oom_report.json") as partial:
        partial.write_text(json.dumps(facts, indent=2) + "\n")
    with atomic_write_path(run_dir / "oom_report.txt") as partial:
        partial.write_text(text + "\n")
    return text
