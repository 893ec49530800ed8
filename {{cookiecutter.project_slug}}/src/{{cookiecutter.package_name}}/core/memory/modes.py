"""The planner's questions beyond "does it fit" (``plan.mode``), each from a few fake-tensor traces:
:func:`longest_context`, :func:`largest_value`, :func:`fastest_levers`, :func:`time_to_end`.

Times come from the roofline of :mod:`.steptime`; memory from :func:`.planner.plan_memory`'s trace.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf
from transformers import PretrainedConfig

from ..config.named import is_8bit_optimizer
from ..config.validate import validate_config
from ..errors import ConfigError
from ..models.levers import pinned_block
from ..run.distributed import uses_cuda
from ..task import Task
from . import planner
from .planner import GIB, MemoryPlan, process_batch
from .steptime import Peaks, StepCost, StepTime, has_peaks, predict

MODES = ("fit", "longest", "largest", "fastest", "time")


def check_mode(cfg: DictConfig) -> str:
    """``plan.mode``, checked before any trace.

    Raises:
        ConfigError: an unknown mode, or ``fastest``/``time`` on a ``hardware`` without peaks.
    """
    mode = cfg.plan.mode
    if mode not in MODES:
        raise ConfigError(f"plan.mode={mode!r} is not one of {', '.join(MODES)}")
    if mode in ("fastest", "time"):
        Peaks.of(cfg.hardware)
    key = cfg.plan.get("key")
    if mode == "largest" and (
        not isinstance(key, str) or isinstance(OmegaConf.select(cfg, key), bool) or not isinstance(OmegaConf.select(cfg, key), int)
    ):
        raise ConfigError(
            f"plan.mode=largest searches an integer setting, and plan.key={key!r} names {OmegaConf.select(cfg, key) if isinstance(key, str) else None!r}; "
            "fix: plan.key=<a whole-number key of the config>, e.g. plan.key=grpo.num_generations (task=grpo)"
        )
    return mode


def with_changes(cfg: DictConfig, changes: dict) -> DictConfig:
    """A copy of ``cfg`` with ``changes`` (dotted key -> value) applied."""
    changed = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(changed, key, value, merge=False)
    return changed


def _fits_host(sizes: list[int], length: int, traced_length: int, budget: int) -> bool:
    """Whether the offloaded tensors traced at ``traced_length`` (byte ``sizes``, each (B, T, d)), scaled to ``length``
    and each rounded up to a pinned block (a power of two), fit ``budget`` bytes."""
    if not budget:
        return True
    pinned = sum(pinned_block(math.ceil(size * length / traced_length)) for size in sizes)
    return pinned <= budget


@dataclass
class LongestContext:
    """``length``: the largest ``data.max_length`` on the ``step`` grid that fits (0: none); ``above``: the budget that
    stops ``length + step``; ``traces``: how many the search took."""

    length: int
    step: int
    plan: MemoryPlan | None
    above: str
    traces: int
    levers: list[str]
    changes: dict = field(default_factory=dict)  # the settings at ``length`` (:meth:`...task.Task.length_changes`)

    def text(self, hardware: str) -> str:
        traces = f"{self.traces} trace{'s' if self.traces > 1 else ''}"
        settings = " ".join(f"{key}={value}" for key, value in self.changes.items())
        lines = [f"Longest context that fits: {settings} (searched in steps of {self.step} tokens, {traces})"]
        lines.append(f"At {self.length + self.step} tokens: {self.above}")
        if self.levers:
            lines.append("Levers not pulled yet that lower what grows with the length: " + "; ".join(self.levers))
        lines.append(self.plan.table(hardware))
        return "\n".join(lines)


def longest_context(cfg: DictConfig, task: Task, config: PretrainedConfig) -> LongestContext:
    """The largest ``data.max_length`` (a multiple of ``plan.length_step``, at most ``plan.max_length`` or the model's
    ``max_position_embeddings``) whose plan fits the GPU and host budgets at the config's micro-batch.

    The host bound is arithmetic (no trace); the GPU plan is near linear in the length, so interpolation alternates
    with bisection: about log2(range / step) traces at worst.

    Raises:
        ConfigError: no bound or one above the model's positions, a bad step, or no length fits.
    """
    step = int(cfg.plan.length_step)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    bound = cfg.plan.max_length or positions
    if step < 1:
        raise ConfigError(f"plan.length_step={step}: must be a positive number of tokens")
    if bound is None:
        raise ConfigError("plan.mode=longest: the model states no max_position_embeddings; fix: set plan.max_length=<tokens>")
    if positions is not None and bound > positions:
        raise ConfigError(
            f"plan.max_length={bound} is above the model's {positions} positions (max_position_embeddings): "
            f"positions beyond them have no embedding or RoPE scaling the model was trained for; fix: plan.max_length<={positions}"
        )
    top = bound // step * step
    if top < step:
        raise ConfigError(f"plan.length_step={step} is above the search bound of {bound} tokens; fix: a smaller plan.length_step")
    plans: dict[int, MemoryPlan] = {}

    def plan_at(length: int) -> MemoryPlan:
        if length not in plans:
            plans[length] = planner.plan_memory(with_changes(cfg, task.length_changes(cfg, length)), task, search=False, config=config)
        return plans[length]

    start = min(max(step, cfg.data.max_length // step * step), top)
    first = plan_at(start)
    host_top = top
    if first.offloaded_sizes and first.host_budget:
        fits_host = lambda n: _fits_host(first.offloaded_sizes, n, start, first.host_budget)  # noqa: E731
        lo, hi = 0, top // step  # grid indices: lo fits the host (0: nothing), hi the largest to try
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits_host(mid * step) else (lo, mid - 1)
        host_top = lo * step
    if host_top < step:
        return _nothing_fits(cfg, first, step, plans)
    fits = {n: p.fits for n, p in plans.items()}
    lo = max((n for n, ok in fits.items() if ok), default=0)
    hi = min((n for n, ok in fits.items() if not ok), default=host_top + step)
    hi = min(hi, host_top + step)
    bisect = False
    while hi - lo > step:
        if lo and hi <= host_top:  # both ends traced: interpolate the GPU total to the budget
            a, b = plans[lo], plans[hi]
            guess = lo + (a.budget - a.total) * (hi - lo) / max(1, b.total - a.total)
        elif lo:  # above lo nothing traced: extrapolate from what grows per token
            a = plans[lo]
            grows = (a.activations + a.temporaries) / lo
            guess = lo + (a.budget - a.total) / max(grows, 1e-9)
        else:
            guess = hi / 2
        if bisect:
            guess = (lo + hi) / 2
        bisect = not bisect
        length = min(max(int(guess) // step * step, lo + step), hi - step)
        if plan_at(length).fits:
            lo = length
        else:
            hi = length
    if not lo:
        return _nothing_fits(cfg, first, step, plans)
    if hi > host_top:
        above = f"the offloaded activations' pinned blocks exceed hardware.host_budget_gib={cfg.hardware.host_budget_gib} (arithmetic, no trace)"
    else:
        over = plans[hi]
        above = (
            f"{over.total / GIB:.2f} GiB, over the budget of {over.budget / GIB:.2f} GiB"
            if over.total > over.budget
            else f"{over.host_pinned / GIB:.2f} GiB pinned, over hardware.host_budget_gib={cfg.hardware.host_budget_gib}"
        )
    if lo == top and hi > top:
        above = f"beyond the search bound ({'plan.max_length' if cfg.plan.max_length else 'the model’s max_position_embeddings'}={bound})"
    return LongestContext(lo, step, plans[lo], above, len(plans), _length_levers(cfg, task, config), task.length_changes(cfg, lo))


@dataclass
class LargestValue:
    """``value``: the largest ``key`` (at most ``bound``) whose plan fits at the config's micro-batch; ``above``: the plan one
    higher (``None`` at the bound); ``traces``: how many the search took."""

    key: str
    value: int
    plan: MemoryPlan
    above: MemoryPlan | None
    bound: int
    traces: int

    def text(self, hardware: str) -> str:
        traces = f"{self.traces} trace{'s' if self.traces > 1 else ''}"
        lines = [f"Largest {self.key} that fits: {self.value} (micro-batch {self.plan.micro_batch}; {traces})"]
        if self.above is None:
            lines.append(f"At {self.value + 1}: beyond the search bound (plan.max_value={self.bound})")
        else:
            lines.append(f"At {self.value + 1}: {self.above.total / GIB:.2f} GiB, over the budget of {self.above.budget / GIB:.2f} GiB")
        lines.append(self.plan.table(hardware))
        return "\n".join(lines)


def largest_value(cfg: DictConfig, task: Task, config: PretrainedConfig) -> LargestValue:
    """The largest whole value of ``plan.key`` (from 1 to ``plan.max_value``) whose plan fits the budget at the config's
    micro-batch, e.g. ``grpo.num_generations``: doubling from the config's value, then bisection (about 2 log2 traces).
    Memory is taken to grow with the value (each answer is a trace, so a non-monotone key gives a fitting value, maybe not
    the largest).

    Raises:
        ConfigError: a bad ``plan.max_value``, or not even 1 fits.
    """
    key, bound = cfg.plan.key, cfg.plan.get("max_value")
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
        raise ConfigError(f"plan.max_value={bound!r}: the search's upper bound, a whole number >= 1; fix: plan.max_value=256")
    plans: dict[int, MemoryPlan] = {}

    def fits(value: int) -> bool:
        if value not in plans:
            plans[value] = planner.plan_memory(with_changes(cfg, {key: value}), task, search=False, config=config)
        return plans[value].fits

    start = min(max(1, OmegaConf.select(cfg, key)), bound)
    if fits(start):
        lo, hi = start, start * 2
        while hi <= bound and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, bound + 1)
    else:
        lo, hi = 0, start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        smallest = plans[min(plans)]
        raise ConfigError(
            f"plan.mode=largest: no {key} fits; {key}={min(plans)} needs {smallest.total / GIB:.2f} GiB of the "
            f"{smallest.budget / GIB:.2f} GiB budget; fix: the levers `plan` (mode=fit) advises, or a larger budget"
        )
    return LargestValue(key, lo, plans[lo], plans.get(lo + 1) if lo < bound else None, bound, len(plans))


def _nothing_fits(cfg: DictConfig, first: MemoryPlan, step: int, plans: dict) -> LongestContext:
    smallest = min(plans)
    closest = plans[smallest]
    raise ConfigError(
        f"plan.mode=longest: no data.max_length fits; the shortest planned, {smallest} tokens, needs {closest.total / GIB:.2f} GiB "
        f"of the {closest.budget / GIB:.2f} GiB budget"
        + (f" and {closest.host_pinned / GIB:.2f} GiB of pinned host memory" if closest.host_pinned else "")
        + f"; fix: the levers `plan` (mode=fit) advises at micro-batch {closest.micro_batch}, or a larger budget"
    )


def _length_levers(cfg: DictConfig, task: Task, config: PretrainedConfig) -> list[str]:
    """The levers lowering activation memory that are off in ``cfg`` (not traced: plan each to see its gain)."""
    ac = cfg.activation_checkpointing
    levers = []
    if ac.mode == "none":
        levers.append("activation_checkpointing=full")
    if not ac.get("offload"):
        levers.append("activation_checkpointing=offload")
    if int(ac.get("mlp_tiles") or 1) == 1 and planner.has_mlp_layers(cfg, task, config):
        levers.append("activation_checkpointing.mlp_tiles=8")
    tried, _ = task.memory_advice(cfg, weights_dominate=False)
    levers += list(tried)
    return levers


# Activation-memory levers, each a set of activation_checkpointing keys.
CHECKPOINTING = {
    "activation_checkpointing=none": {"mode": "none", "offload": False, "mlp_tiles": 1},
    "activation_checkpointing=full": {"mode": "full", "offload": False, "mlp_tiles": 1},
    "activation_checkpointing=offload": {"mode": "full", "offload": True, "mlp_tiles": 1},
    "activation_checkpointing=offload activation_checkpointing.mlp_tiles=8": {"mode": "full", "offload": True, "mlp_tiles": 8},
}


@dataclass
class Candidate:
    """One lever set with its predicted step and memory (``confirmed``: traced at this micro-batch, not scaled from 1)."""

    overrides: list[str]
    micro_batch: int
    accumulate: int
    time: StepTime
    total: int
    fits: bool
    confirmed: bool = False

    def line(self) -> str:
        return (
            f"{self.time.total_ms:10.1f} {self.time.tokens_per_s:11.0f} {self.total / GIB:8.2f}  {self.micro_batch:>3} x {self.accumulate:<3} "
            + " ".join(self.overrides)
        )


def _variants(cfg: DictConfig, task: Task) -> list[tuple[list[str], dict]]:
    """Each activation-checkpointing choice, with and without each of the task's ``memory_advice`` levers."""
    tried, _ = task.memory_advice(cfg, weights_dominate=False)
    out = []
    for (ac_name, ac), *task_levers in itertools.product(CHECKPOINTING.items(), *[[None, item] for item in tried.items()]):
        changes = {f"activation_checkpointing.{k}": v for k, v in ac.items()}
        names = [ac_name]
        for lever in task_levers:
            if lever:
                names.append(lever[0])
                changes.update(lever[1])
        out.append((names, changes))
    return out


def _accepts(cfg: DictConfig, task: Task) -> bool:
    """Whether the config's checks accept ``cfg`` (for the planned card, not this machine)."""
    try:
        validate_config(cfg, task, runs_here=False)
    except ConfigError:
        return False
    return True


def _optimizer_variant(cost: StepCost, trainable: list[tuple[int, int]]) -> StepCost:
    """The step with bitsandbytes 8-bit AdamW for the traced fp32 one: per tensor one kernel of ``3 x size + 4`` bytes
    per value (reads parameter, gradient, two 8-bit moments; writes parameter, moments)."""
    optimizer = [(0, numel * (3 * size + 4), False, False) for numel, size in trainable]
    return StepCost(cost.micro_batch, cost.micro, optimizer, cost.host_bytes)


def fastest_levers(cfg: DictConfig, task: Task, config: PretrainedConfig) -> tuple[list[Candidate], int, str]:
    """The lever sets that fit the config's global batch, best predicted step time first.

    Space: micro-batch (divisors of the process's share) x checkpointing/offload/tiled MLP x the task's levers x AdamW or
    8-bit AdamW x ``compile`` off/default, as the config checks accept.  Each memory lever set is traced at micro-batch 1
    and scaled (compile keeps eager's memory, an upper bound); the ``plan.top`` best are traced again and re-ranked.

    Returns:
        (the confirmed candidates that fit, at most ``plan.top``; the number traced; what is closest when none fits).
    """
    peaks = Peaks.of(cfg.hardware)
    _, share, _ = process_batch(cfg)
    divisors = [d for d in range(1, share + 1) if share % d == 0]
    tokens = cfg.data.max_length
    traced, estimates = 0, []
    for names, changes in _variants(cfg, task):
        trial = with_changes(cfg, changes)
        try:
            validate_config(trial, task, runs_here=False)
            one = planner.plan_memory(trial, task, micro_batch=1, search=False, config=config, count=True)
        except ConfigError:  # a lever this model or config refuses (tiles without an MLP...)
            continue
        traced += 1
        fixed = one.total - one.activations - one.temporaries
        optimizers = [(cfg.optimizer.name, 0)]
        if not is_8bit_optimizer(cfg.optimizer.name) and not cfg.optimizer.step_in_backward:
            eight = planner.optimizer_state_bytes(one.trainable, "adamw_8bit") - one.counts["optimizer_bytes"]
            optimizers.append(("adamw_8bit", eight))
        compiles = [(cfg.compile.mode != "off", [])]  # the config's own choice
        if cfg.compile.mode == "off" and _accepts(with_changes(trial, {"compile.mode": "default"}), task):
            compiles.append((True, ["compile=default"]))
        for micro_batch, (optimizer, saved), (compiled, compile_override) in itertools.product(divisors, optimizers, compiles):
            overrides = [*names, f"batch.micro_batch_size={micro_batch}"]
            if optimizer != cfg.optimizer.name:
                overrides.append(f"optimizer={optimizer}")
            overrides += compile_override
            cost = one.cost.scaled(micro_batch)
            if is_8bit_optimizer(optimizer):
                cost = _optimizer_variant(cost, one.trainable)
            total = fixed + saved + micro_batch * (one.activations + one.temporaries)
            time = predict(cost, peaks, share // micro_batch, micro_batch * tokens, compiled=compiled)
            estimates.append(
                (Candidate(overrides, micro_batch, share // micro_batch, time, total, total <= one.budget and one.host_fits), trial, saved)
            )
    if not estimates:
        raise ConfigError("plan.mode=fastest: the config's checks refuse every lever set; run plan.mode=fit for the reason")
    fitting = sorted((e for e in estimates if e[0].fits), key=lambda e: e[0].time.total_ms)
    if not fitting:
        closest = min(estimates, key=lambda e: e[0].total)[0]
        return (
            [],
            traced,
            (
                f"no lever set fits {cfg.hardware.budget_gib} GiB; the closest is {closest.total / GIB:.2f} GiB: "
                + " ".join(closest.overrides)
            ),
        )
    confirmed: list[Candidate] = []
    shown = set()  # one per memory lever set and micro-batch: its fastest optimizer/compile choice
    for candidate, trial, saved in fitting:
        if len(confirmed) >= int(cfg.plan.top):
            break
        key = (tuple(o for o in candidate.overrides if not o.startswith(("optimizer=", "compile="))), candidate.micro_batch)
        if key in shown:
            continue
        shown.add(key)
        plan = planner.plan_memory(trial, task, micro_batch=candidate.micro_batch, search=False, config=config, count=True)
        traced += 1
        eight = "optimizer=adamw_8bit" in candidate.overrides or is_8bit_optimizer(cfg.optimizer.name)
        cost = _optimizer_variant(plan.cost, plan.trainable) if eight else plan.cost
        compiled = "compile=default" in candidate.overrides or cfg.compile.mode != "off"
        total = plan.total + saved
        if total > plan.budget or not plan.host_fits:
            continue  # the scaled estimate was low: the trace says it does not fit
        time = predict(cost, peaks, candidate.accumulate, candidate.micro_batch * tokens, compiled=compiled)
        confirmed.append(Candidate(candidate.overrides, candidate.micro_batch, candidate.accumulate, time, total, True, True))
    return sorted(confirmed, key=lambda c: c.time.total_ms), traced, ""


def fastest_text(cfg: DictConfig, ranked: list[Candidate], traced: int, closest: str) -> str:
    """The table of :func:`fastest_levers`' result (or, when nothing fits, what is closest)."""
    _, share, _ = process_batch(cfg)
    head = (
        f"Fastest lever sets for a global batch of {share} x {cfg.data.max_length} tokens on {cfg.hardware.name} "
        f"(budget {cfg.hardware.budget_gib} GiB; {traced} traces):"
    )
    if not ranked:
        return f"{head}\n{closest}"
    lines = [head, f"{'ms/step':>10} {'tokens/s':>11} {'GiB':>8}  mb x acc  overrides"]
    lines += [c.line() for c in ranked]
    lines.append(
        "  (time: a roofline of the step's kernels, core/memory/steptime.py; compile=default keeps eager's memory, an upper bound, "
        "and drops pointwise launches only)"
    )
    return "\n".join(lines)


@dataclass
class TimeToEnd:
    """``steps`` optimizer steps of ``time`` each (training steps only); ``plan``: the traced step's memory."""

    steps: int
    time: StepTime
    plan: MemoryPlan

    @property
    def hours(self) -> float:
        return self.steps * self.time.total_ms / 3.6e6

    def text(self, hardware: str) -> str:
        t = self.time
        minutes = round(self.hours * 60)
        return "\n".join(
            [
                f"Predicted step: {t.total_ms:.1f} ms on {hardware} (compute {t.compute_ms:.1f}, memory {t.memory_ms:.1f}, "
                f"overhead {t.overhead_ms:.1f} ms; {t.bound}-bound), {t.tokens_per_s:,.0f} tokens/s, {t.flops / 1e12:.2f} TFLOP per step",
                f"Time to the end of the run: {self.steps} steps x {t.total_ms:.1f} ms = {minutes // 60} h {minutes % 60:02d} min "
                "(training steps only: tokenisation, validation and checkpoint writes aside)",
                self.plan.table(hardware),
            ]
        )


def run_steps(cfg: DictConfig) -> int:
    """Optimizer steps of the run: ``trainer.max_steps``, else ``max_epochs`` x ceil(``plan.train_examples`` / global batch).

    Raises:
        ConfigError: neither is known (the plan reads no data).
    """
    if cfg.trainer.max_steps and cfg.trainer.max_steps > 0:
        return int(cfg.trainer.max_steps)
    examples = cfg.plan.get("train_examples")
    if not examples or examples < 1:
        raise ConfigError(
            f"plan.mode=time: the run is trainer.max_epochs={cfg.trainer.max_epochs} epochs and the plan reads no data, so the "
            "steps per epoch are unknown; fix: plan.train_examples=<training rows per epoch> (packed blocks in a pack mode; "
            "`inspect_data` counts them), or trainer.max_steps=<N>"
        )
    return int(cfg.trainer.max_epochs) * math.ceil(examples / cfg.batch.global_batch_size)


def time_to_end(cfg: DictConfig, task: Task, config: PretrainedConfig) -> TimeToEnd:
    """The config's step, traced (memory and kernels), and the run's length in steps.

    Raises:
        ConfigError: the hardware has no peaks (:meth:`.steptime.Peaks.of`) or the steps are unknown.
    """
    peaks = Peaks.of(cfg.hardware)
    steps = run_steps(cfg)
    plan = planner.plan_memory(cfg, task, search=False, config=config, count=True)
    cost = _optimizer_variant(plan.cost, plan.trainable) if is_8bit_optimizer(cfg.optimizer.name) else plan.cost
    time = predict(cost, peaks, plan.accumulate, plan.micro_batch * cfg.data.max_length, compiled=cfg.compile.mode != "off")
    return TimeToEnd(steps, time, plan)


def time_json(time: StepTime) -> dict:
    """A :class:`.steptime.StepTime` as plain JSON (ms, FLOPs, tokens/s)."""
    return {
        "total_ms": round(time.total_ms, 3),
        "compute_ms": round(time.compute_ms, 3),
        "memory_ms": round(time.memory_ms, 3),
        "overhead_ms": round(time.overhead_ms, 3),
        "bound": time.bound,
        "flops": time.flops,
        "tokens_per_s": round(time.tokens_per_s, 1),
    }


def candidate_json(candidate: Candidate) -> dict:
    """A :class:`Candidate` as plain JSON (GiB, ms)."""
    return {
        "overrides": candidate.overrides,
        "micro_batch": candidate.micro_batch,
        "accumulate": candidate.accumulate,
        "total_gib": round(candidate.total / GIB, 3),
        "step_time": time_json(candidate.time),
    }


def predicted_step_ms(cfg: DictConfig, task: Task, plan: MemoryPlan | None) -> float | None:
    """``train``'s prediction of its step in ms (for :class:`..callbacks.step_time.StepTimeCheck`), from ``plan``'s kernels
    or, on the CPU, a count of its own; ``None`` without peaks, when ``hardware`` is not what the run runs on, when the
    architecture is unknown yet, or on a GPU run without a pre-fit plan."""
    describes_a_cpu = not cfg.hardware.get("kernels_overlap", True)
    if not has_peaks(cfg.hardware) or uses_cuda(cfg) == describes_a_cpu:
        return None
    peaks = Peaks.of(cfg.hardware)
    micro_batch, share, _ = process_batch(cfg)
    if plan is not None and plan.cost is not None:
        cost, trainable = plan.cost, plan.trainable
    elif uses_cuda(cfg):  # no pre-fit plan (plan_before_fit=false, FSDP): no extra trace before a GPU run
        return None
    else:
        try:
            config = planner.architecture(cfg)
        except ConfigError:
            return None
        cost, trainable = planner.step_cost(cfg, task, config, micro_batch)
    if is_8bit_optimizer(cfg.optimizer.name):
        cost = _optimizer_variant(cost, trainable)
    compiled = cfg.compile.mode != "off"
    return predict(cost, peaks, max(1, share // micro_batch), micro_batch * cfg.data.max_length, compiled=compiled).total_ms
