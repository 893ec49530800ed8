"""Training throughput: tokens/s, samples/s, model TFLOP/s and MFU (model FLOPs utilization).

Lightning's ``Throughput`` does the rate arithmetic, but not its ``ThroughputMonitor`` callback: that overwrites our
peak from a table listing the RTX 4090 at 82.6 bf16 TFLOP/s (the CUDA-core rate; tensor cores: 165.2, so MFU would
read 2x), and synchronises CUDA after every micro-batch.

FLOPs per token follow PaLM (Chowdhery et al. 2022, Appendix B): ``6N + 12·L·H·Q·T`` (``N`` parameters, ``L`` layers,
``H`` heads, head dim ``Q``, length ``T``). A frozen parameter (LoRA's base) skips its weight gradient: 4 FLOPs, so
``6·N_trainable + 4·N_frozen``. The attention term counts the dense ``T×T`` scores (the usual convention for a causal
LM); for BERT encoders the formula is approximate; gradient-checkpointing recomputation is not counted (that is HFU)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.utilities import rank_zero_only
from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# Attention masks held (references to (B, T) masks) before they are summed: e.g. 64 x 4 x 4096 int64 = 8 MiB.
HELD_MASKS = 64

# Dense bf16 tensor-core peak (fp32 accumulate), TFLOP/s, by a pattern in the lower-cased device name; first match
# wins. Datasheets quote "with sparsity" figures, twice the dense rate.
PEAK_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    (r"rtx 4090$", 165.2, "NVIDIA Ada GPU architecture whitepaper v2.1, Appendix A: BF16 tensor with FP32 accumulate 165.2 (330.4 sparse)"),
    (
        r"rtx 3090$",
        71.0,
        "NVIDIA Ampere GA102 GPU architecture whitepaper v2, Appendix A: FP16/BF16 tensor with FP32 accumulate 71 (142 sparse)",
    ),
    (r"\ba10g\b", 70.0, "AWS-only A10 variant, no NVIDIA datasheet: 70, the figure quoted for AWS G5 instances (unverified)"),
    (r"\ba10$", 125.0, "NVIDIA A10 datasheet: BF16 tensor 125 (250 sparse)"),
    (r"\bl4$", 121.0, "NVIDIA L4 datasheet: BF16 tensor 242 with sparsity"),
    (r"\ba100\b", 312.0, "NVIDIA A100 datasheet: BF16 tensor 312 (624 sparse), SXM and PCIe alike"),
    (r"h100 pcie", 756.0, "NVIDIA H100 datasheet, PCIe: BF16 tensor 1,513 with sparsity"),
    (r"h100 (sxm|80gb hbm3)", 989.4, "NVIDIA H100 datasheet, SXM: BF16 tensor 1,979 with sparsity"),
    (r"h200 nvl", 835.5, "NVIDIA H200 datasheet, NVL: BF16 tensor 1,671 with sparsity"),
    (r"h200", 989.4, "NVIDIA H200 datasheet, SXM: BF16 tensor 1,979 with sparsity (same GH100 die as H100 SXM)"),
)


def peak_tflops_for(device_name: str) -> float | None:
    """The dense bf16 peak of :data:`PEAK_BF16_TFLOPS` for a CUDA device name, or None if unknown."""
    name = device_name.lower().strip()
    for pattern, tflops, _source in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops
    return None


def flops_per_token(n_trainable: int, n_frozen: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: ``6·n_trainable + 4·n_frozen + 12·L·H·Q·T`` (PaLM; module docstring)."""
    return 6.0 * n_trainable + 4.0 * n_frozen + 12.0 * n_layers * n_heads * head_dim * seq_len


def count_parameters(module: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameters that multiply activations: embedding lookups are left out (Kaplan et al.
    2020's "non-embedding" count) unless tied to another layer (an LM head); a 4-bit ``Params4bit`` counts ``quant_state.shape``."""
    lookup_only = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}
    lookup_only -= {id(p) for m in module.modules() if not isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}
    trainable = frozen = 0
    for parameter in module.parameters():  # each shared tensor once
        if id(parameter) in lookup_only:
            continue
        quant_state = getattr(parameter, "quant_state", None)
        count = quant_state.shape.numel() if quant_state is not None else parameter.numel()
        if parameter.requires_grad:
            trainable += count
        else:
            frozen += count
    return trainable, frozen


def architecture(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(layers, attention heads, head dim)`` from a Hugging Face config; heads are query heads (under GQA each still
    scores ``T`` keys); head dim is ``head_dim`` or the hidden size over the heads.

    Raises:
        ValueError: a field is missing (an encoder-decoder or multimodal config, say).
    """

    def first(*names: str) -> int | None:
        return next((getattr(config, n) for n in names if getattr(config, n, None)), None)

    n_layers, n_heads = first("num_hidden_layers", "n_layer"), first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd", "d_model")
    head_dim = first("head_dim") or (hidden // n_heads if hidden and n_heads else None)
    if not (n_layers and n_heads and head_dim):
        raise ValueError(
            f"{type(config).__name__} lacks num_hidden_layers/n_layer, num_attention_heads/n_head or "
            f"head_dim/hidden_size (got layers={n_layers}, heads={n_heads}, head_dim={head_dim})"
        )
    return n_layers, n_heads, head_dim


def hf_config_of(module: torch.nn.Module) -> PretrainedConfig | None:
    """The config of the first Hugging Face model inside ``module`` (through a PEFT wrapper too)."""
    return next((m.config for m in module.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)), None)


def resolve_peak_tflops(device: torch.device, configured: float | None) -> tuple[float | None, str | None]:
    """The peak to divide by, and a note for the log when there is none or it may be wrong: ``configured``
    (``hardware.peak_tflops``) wins, else :data:`PEAK_BF16_TFLOPS`; off a CUDA GPU none, whatever is configured."""
    if device.type != "cuda":
        return None, f"training on {device.type}: no perf/mfu (MFU is measured against a GPU's tensor-core peak)"
    name = torch.cuda.get_device_name(device)
    table = peak_tflops_for(name)
    if configured is not None:
        if table is not None and table != configured:
            return configured, f"hardware.peak_tflops={configured} but the table gives {table} for {name!r}; MFU uses {configured}"
        return configured, None
    if table is None:
        return None, f"no perf/mfu: {name!r} is not in PEAK_BF16_TFLOPS; set hardware.peak_tflops (dense bf16 TFLOP/s)"
    return table, None


class TokenThroughput(L.Callback):
    """Every ``every_n_steps`` optimizer steps and at the end of training, log the rates since the last log:
    ``perf/tokens_per_sec`` (real tokens, padding excluded), ``perf/samples_per_sec``, ``perf/tflops`` (:func:`flops_per_token`
    x real tokens, ``T = input_ids.shape[1]``) and ``perf/mfu`` (``perf/tflops / peak``, 0-1; only with a known peak).

    Per device. A row's step is the last optimizer step it covers, as Lightning numbers its rows (``global_step - 1``),
    so ``perf/*`` and ``train/loss`` share a W&B row. Batches are dicts with ``input_ids`` ``(B, T)`` and optionally
    ``attention_mask`` or ``token_mask`` ``(B, T)``. The clock starts after the first optimizer step (warm-up,
    autotuning, compile) and stops during validation; CUDA is synchronised only there and at the logs.

    Args:
        peak_tflops: dense bf16 peak of one GPU in TFLOP/s; None = look it up in :data:`PEAK_BF16_TFLOPS`.

    Raises:
        ValueError: ``every_n_steps`` < 1 or ``peak_tflops`` <= 0; a batch that is not a dict with ``input_ids``.
    """

    def __init__(self, every_n_steps: int, peak_tflops: float | None = None) -> None:
        if every_n_steps < 1 or (peak_tflops is not None and peak_tflops <= 0):
            raise ValueError(
                f"callbacks.throughput: every_n_steps={every_n_steps} must be >= 1 and "
                f"peak_tflops={peak_tflops} > 0 or null (look the GPU up)"
            )
        self.every_n_steps, self.peak_tflops = every_n_steps, peak_tflops
        self.device = torch.device("cpu")
        self.flops_args: tuple[int, int, int, int, int] | None = None  # flops_per_token's arguments but T
        self._said: set[str] = set()
        self._peak: float | None = None
        self._rates: Throughput | None = None  # None until the first optimizer step is done
        self._last_step = 0
        self._logged_step = 0  # the optimizer step of the last log (or of the clock's start)
        self._t0 = 0.0
        self._paused_at: float | None = None  # validation started here; the clock is stopped
        self._paused_seconds = 0.0
        self._reset_window()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.device = trainer.strategy.root_device
        peak, message = resolve_peak_tflops(self.device, self.peak_tflops)
        self._peak = peak
        if message:
            self._say_once(message)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        config = hf_config_of(pl_module)
        try:
            if config is None:
                raise ValueError(f"{type(pl_module).__name__} holds no Hugging Face model")
            self.flops_args = (*count_parameters(pl_module), *architecture(config))
        except ValueError as error:
            self.flops_args = None
            self._say_once(f"no perf/tflops or perf/mfu: {error}")
        self._rates, self._last_step, self._paused_at = None, trainer.global_step, None
        self._reset_window()  # on the trainer's device now

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._paused_at is not None:  # back from validation (and checkpointing): the clock runs again
            self._paused_seconds += time.perf_counter() - self._paused_at
            self._paused_at = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._count(batch)
        step = trainer.global_step
        if step == self._last_step:
            return  # gradient accumulation: no optimizer step yet
        self._last_step = step
        if self._rates is None:
            self._start()
        elif (step - 1) % self.every_n_steps == 0:  # (the row's step, step - 1, a multiple of the period)
            self._log(trainer, step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._rates is not None and trainer.global_step > self._logged_step and self._window_batches:
            self._log(trainer, trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._rates is not None and not trainer.sanity_checking:
            self._synchronize()
            self._paused_at = time.perf_counter()

    def _count(self, batch: object) -> None:
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(f"TokenThroughput needs dict batches with input_ids (B, T); got {type(batch).__name__}")
        input_ids = batch["input_ids"]  # (B, T)
        mask = batch.get("token_mask", batch.get("attention_mask"))  # (B, T), 1 = real token (packed chat rows: token_mask)
        if mask is None:  # every position is a token: counted on the host, no device work
            per_token = flops_per_token(*self.flops_args, input_ids.shape[1]) if self.flops_args is not None else 0.0
            self._host_tokens += input_ids.numel()
            self._host_flops += input_ids.numel() * per_token
        else:
            # Stay on the device (.item() would synchronise every micro-batch): hold the masks, sum them in _fold.
            self._masks.setdefault(input_ids.shape[1], []).append(mask)
            self._held_masks += 1
            if self._held_masks >= HELD_MASKS:
                self._fold()
        self._window_samples += input_ids.shape[0]
        self._window_batches += 1

    def _fold(self) -> None:
        """Add the held masks' tokens (and their FLOPs) to the window's device counters."""
        for length, masks in self._masks.items():
            tokens = torch.cat([mask.reshape(-1) for mask in masks]).sum() if len(masks) > 1 else masks[0].sum()
            per_token = flops_per_token(*self.flops_args, length) if self.flops_args is not None else 0.0
            self._window_tokens.add_(tokens)
            self._window_flops.add_(tokens, alpha=per_token)
        self._masks, self._held_masks = {}, 0

    def _reset_window(self) -> None:
        self._masks: dict[int, list[torch.Tensor]] = {}  # sequence length T -> attention masks (B, T) not yet counted
        self._held_masks = 0
        self._window_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self._window_flops = torch.zeros((), dtype=torch.float64, device=self.device)
        self._host_tokens, self._host_flops = 0, 0.0
        self._window_samples = self._window_batches = 0

    def _start(self) -> None:
        """Start the clock after the first optimizer step (its micro-batches are not counted)."""
        self._synchronize()
        self._reset_window()
        self._totals = {"batches": 0, "samples": 0, "lengths": 0}
        self._rates = Throughput(available_flops=self._peak * 1e12 if self._peak else None, window_size=2)
        self._logged_step = self._last_step
        self._rates.update(time=0.0, **self._totals, flops=0)
        self._t0, self._paused_at, self._paused_seconds = time.perf_counter(), None, 0.0

    def _log(self, trainer: L.Trainer, step: int) -> None:
        self._fold()
        self._synchronize()
        end = self._paused_at if self._paused_at is not None else time.perf_counter()  # (training ended in a validation)
        elapsed = end - self._t0 - self._paused_seconds
        self._logged_step = step
        self._totals["batches"] += self._window_batches
        self._totals["samples"] += self._window_samples
        self._totals["lengths"] += int(self._window_tokens.item()) + self._host_tokens
        flops = self._window_flops.item() + self._host_flops if self.flops_args is not None else None
        self._rates.update(time=elapsed, **self._totals, flops=flops)
        rates = self._rates.compute()  # a window of 2 updates: the rates since the last log
        metrics = {"perf/tokens_per_sec": rates["device/items_per_sec"], "perf/samples_per_sec": rates["device/samples_per_sec"]}
        if "device/flops_per_sec" in rates:
            metrics["perf/tflops"] = rates["device/flops_per_sec"] / 1e12
        if "device/mfu" in rates:
            metrics["perf/mfu"] = rates["device/mfu"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        self._reset_window()  # the clock runs on from t0; the totals above carry the counts

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            _say(f"TokenThroughput: {message}")


@rank_zero_only
def _say(message: str) -> None:
    log.info(message)
