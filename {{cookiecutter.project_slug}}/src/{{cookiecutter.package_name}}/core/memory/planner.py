"""Predict the peak GPU memory of one device's training step from its config, on the CPU.

Builds the model as ``train`` does on fake tensors and traces one steady-state step of one micro-batch of
``data.max_length`` tokens (:mod:`.tracer`), then adds what the trace cannot see:

- QLoRA: 4-bit weights traced in bf16, counted as NF4 (QLoRA paper, Section 3) plus one dequantized bf16 weight.
- 8-bit optimizer state: counted as bitsandbytes 0.50 stores it (``min_8bit_size``); paged state is reported, not totalled.
- CPU vs CUDA: CPU sdpa saves what CUDA's flash kernels save; ``flash_attention_2``/``flex_attention`` are traced as sdpa
  without the dense ``(B, 1, T, T)`` mask; autocast follows CUDA's fp32 list (:class:`.tracer.CudaAutocastEmulation`).
- Pruning masks and events (:class:`..compress.pruning.PruningMemory`).
- CUDA context + allocator reserve: ``hardware.context_gib`` (source in ``configs/hardware/rtx4090_24gb.yaml``).
- ``compile`` is not traced: the plan is an upper bound there.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import AutoConfig, PretrainedConfig

from ..compress.pruning import PruningMemory, pruning_memory
from ..config.named import is_8bit_optimizer, is_paged_optimizer
from ..config.resolvers import to_plain, world_size
from ..config.validate import validate_config
from ..errors import ConfigError
from ..models.levers import MASK_FREE_ATTENTION, ActivationOffload, apply_memory_levers, pinned_block
from ..models.precision import compute_dtype, is_mixed, precision_is_auto
from ..optim import StepInBackward, build_optimizer
from ..run.distributed import uses_cuda
from ..task import Task, build_module
from . import tracer
from .steptime import StepCost

GIB = 2**30
# bitsandbytes 8-bit state: 1 byte per moment (2 moments), fp32 block maxima per 256 values.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
# QLoRA NF4 (Dettmers et al. 2023, Section 3): 64-weight blocks; double quantization: 8-bit constants, one fp32 per 256.
NF4_BLOCK = 64
NF4_SECOND_BLOCK = 256


def table_unit(sizes: list[int]) -> tuple[str, int]:
    """``(unit, its bytes)`` of a plan table: the largest of GiB/MiB/KiB in which every non-zero size shows as >= 0.01,
    so a small model's rows do not all read 0.00 GiB."""
    smallest = min((size for size in sizes if size > 0), default=GIB)
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if smallest / scale >= 0.005:
            return unit, scale
    return "KiB", 2**10


@dataclass
class MemoryPlan:
    """What ``plan`` reports.  Byte fields are alive at the step's peak and sum to ``peak_allocated`` (what
    ``torch.cuda.max_memory_allocated`` measures); ``total = peak_allocated + overhead``."""

    micro_batch: int
    seq_len: int
    accumulate: int
    params: int
    buffers: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    peak_allocated: int
    overhead: int
    total: int
    budget: int
    fits: bool
    paged_optimizer: int = 0
    max_micro_batch: int = 0
    max_micro_batch_accumulate: int | None = None
    counts: dict = field(default_factory=dict)
    corrections: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    processes: int = 1  # trainer.devices x trainer.num_nodes; the plan is one process's (one GPU's)
    host_pinned: int = 0  # bytes of pinned host memory for one micro-batch's offloaded activations (allocator blocks)
    offloaded_bytes: int = 0  # their bytes as tensors
    host_budget: int = 0  # hardware.host_budget_gib in bytes (0: not planned)
    offloaded_tensors: int = 0
    host_staging: int = 0  # bytes of pinned host memory staging a background checkpoint write (0: synchronous)
    # For modes.py, not in plan.json: the step's kernels, trainable (numel, bytes per value), offloaded tensors' bytes.
    cost: StepCost | None = field(default=None, repr=False)
    trainable: list = field(default_factory=list, repr=False)
    offloaded_sizes: list = field(default_factory=list, repr=False)

    @property
    def host_fits(self) -> bool:
        """The offloaded activations fit ``hardware.host_budget_gib`` (True without offloading or a budget)."""
        return not self.host_budget or self.host_pinned <= self.host_budget

    def as_json(self) -> dict:
        """Plain JSON: every byte field also as ``<name>_gib`` (GiB, 3 decimals)."""
        out = {key: value for key, value in asdict(self).items() if key not in ("cost", "trainable", "offloaded_sizes")}
        out["host_fits"] = self.host_fits
        for name in (
            "params",
            "buffers",
            "grads",
            "optimizer",
            "activations",
            "temporaries",
            "peak_allocated",
            "overhead",
            "total",
            "budget",
            "paged_optimizer",
            "host_pinned",
            "host_budget",
            "host_staging",
        ):
            out[f"{name}_gib"] = round(out[name] / GIB, 3)
        return out

    def table(self, hardware: str) -> str:
        """The human-readable report."""
        rows = [
            ("parameters", self.params + self.buffers),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
            ("= peak allocated", self.peak_allocated),
            ("CUDA context + allocator", self.overhead),
            ("= total", self.total),
        ]
        each = f" per process ({self.processes} processes, one GPU each)" if self.processes > 1 else ""
        lines = [
            f"Memory plan{each}: micro-batch {self.micro_batch} x {self.seq_len} tokens, accumulation {self.accumulate}",
            '  (what is alive at the peak moment; full sizes in plan.json "counts")',
        ]
        unit, scale = table_unit([size for _, size in rows] + [self.paged_optimizer])
        lines += [f"  {name:<26}{size / scale:>10.2f} {unit}" for name, size in rows]
        if self.paged_optimizer:
            lines.append(f"  (paged optimizer state      {self.paged_optimizer / scale:.2f} {unit} in unified memory, not counted)")
        gpu_fits = self.total <= self.budget
        verdict = "fits" if gpu_fits else "does NOT fit"
        lines.append(f"Verdict: {self.total / scale:.2f} {unit} {verdict} in {self.budget / GIB:.2f} GiB ({hardware})")
        if self.host_pinned:
            host = "fits" if self.host_fits else "does NOT fit"
            budget = f"in the host budget of {self.host_budget / GIB:.2f} GiB" if self.host_budget else "(no host budget set)"
            lines.append(
                f"Host memory: {self.host_pinned / GIB:.2f} GiB pinned for {self.offloaded_tensors} offloaded activations, {host} {budget}"
            )
        if self.host_staging:
            room = (
                ""
                if not self.host_budget or self.host_pinned + self.host_staging <= self.host_budget
                else f"; with the offloaded activations over the host budget of {self.host_budget / GIB:.2f} GiB: "
                "a save that finds too little host memory free is written synchronously"
            )
            lines.append(f"Host memory: {self.host_staging / GIB:.2f} GiB staging each checkpoint for its background write{room}")
        if self.max_micro_batch and self.max_micro_batch_accumulate == 1:
            lines.append(
                f"Largest micro-batch: {self.max_micro_batch}, the whole global batch (memory is left over: "
                "a larger batch.global_batch_size would fit too)"
            )
        elif self.max_micro_batch:
            lines.append(
                f"Largest micro-batch that fits: {self.max_micro_batch} "
                f"(batch.micro_batch_size={self.max_micro_batch}, accumulation {self.max_micro_batch_accumulate})"
            )
        elif self.advice:  # (the search ran and found none; without the search, no line)
            lines.append("No micro-batch fits; try: " + "; ".join(self.advice))
        lines += [f"  note: {note}" for note in self.corrections]
        return "\n".join(lines)


def architecture(cfg: DictConfig) -> PretrainedConfig:
    """The HF config to plan, without network or weights: ``model.config`` (vocabulary from the on-disk tokenizer, else
    ``model.architecture.vocab_size``), a local ``model.name_or_path``'s ``config.json``, or ``model.architecture``
    when its ``of`` names that same model.

    Raises:
        ConfigError: none of these is available.
    """
    spec = cfg.model
    published = to_plain(spec.architecture) if spec.get("architecture") else {}
    described = published.pop("of", None)
    if spec.get("config"):
        fields = to_plain(spec.config)
        vocab = _tokenizer_vocab(spec.get("tokenizer")) or published.get("vocab_size")
        if vocab is None:
            raise ConfigError(
                f"plan needs the vocabulary size of model.tokenizer={spec.get('tokenizer')!r}, which is not on disk; "
                "fix: +model.architecture.vocab_size=<N>, or fetch the tokenizer once (train does)"
            )
        return AutoConfig.for_model(fields.pop("model_type"), vocab_size=vocab, **fields)
    path = spec.get("name_or_path")
    if path and Path(path, "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    if published and described == path:
        return AutoConfig.for_model(published.pop("model_type"), **published)
    known = f" (model.architecture describes {described!r})" if described else ""
    raise ConfigError(
        f"plan reads no weights and no network, and model.name_or_path={path!r} is not a local model folder{known}; "
        "fix: a model file whose architecture block names it (see configs/model/llama31_8b.yaml), "
        "or the model's config.json numbers as +model.architecture.* with model.architecture.of set to it"
    )


def _tokenizer_vocab(name: str | None) -> int | None:
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(name, local_files_only=True))
    except (OSError, ValueError):
        return None


@dataclass
class _Traced:
    peak: dict[str, int]
    n_params: int
    n_trainable: int
    trainable: list[tuple[int, int]]  # (numel, bytes per value) of each trainable tensor
    param_bytes: int
    quantized_numels: list[int]
    pruning: PruningMemory | None = None
    offloaded_tensors: int = 0  # activation offloading: tensors and bytes sent to host memory
    offloaded_bytes: int = 0
    pinned_bytes: int = 0
    cost: StepCost | None = None  # trace(count=True): the step's kernels
    offloaded_sizes: list = field(default_factory=list)


def trace(cfg: DictConfig, task: Task, config: PretrainedConfig, micro_batch: int, count: bool = False) -> _Traced:
    """Trace one training step of ``micro_batch`` x ``data.max_length`` tokens on fake tensors, autocast as on CUDA;
    ``count``: also count its kernels (for :mod:`.steptime`)."""
    with _fake_step(cfg, task, config, micro_batch) as setup:
        optimizer = setup.optimizer
        tracked = [setup.loss, *(optimizer.inner.values() if isinstance(optimizer, StepInBackward) else [optimizer])]
        counter = tracer.OpCounter() if count else None
        with counter or contextlib.nullcontext():
            peak = tracer.peak_bytes(lambda: setup.step(counter), tracked, mixed=is_mixed(cfg.trainer.precision))
        parameters = list(setup.loss.model.parameters())  # unique: tied weights once
        trainable = [(p.numel(), p.element_size()) for p in parameters if p.requires_grad]
        param_bytes = sum(p.numel() * p.element_size() for p in parameters)
        method = cfg.pruning.method if cfg.get("pruning") else "none"
        pruning = pruning_memory(setup.loss.model, method) if method != "none" else None
        offload = setup.offload
        return _Traced(
            peak,
            sum(p.numel() for p in parameters),
            sum(n for n, _ in trainable),
            trainable,
            param_bytes,
            setup.quantized_numels,
            pruning,
            offload.tensors if offload else 0,
            offload.bytes if offload else 0,
            offload.pinned if offload else 0,
            _counted(counter, setup, cfg, micro_batch) if counter else None,
            offload.sizes if offload else [],
        )


def step_cost(cfg: DictConfig, task: Task, config: PretrainedConfig, micro_batch: int) -> tuple[StepCost, list[tuple[int, int]]]:
    """The kernels of one step at ``micro_batch`` (fake tensors, no memory tracker), for :func:`.steptime.predict`,
    and the trainable tensors' ``(numel, bytes per value)``."""
    cfg = for_the_card(cfg)
    with _fake_step(cfg, task, config, micro_batch) as setup:
        with tracer.OpCounter() as counter:
            if is_mixed(cfg.trainer.precision):
                with tracer.CudaAutocastEmulation():
                    setup.step(counter)
            else:
                setup.step(counter)
        trainable = [(p.numel(), p.element_size()) for p in setup.loss.model.parameters() if p.requires_grad]
    return _counted(counter, setup, cfg, micro_batch), trainable


@contextlib.contextmanager
def _fake_step(cfg: DictConfig, task: Task, config: PretrainedConfig, micro_batch: int) -> Iterator[StepSetup]:
    """:func:`training_step` on fake tensors (built on ``meta``) inside the context; step-in-backward hooks removed after."""
    with torch.device("meta"):
        built = _build(cfg, task, config, str(cfg.trainer.precision))
    with tracer.fake_tensors():
        tracer.materialize_fake(built[0])
        setup = training_step(cfg, task, config, micro_batch, built, trace=True)
        try:
            yield setup
        finally:
            if isinstance(setup.optimizer, StepInBackward):
                setup.optimizer.remove_hooks()


def _counted(counter: tracer.OpCounter, setup: StepSetup, cfg: DictConfig, micro_batch: int) -> StepCost:
    """The :class:`.steptime.StepCost` of a counted step: kernels, offloaded bytes, QLoRA dequantizations."""
    host = setup.offload.bytes if setup.offload else 0
    cost = StepCost(micro_batch, counter.ops["micro"], counter.ops["optimizer"], host)
    return _with_dequantization(cost, setup.quantized_numels, cfg)


def _with_dequantization(cost: StepCost, quantized_numels: list[int], cfg: DictConfig) -> StepCost:
    """Add a QLoRA base's dequantizations (traced in bf16): per use of a 4-bit weight, one kernel reading 0.5 and writing
    2 bytes/weight, in forward, backward and any checkpointed recompute."""
    uses = 3 if cfg.activation_checkpointing.mode != "none" else 2
    extra = [(0, numel // 2 + 2 * numel, False, True) for numel in quantized_numels for _ in range(uses)]
    return StepCost(cost.micro_batch, cost.micro + extra, cost.optimizer, cost.host_bytes)


@dataclass
class StepSetup:
    """What :func:`training_step` builds; ``step()`` runs forward (``loss()``), backward and the optimizer step."""

    loss: torch.nn.Module
    optimizer: torch.optim.Optimizer
    quantized_numels: list[int]
    offload: ActivationOffload | None = None

    def step(self, counter: tracer.OpCounter | None = None) -> None:
        """``counter``: told when the optimizer step starts."""
        self.loss().backward()
        if counter is not None:
            counter.phase = "optimizer"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def training_step(
    cfg: DictConfig,
    task: Task,
    config: PretrainedConfig,
    micro_batch: int,
    built: tuple | None = None,
    device: str = "cpu",
    trace: bool = False,
) -> StepSetup:
    """Model, optimizer (state allocated) and ``step()`` of one training step on ``micro_batch`` x ``data.max_length``
    random tokens, as ``train`` builds them (8-bit optimizers as fp32 AdamW; :func:`optimizer_state_bytes` corrects them).

    Real tensors on ``device`` unless inside :func:`.tracer.fake_tensors` with ``built`` (:func:`_build`'s output, fake).
    ``trace``: inside the fake trace (activation offloading then copies nothing).

    Returns:
        the :class:`StepSetup`; ``quantized_numels``: the weights a QLoRA base holds in 4 bits.
    """
    precision = str(cfg.trainer.precision)
    mixed = is_mixed(precision)
    autocast_dtype = compute_dtype(precision)
    # No device context on the CPU: the fake-tensor trace runs this too.
    with torch.device(device) if device != "cpu" else contextlib.nullcontext():
        model, module, quantized = built or _build(cfg, task, config, precision)
        model.train()
        offload = apply_memory_levers(model, to_plain(cfg.activation_checkpointing), trace=trace)
        optimizer_cfg = to_plain(cfg.optimizer)
        if is_8bit_optimizer(optimizer_cfg["name"]):  # traced as fp32 AdamW, its state then counted as stored (_plan_at)
            optimizer_cfg["name"] = "adamw"
        optimizer = build_optimizer(model, optimizer_cfg, device_type="cuda")
        _allocate_optimizer_state(model, optimizer)
        batch = task.example_batch(cfg, config.vocab_size, micro_batch)  # the task's, (B, T) token ids

    def loss_fn() -> torch.Tensor:
        with torch.autocast(device, dtype=autocast_dtype, enabled=mixed):
            return task.example_loss(module, model, batch)

    return StepSetup(_Loss(model, loss_fn), optimizer, quantized, offload)


class _Loss(torch.nn.Module):
    """Forward + loss as one module call: the memory tracker accepts a submodule called several times per step
    (the chunked loss's lm_head) only inside a root module."""

    def __init__(self, model: torch.nn.Module, loss_fn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self) -> torch.Tensor:
        return self.loss_fn()


def _build(cfg: DictConfig, task: Task, config: PretrainedConfig, precision: str):
    """``(model, task module, numels of the weights a QLoRA base holds in 4 bits)``, built as ``train`` does (the module's
    ``build_model``) from ``config`` with random weights."""
    module = build_module(cfg)
    if module.attn_implementation in MASK_FREE_ATTENTION:
        # Neither runs on the CPU (flex has no CPU backward); both save what sdpa does, without a dense mask.
        module.hparams.attention = {"implementation": tracer.mask_free_sdpa()}
    model, quantized = task.planned_model(module, cfg, config, precision)
    if precision.endswith("-true"):
        model.to(compute_dtype(precision))  # Lightning's *-true precision converts every floating tensor
    return model, module, quantized


def has_mlp_layers(cfg: DictConfig, task: Task, config: PretrainedConfig) -> bool:
    """Whether every ``GradientCheckpointingLayer`` of ``cfg``'s model has an ``mlp`` (what
    ``activation_checkpointing.mlp_tiles`` slices); built on ``meta``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    with torch.device("meta"):
        model = _build(cfg, task, config, str(cfg.trainer.precision))[0]
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return bool(layers) and all(hasattr(layer, "mlp") for layer in layers)


def _allocate_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients, so the traced step is the steady state (state already there)."""
    inner = optimizer.inner.values() if isinstance(optimizer, StepInBackward) else [optimizer]
    for opt in inner:
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step()
        opt.zero_grad(set_to_none=True)


def optimizer_state_bytes(trainable: list[tuple[int, int]], name: str) -> int:
    """AdamW-style optimizer state bytes for trainable ``(numel, bytes per value)``: torch AdamW, two moments in the
    parameter's dtype plus a 4-byte ``step`` each; bitsandbytes 8-bit, 2 bytes/value plus two fp32 maxima per 256 values
    from 4,096 values, else 8 bytes/value (as bitsandbytes 0.50 allocates; ``tests/test_planner.py`` compares)."""
    if not is_8bit_optimizer(name):
        return sum(2 * numel * size + 4 for numel, size in trainable)
    numels = [numel for numel, _ in trainable]
    total = 0
    for numel in numels:
        if numel >= BNB_MIN_8BIT_SIZE:
            total += 2 * numel + 2 * 4 * math.ceil(numel / BNB_BLOCK)
        else:
            total += 8 * numel
    if any(numel >= BNB_MIN_8BIT_SIZE for numel in numels):
        total += 2 * 256 * 4  # the two quantization maps (256 fp32 values each), shared by every tensor
    return total


def nf4_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of a weight in NF4 with its constants, as ``bitsandbytes.functional.quantize_4bit`` stores it (less its
    ~1 KiB of code tables)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    constants = blocks + 4 * math.ceil(blocks / NF4_SECOND_BLOCK) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + constants


def process_batch(cfg: DictConfig) -> tuple[int, int, int]:
    """``(micro-batch, share of the global batch, processes)`` of one process (one GPU); under DDP/FSDP each of
    ``trainer.devices x trainer.num_nodes`` processes accumulates ``global_batch_size / processes`` per step."""
    devices, nodes = world_size(cfg)
    processes = devices * nodes
    return cfg.batch.device_batch_size, cfg.batch.global_batch_size // processes, processes


def for_the_card(cfg: DictConfig) -> DictConfig:
    """``cfg`` (a copy) with ``precision=auto`` resolved for the ``hardware`` card, not this machine: ``bf16-mixed`` if
    ``hardware.bf16``, else ``16-mixed``."""
    if not precision_is_auto(cfg):
        return cfg
    planned = copy.deepcopy(cfg)
    with open_dict(planned):
        planned.trainer.precision = "bf16-mixed" if cfg.hardware.bf16 else "16-mixed"
    return planned


def plan_memory(
    cfg: DictConfig,
    task: Task,
    micro_batch: int | None = None,
    search: bool = True,
    config: PretrainedConfig | None = None,
    count: bool = False,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of one process of a composed ``train`` config at ``micro_batch`` (default
    :func:`process_batch`'s); ``count``: also count the step's kernels (``MemoryPlan.cost``, for :mod:`.steptime`).

    ``search``: also find the largest micro-batch that fits and divides the process's batch share: trace 1 and 2,
    extrapolate linearly (only activations grow), then trace the divisors down from the estimate until one fits.

    Raises:
        ConfigError: the architecture cannot be read (:func:`architecture`; or pass ``config``), or the module's checks fail.
    """
    cfg = for_the_card(cfg)
    config = config or architecture(cfg)
    device_batch, global_batch, _ = process_batch(cfg)
    micro_batch = micro_batch or device_batch
    budget = int(cfg.hardware.budget_gib * GIB)
    plan = _plan_at(cfg, task, config, micro_batch, budget, count)
    if not search:
        return plan
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    one = plan if micro_batch == 1 else _plan_at(cfg, task, config, 1, budget)
    two = plan if micro_batch == 2 else (_plan_at(cfg, task, config, 2, budget) if global_batch >= 2 else one)
    per_sample = max(1, two.total - one.total)
    estimate = 1 + (budget - one.total) // per_sample if one.fits else 0
    best, checked = 0, {p.micro_batch: p for p in (plan, one, two)}
    for candidate in reversed([d for d in divisors if d <= estimate]):
        trial = checked.get(candidate) or _plan_at(cfg, task, config, candidate, budget)
        if trial.fits:
            best = candidate
            break
    plan.max_micro_batch = best
    plan.max_micro_batch_accumulate = global_batch // best if best else None
    if not best:
        plan.advice = _advice(cfg, task, config, budget, one)
    return plan


PEAK_KEYS = ("params", "buffers", "grads", "optimizer", "activations", "temporaries")


def _plan_at(cfg: DictConfig, task: Task, config: PretrainedConfig, micro_batch: int, budget: int, count: bool = False) -> MemoryPlan:
    traced = trace(cfg, task, config, micro_batch, count)
    _, share, processes = process_batch(cfg)
    peak = dict(traced.peak)
    notes = []
    name = cfg.optimizer.name
    state = optimizer_state_bytes(traced.trainable, name)
    param_bytes = traced.param_bytes
    paged = 0
    if is_8bit_optimizer(name):
        notes.append(f"8-bit optimizer state counted as bitsandbytes stores it ({state / GIB:.2f} GiB), not as traced fp32 AdamW")
        peak["optimizer"] = state
        if is_paged_optimizer(name):
            paged, peak["optimizer"] = state, 0
            notes.append("paged optimizer state is in CUDA unified memory, outside PyTorch's allocator: not in the total")
    if traced.quantized_numels:
        double_quant = cfg.peft.double_quant
        bf16 = 2 * sum(traced.quantized_numels)
        nf4 = sum(nf4_bytes(n, double_quant) for n in traced.quantized_numels)
        peak["params"] += nf4 - bf16
        param_bytes += nf4 - bf16
        peak["temporaries"] += 2 * max(traced.quantized_numels)  # one dequantized bf16 weight at a time
        notes.append(f"QLoRA base counted in NF4 ({nf4 / GIB:.2f} GiB) instead of the traced bf16 ({bf16 / GIB:.2f} GiB)")
    ema = sum(4 * numel for numel, _ in traced.trainable) if (cfg.get("callbacks") or {}).get("ema") is not None else 0
    if ema:  # callbacks=ema: an fp32 copy of each trained tensor, alive for the whole run
        peak["optimizer"] += ema
        notes.append(f"callbacks=ema: the average of the trained weights ({ema / GIB:.2f} GiB) counted with the optimizer state")
    if cfg.get("loss") and cfg.loss.implementation == "liger":
        notes.append("loss=liger traced as the chunked loss with Liger's chunk count, ceil(vocab / hidden): Triton does not run on the CPU")
    if cfg.compile.mode != "off":
        notes.append("traced without torch.compile: compiled steps usually need less activation memory")
    if traced.pruning:
        peak = _with_pruning(cfg, peak, traced, notes)
    allocated = sum(peak[k] for k in PEAK_KEYS)
    for holder, size in task.resident_bytes(cfg).items():  # beside the model for the whole run, in every phase
        peak["buffers"] += size
        allocated += size
        notes.append(f"{holder}: {size / GIB:.2f} GiB on the GPU for the whole run, counted with the buffers")
    value_bytes, step, larger = compute_dtype(str(cfg.trainer.precision)).itemsize, dict(peak), "forward/backward"
    phases = task.memory_phases(cfg, config, micro_batch, value_bytes)
    for name, phase in phases.items():  # generation in the step (GRPO), an lm-eval pass at each validation
        kept = ("params", "buffers", "optimizer") + (("grads",) if phase["grads"] else ())
        total = sum(step[k] for k in kept) + phase["activations"] + phase["temporaries"]
        notes.append(
            f"{name} phase: {phase['activations'] / GIB:.2f} GiB of activations + {phase['temporaries'] / GIB:.2f} GiB of temporaries, "
            f"{total / GIB:.2f} GiB with the weights{', gradients' if phase['grads'] else ''} and optimizer state"
        )
        if total > allocated:
            peak = {**step, "activations": phase["activations"], "temporaries": phase["temporaries"]}
            peak["grads"] = step["grads"] if phase["grads"] else 0
            allocated, larger = total, name
    if phases:
        notes.append(
            f"the traced forward/backward: {sum(step[k] for k in PEAK_KEYS) / GIB:.2f} GiB allocated; the table is the largest ({larger})"
        )
    overhead = int(cfg.hardware.context_gib * GIB)
    host_budget = int((cfg.hardware.get("host_budget_gib") or 0) * GIB)
    if traced.offloaded_bytes:
        notes.append(
            f"activation offloading: {traced.offloaded_tensors} saved tensors ({traced.offloaded_bytes / GIB:.2f} GiB; "
            f"{traced.pinned_bytes / GIB:.2f} GiB pinned, each block a power of two) held in host memory from forward "
            "to backward, not on the GPU"
        )
    staging = checkpoint_staging_bytes(cfg, traced.trainable, param_bytes, state + ema)
    if staging:
        notes.append(
            f"background checkpoint writes stage each checkpoint in host memory: {staging / GIB:.2f} GiB in pinned blocks "
            "(the trained weights, optimizer state and EMA), reused by every save"
        )
    counts = {  # the full sizes, by arithmetic (the table is what is alive at the peak)
        "parameters": traced.n_params,
        "trainable": traced.n_trainable,
        "param_bytes": param_bytes,
        "grad_bytes": sum(numel * size for numel, size in traced.trainable),
        "optimizer_bytes": state,
        "ema_bytes": ema,
        "pruning_bytes": traced.pruning.masks + traced.pruning.recomputed if traced.pruning else 0,
    }
    return MemoryPlan(
        micro_batch=micro_batch,
        seq_len=cfg.data.max_length,
        accumulate=max(1, share // micro_batch),
        processes=processes,
        params=peak["params"],
        buffers=peak["buffers"],
        grads=peak["grads"],
        optimizer=peak["optimizer"],
        activations=peak["activations"],
        temporaries=peak["temporaries"],
        peak_allocated=allocated,
        overhead=overhead,
        total=allocated + overhead,
        budget=budget,
        fits=allocated + overhead <= budget and (not host_budget or traced.pinned_bytes <= host_budget),
        paged_optimizer=paged,
        counts=counts,
        corrections=notes,
        host_pinned=traced.pinned_bytes,
        host_budget=host_budget,
        offloaded_tensors=traced.offloaded_tensors,
        offloaded_bytes=traced.offloaded_bytes,
        host_staging=staging,
        cost=traced.cost,
        trainable=traced.trainable,
        offloaded_sizes=traced.offloaded_sizes,
    )


def background_checkpoints(cfg: DictConfig) -> bool:
    """Whether ``trainer.plugins`` has the checkpoint IO with ``background: true``."""
    plugins = (cfg.get("trainer") or {}).get("plugins") or []
    return any(
        isinstance(p, DictConfig) and str(p.get("_target_", "")).endswith("AtomicCheckpointIO") and p.get("background") for p in plugins
    )


def checkpoint_staging_bytes(cfg: DictConfig, trainable: list[tuple[int, int]], param_bytes: int, state_bytes: int) -> int:
    """Host bytes a background checkpoint write stages (:mod:`..checkpoints.writer`; 0 when synchronous), each tensor in a
    pinned block (:func:`..models.levers.pinned_block`): the trained tensors, without PEFT the frozen ones (one block),
    and ``state_bytes`` (optimizer state, EMA): each whole fp32 copy one block per tensor, the rest unrounded.
    """
    if not background_checkpoints(cfg) or not trainable:
        return 0
    weights = sum(pinned_block(numel * size) for numel, size in trainable)
    peft = (cfg.get("peft") or {}).get("method", "none")
    frozen = param_bytes - sum(numel * size for numel, size in trainable) if peft == "none" else 0
    trained = sum(numel for numel, _ in trainable)
    copies = state_bytes // (4 * trained)  # fp32 values per trained value
    rest = state_bytes - copies * 4 * trained
    state = copies * sum(pinned_block(numel * 4) for numel, _ in trainable) + rest
    return weights + (pinned_block(frozen) if frozen > 0 else 0) + state


def _with_pruning(cfg: DictConfig, peak: dict[str, int], traced: _Traced, notes: list[str]) -> dict[str, int]:
    """The peak with pruning (:class:`..compress.pruning.PruningMemory`): masks and recomputed weights live throughout; a
    pruning event (gradients, optimizer state, its temporaries) is the peak when larger than the traced step."""
    cost = traced.pruning
    peak = {**peak, "buffers": peak["buffers"] + cost.masks, "params": peak["params"] + cost.recomputed}
    grads = 0 if cfg.optimizer.step_in_backward else sum(numel * size for numel, size in traced.trainable)
    event = {**peak, "grads": grads, "activations": 0, "temporaries": cost.transient}
    notes.append(
        f"pruning={cfg.pruning.method}: +{(cost.masks + cost.recomputed) / GIB:.2f} GiB of masks and recomputed weights "
        f"for the whole fit, and {cost.transient / GIB:.2f} GiB of temporaries at each pruning step"
    )
    if sum(event.values()) > sum(peak.values()):
        notes.append("the peak is a pruning step (gradients, optimizer state and the pruning temporaries), not the traced step")
        return event
    return peak


def _advice(cfg: DictConfig, task: Task, config: PretrainedConfig, budget: int, one: MemoryPlan) -> list[str]:
    """When micro-batch 1 does not fit: each lever not pulled yet that lowers its total, largest saving first; then the
    levers the planner cannot try (a PEFT method needs its own group)."""
    if not one.host_fits:  # the host binds: no GPU lever helps that
        return [
            f"the offloaded activations need {one.host_pinned / GIB:.2f} GiB of pinned host memory, over "
            f"hardware.host_budget_gib={cfg.hardware.host_budget_gib}: a shorter data.max_length (now {cfg.data.max_length}), "
            "or a larger hardware.host_budget_gib if this machine has the RAM free (doctor reports it)"
        ]
    weights = one.params + one.grads + one.optimizer
    candidates, told = task.memory_advice(cfg, weights_dominate=weights > one.activations + one.temporaries)
    candidates = dict(candidates)
    if cfg.activation_checkpointing.mode == "none":
        candidates["activation_checkpointing=full"] = {"activation_checkpointing.mode": "full"}
    if not is_8bit_optimizer(cfg.optimizer.name):
        candidates["optimizer=adamw_8bit"] = {"optimizer.name": "adamw_8bit"}
    if cfg.get("pruning") and cfg.pruning.method != "none":
        candidates["pruning=none"] = {"pruning.method": "none"}
    if not cfg.optimizer.step_in_backward:
        candidates[
            "optimizer.step_in_backward=true (with batch.global_batch_size=batch.micro_batch_size, trainer.gradient_clip_val=null)"
        ] = {"optimizer.step_in_backward": True, "batch.global_batch_size": cfg.batch.micro_batch_size, "trainer.gradient_clip_val": None}
    savings = []
    for advice, changes in candidates.items():
        trial = copy.deepcopy(cfg)
        for key, value in changes.items():
            OmegaConf.update(trial, key, value, merge=False)
        try:  # a lever the config's other choices refuse (qat with step_in_backward, ...) is no advice
            validate_config(trial, task, runs_here=False)
        except ConfigError:
            continue
        saved = one.total - _plan_at(trial, task, config, 1, budget).total
        if saved > 0:
            savings.append((saved, f"{advice} (-{saved / GIB:.2f} GiB)"))
    advice = [text for _, text in sorted(savings, reverse=True)]
    if told:  # only when the config could take adapters (not with qat, pruning)
        adapters = copy.deepcopy(cfg)
        OmegaConf.update(adapters, "peft.method", "lora", merge=False)
        try:
            validate_config(adapters, task, runs_here=False)
            advice += told
        except ConfigError:
            pass
    advice.append(f"a shorter data.max_length (now {cfg.data.max_length})")
    return advice


def write_plan(plan: MemoryPlan | None, run_dir: Path, hardware: str, text: str | None = None, extra: dict | None = None) -> None:
    """Write ``plan.json`` (fields and ``extra``) and ``plan.txt`` (``text``, default the table) into ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fields = plan.as_json() if plan is not None else {}
    (run_dir / "plan.json").write_text(json.dumps({**fields, **(extra or {}), "hardware": hardware}, indent=2) + "\n")
    (run_dir / "plan.txt").write_text((text if text is not None else plan.table(hardware)) + "\n")


def check_memory_plan(cfg: DictConfig, task: Task, run_dir: Path, count: bool = False) -> tuple[str, MemoryPlan | None]:
    """Before a GPU run (``plan_before_fit: true``), plan it into ``run_dir`` and refuse one that will not fit.

    Skipped on the CPU, with ``plan_before_fit=false``, and (warning) when the architecture is unknown yet or under FSDP
    (the planner models one GPU holding the whole state).

    Returns:
        The run header's line (planned peak in GiB and budget, or why not planned) and the plan or ``None``; with the
        step's kernels when ``count`` (for :func:`.modes.predicted_step_ms`).

    Raises:
        ConfigError: the plan does not fit ``hardware.budget_gib`` (or the host budget); the message has the table and levers.
    """
    if not cfg.get("plan_before_fit"):
        return "not planned (plan_before_fit=false)", None
    if not uses_cuda(cfg):
        return "not planned (CPU)", None
    from ..run.distributed import is_fsdp

    if is_fsdp(cfg.trainer):
        rank_zero_warn(
            "memory plan skipped: trainer=fsdp shards parameters, gradients and optimizer state over the GPUs, "
            "and the planner models one GPU holding all of them (plan the run without FSDP for an upper bound)"
        )
        return "not planned (FSDP)", None
    try:
        config = architecture(cfg)
    except ConfigError as error:  # e.g. a scratch model whose tokenizer is not fetched yet
        rank_zero_warn(f"memory plan skipped, the architecture is unknown before the first fetch: {error}")
        return "not planned (architecture unknown before the first fetch)", None
    plan = plan_memory(cfg, task, config=config, search=False, count=count)  # one trace when it fits (the usual case)
    if not plan.fits:
        plan = plan_memory(cfg, task, config=config)  # the search, for the advice
    write_plan(plan, run_dir, cfg.hardware.name)
    if not plan.fits:
        fix = f"batch.micro_batch_size={plan.max_micro_batch}" if plan.max_micro_batch else "; ".join(plan.advice)
        where = f"{cfg.hardware.budget_gib} GiB ({cfg.hardware.name})"
        if not plan.host_fits:
            where += f" and {cfg.hardware.host_budget_gib} GiB of pinned host memory"
        raise ConfigError(
            f"this run will not fit in {where}:\n{plan.table(cfg.hardware.name)}\nfix: {fix}; or plan_before_fit=false to run anyway"
        )
    return f"planned peak {plan.total / 2**30:.2f} GiB of {cfg.hardware.budget_gib} GiB ({cfg.hardware.name}; plan.txt)", plan
