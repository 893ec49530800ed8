"""The memory/speed levers applied to a built Hugging Face model: activation checkpointing, with
activation offloading and the tiled MLP, and ``torch.compile`` (the ``activation_checkpointing``
and ``compile`` config groups).  Attention is chosen at
build time (``attn_implementation``), the loss in the task module.  Shared by both tasks and by
the memory planner, so the planner traces exactly what training runs."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..run.distributed import uses_cuda


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer layer in backward instead of keeping its activations.

    Through the model's own ``activation_checkpointing_enable`` (transformers >= 5.x; the older
    name ``gradient_checkpointing_enable`` before it, now a deprecated alias that warns) with
    ``use_reentrant=False``: the non-reentrant ``torch.utils.checkpoint`` gives the same gradients
    as no checkpointing, works when the layer inputs need no gradient (frozen embeddings under
    LoRA) and warns about nothing (PyTorch docs, ``torch.utils.checkpoint``: reentrant is the
    legacy variant).  ``use_cache`` is turned off, as a KV cache makes no sense while training
    (and HF would warn each step); the causal-LM module turns it back on for export (``merged_model``).
    """
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.config.use_cache = False


def compile_in_place(module: nn.Module, mode: str) -> None:
    """``torch.compile`` ``module`` in place (``nn.Module.compile``): the module object and its
    ``state_dict`` keys stay as they are (no ``_orig_mod.`` prefix), so a checkpoint written with
    compile on loads with compile off and back.

    Args:
        mode: ``default`` or ``max-autotune`` (``off`` is never passed here).
    """
    module.compile(mode=None if mode == "default" else mode)


def apply_memory_levers(model: nn.Module, activation_checkpointing: dict | None, trace: bool = False) -> ActivationOffload | None:
    """The ``activation_checkpointing`` group (a plain dict; ``None`` = off) on ``model``: checkpointing
    (``mode: full``), the tiled MLP (``mlp_tiles`` > 1) and activation offloading (``offload``),
    in that order.  ``trace``: the planner's fake-tensor trace (offloading copies nothing).

    Returns:
        The offloading hooks' object (its counters), or None when offloading is off.
    """
    group = activation_checkpointing or {}
    if group.get("mode") == "full":
        enable_activation_checkpointing(model)
    if (group.get("mlp_tiles") or 1) > 1:
        enable_tiled_mlp(model, group["mlp_tiles"])
    if group.get("offload"):
        return enable_activation_offloading(model, group.get("offload_min_bytes", 0), trace)
    return None


def apply_levers(
    model: nn.Module, activation_checkpointing: dict | None, compile_cfg: dict | None, compile_target: nn.Module | None = None
) -> ActivationOffload | None:
    """Apply the ``activation_checkpointing`` (:func:`apply_memory_levers`) and ``compile`` groups
    (plain dicts; ``None`` = off) to ``model``; compile ``compile_target`` (default: the whole
    model), e.g. the transformer body when the loss calls it directly.  Returns the offloading
    hooks' object or None."""
    offload = apply_memory_levers(model, activation_checkpointing)
    if compile_cfg and compile_cfg["mode"] != "off":
        compile_in_place(compile_target if compile_target is not None else model, compile_cfg["mode"])
    return offload


# ------------------------------------------------------------------ activation offloading
class ActivationOffload:
    """Saved-tensor hooks that move what autograd saves for backward to host memory in forward and
    bring it back in backward (``torch.autograd.graph.saved_tensors_hooks``, public PyTorch API).

    Used with non-reentrant activation checkpointing (:func:`enable_activation_offloading` refuses
    nothing itself; the config check refuses offloading without checkpointing): inside a
    checkpointed layer torch's own checkpoint hooks take precedence, so what reaches these hooks is
    what lives *between* the layers: each checkpointed layer's saved inputs (``(B, T, d)`` hidden
    states), the final norm's input and the loss's saved tensors.  What a checkpointed region
    recomputes in backward is never offloaded.  Kept on the device: tensors that are not floating
    point (token ids, boolean masks), tensors below ``min_bytes``, and any tensor sharing storage
    with a parameter (a saved weight or its transposed view).

    The copy (the design follows torchtune's ``OffloadActivations``; no code of it is used):

    - on CUDA, into pinned host memory on a side stream that first waits for the compute stream;
      the device tensor is kept for that stream (``record_stream``) so the allocator does not hand
      its memory out before the copy is done, and an event marks the copy's end; backward waits for
      that event on the compute stream and copies back (``non_blocking`` from pinned memory).
      The copy back is not prefetched: backward waits for each one (``bench/gpu_check.py``'s
      ``offload`` case measures the cost per step);
    - on the CPU, a real copy (``pin_memory`` needs CUDA, and a CPU-to-CPU ``.to`` is a no-op that
      would offload nothing), so the tests count the same tensors and bytes a GPU run moves;
    - ``trace=True`` (the memory planner, on fake tensors): nothing is copied; the tensor is dropped
      and backward allocates a new one of its shape, which is what the device sees.

    Attributes:
        tensors, bytes: how many tensors / bytes went to the host since :meth:`reset` (bytes are
            ``numel x element_size``; in one forward they are all held at once).
        pinned: the pinned host bytes those take: PyTorch's caching host allocator rounds each
            request up to a power of two (``CachingHostAllocator``), and reuses the blocks in the
            next micro-batch, so this is the host memory a run holds.
        restored: how many came back in backward.
    """

    def __init__(self, parameters: list[torch.Tensor], min_bytes: int, trace: bool = False) -> None:
        self.min_bytes, self.trace = min_bytes, trace
        self._stream = None
        self.keep(parameters)
        self.reset()

    def keep(self, parameters: list[torch.Tensor]) -> None:
        """Never offload these tensors or views of them.  Called again before each forward: moving
        a model to the GPU (or quantizing it) gives its parameters new storages."""
        # Storages are matched by identity (one Python object per storage, shared by its views),
        # held here so that their ids stay theirs.
        self._parameter_storages = [p.untyped_storage() for p in parameters]
        self._storage_ids = {id(storage) for storage in self._parameter_storages}

    def reset(self) -> None:
        self.tensors = self.bytes = self.pinned = self.restored = 0
        self.sizes: list[int] = []  # bytes of each offloaded tensor (the planner grows them with the length)

    def offloads(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.is_floating_point()
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and id(tensor.untyped_storage()) not in self._storage_ids
        )

    def pack(self, tensor: torch.Tensor):
        if not self.offloads(tensor):
            return tensor
        size = tensor.numel() * tensor.element_size()
        self.tensors += 1
        self.bytes += size
        self.sizes.append(size)
        self.pinned += pinned_block(size)
        if self.trace:
            return _Offloaded(None, tensor.shape, tensor.stride(), tensor.dtype, tensor.device, None)
        if tensor.device.type != "cuda":
            return _Offloaded(tensor.detach().clone(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Offloaded(host, tensor.shape, tensor.stride(), tensor.dtype, tensor.device, done)

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self.restored += 1
        if packed.host is None:  # trace: a new device tensor of the saved one's layout
            return torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=packed.device)
        if packed.done is None:
            return packed.host
        torch.cuda.current_stream(packed.device).wait_event(packed.done)
        return packed.host.to(packed.device, non_blocking=True)


def pinned_block(size: int) -> int:
    """Bytes of the pinned host block PyTorch's caching host allocator gives a ``size``-byte
    tensor: the next power of two."""
    return 1 << (size - 1).bit_length()


@dataclass(frozen=True)
class _Offloaded:
    host: torch.Tensor | None
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    done: object  # torch.cuda.Event | None


def checkpointed_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` of each layer that activation checkpointing wraps: transformers'
    ``GradientCheckpointingLayer`` with its ``gradient_checkpointing`` flag on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def layer_stack(model: nn.Module) -> nn.Module:
    """The module that calls the checkpointed layers (the owner of their ``ModuleList``: the
    ``LlamaModel`` body, BERT's encoder): hooks on it cover every layer's input however the model
    is entered (the chunked loss calls the body directly, not the ``*ForCausalLM`` wrapper).

    Raises:
        ConfigError: no checkpointed layer (activation checkpointing must be applied first).
    """
    layers = checkpointed_layers(model)
    if not layers:
        raise ConfigError(
            f"activation offloading found no checkpointed transformer layer in {type(model).__name__}; "
            "fix: activation_checkpointing=offload (it turns checkpointing on), or activation_checkpointing.offload=false"
        )
    owner = layers[0][0].rsplit(".", 2)[0] if layers[0][0].count(".") >= 2 else ""
    return model.get_submodule(owner)


def enable_activation_offloading(model: nn.Module, min_bytes: int, trace: bool = False) -> ActivationOffload:
    """Offload what is saved between checkpointed layers to host memory (:class:`ActivationOffload`)
    during each training forward of the layer stack (:func:`layer_stack`): a forward pre-hook opens
    the saved-tensor hooks and a forward hook (``always_call``: also when forward raises) closes
    them; forward without gradients (validation) is left alone.

    Args:
        min_bytes: smaller tensors stay on the device (``activation_checkpointing.offload_min_bytes``).
        trace: the memory planner's mode (no copy; see :class:`ActivationOffload`).

    Returns:
        The hooks' object, whose ``tensors``/``bytes`` count what went to the host.
    """
    stack = layer_stack(model)
    offload = ActivationOffload(list(model.parameters()), min_bytes, trace)
    opened: list = []

    def open_hooks(module, args):
        if module.training and torch.is_grad_enabled():
            offload.keep(list(model.parameters()))  # (their storages now: after .to(device), quantization)
            hooks = torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack)
            hooks.__enter__()
            opened.append(hooks)

    def close_hooks(module, args, output):
        if opened:
            opened.pop().__exit__(None, None, None)

    stack.register_forward_pre_hook(open_hooks)
    stack.register_forward_hook(close_hooks, always_call=True)
    return offload


# ------------------------------------------------------------------------------ tiled MLP
def enable_tiled_mlp(model: nn.Module, tiles: int) -> int:
    """Run each transformer layer's MLP over ``tiles`` slices of the sequence, each slice under
    non-reentrant ``torch.utils.checkpoint``: only one slice's intermediate activations
    (``(B, T/tiles, d_ff)`` for gate, up and their product) are alive at a time in forward and in
    backward, instead of the whole ``(B, T, d_ff)``; each slice is recomputed in backward.  The MLP
    acts on each position alone, so the output is the same; weight gradients are summed slice by
    slice (fp32 rounding order differs).  Applied while gradients are on; inference is untouched.

    The layer's ``mlp`` keeps its parameters and ``state_dict`` keys (its ``forward`` is wrapped
    on the instance).  Layers are transformers' ``GradientCheckpointingLayer`` (with or without
    activation checkpointing on).

    Returns:
        The number of MLPs tiled.

    Raises:
        ConfigError: a layer without an ``mlp`` submodule, or a model with no such layer.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    missing = [name for name, layer in layers if not isinstance(getattr(layer, "mlp", None), nn.Module)]
    if not layers or missing:
        where = f"layer {missing[0]!r} has no 'mlp' submodule" if missing else "no transformer layer found"
        raise ConfigError(
            f"activation_checkpointing.mlp_tiles={tiles}: {where} in {type(model).__name__}; fix: activation_checkpointing.mlp_tiles=1"
        )
    for _, layer in layers:
        layer.mlp.forward = functools.partial(_tiled_forward, layer.mlp.forward, tiles)
    return len(layers)


def _tiled_forward(forward, tiles: int, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` over ``tiles`` slices of ``hidden`` ``(B, T, d)`` along T, each checkpointed."""
    if not torch.is_grad_enabled() or hidden.dim() != 3 or hidden.shape[1] < 2 * tiles:
        return forward(hidden)
    return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in hidden.tensor_split(tiles, dim=1)], dim=1)


# The memory levers (configs/attention, activation_checkpointing, compile).
ATTENTION = ("sdpa", "flash_attention_2", "flex_attention", "eager")


# Those that attend within packed rows with no dense (B, 1, T, T) mask: flash-attn's varlen kernel,
# FlexAttention's block mask (the planner traces them mask-free).
MASK_FREE_ATTENTION = ("flash_attention_2", "flex_attention")


CHECKPOINTING = ("none", "full")


COMPILE_MODES = ("off", "default", "max-autotune")


def _flex_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """``attention=flex_attention``: torch's ``torch.nn.attention.flex_attention`` must exist, and
    training needs a CUDA GPU (on the CPU, FlexAttention has a forward only: its backward raises)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return [
            f"attention=flex_attention needs torch.nn.attention.flex_attention (torch >= 2.5; this is {torch.__version__}); fix: attention=sdpa"
        ]
    if runs_here and cfg.get("task_name") == "train" and not uses_cuda(cfg):
        return [
            "attention=flex_attention trains on a CUDA GPU only: on the CPU its backward is not implemented (torch "
            f"{torch.__version__}); fix: attention=sdpa here (the same attention, with a dense mask for packed rows)"
        ]
    return []


def _checkpointing_problems(cfg: DictConfig) -> list[str]:
    """The ``activation_checkpointing`` group: its mode, offloading (needs checkpointing, not with
    compile), the offload threshold and the MLP tiles."""
    group = cfg.activation_checkpointing
    problems = []
    if group.mode not in CHECKPOINTING:
        problems.append(f"activation_checkpointing.mode={group.mode!r} is not one of {CHECKPOINTING}; fix: activation_checkpointing=full")
    offload = group.get("offload", False)
    if not isinstance(offload, bool):
        problems.append(f"activation_checkpointing.offload={offload!r} must be true or false")
    elif offload and group.mode != "full":
        problems.append(
            f"activation_checkpointing.offload=true with activation_checkpointing.mode={group.mode}: offloading moves the "
            "inputs checkpointing keeps, and without it every activation would cross PCIe; fix: activation_checkpointing=offload"
        )
    elif offload and "compile" in cfg and str(cfg.compile.mode) != "off":
        problems.append(
            f"activation_checkpointing.offload=true with compile={cfg.compile.mode}: the saved-tensor hooks are not traced "
            "by torch.compile here (not tested together); fix: compile=off, or activation_checkpointing=full"
        )
    threshold = group.get("offload_min_bytes", 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        problems.append(f"activation_checkpointing.offload_min_bytes={threshold!r} must be a whole number of bytes >= 0, e.g. 1048576")
    tiles = group.get("mlp_tiles", 1)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        problems.append(f"activation_checkpointing.mlp_tiles={tiles!r} must be a whole number >= 1 (1 = off); fix: e.g. mlp_tiles=8")
    elif "data" in cfg and isinstance(cfg.data.get("max_length"), int) and tiles > cfg.data.max_length:
        problems.append(
            f"activation_checkpointing.mlp_tiles={tiles} is more than data.max_length={cfg.data.max_length} tokens; "
            "fix: at most the block length (e.g. 8)"
        )
    return problems


def lever_problems(cfg: DictConfig, runs_here: bool) -> list[str]:
    """The ``attention``, ``activation_checkpointing`` and ``compile`` groups, and their conflicts."""
    problems = []
    attention = cfg.attention.implementation if "attention" in cfg else "sdpa"
    if attention not in ATTENTION:
        problems.append(f"attention.implementation={attention!r} is not one of {ATTENTION}; fix: attention=sdpa")
    elif (
        attention == "flash_attention_2" and runs_here and (importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available())
    ):
        problems.append(
            "attention=flash_attention_2 needs the flash-attn package and a CUDA GPU (Ampere or newer); "
            "fix: pip install flash-attn --no-build-isolation, or attention=sdpa (PyTorch's own flash kernel)"
        )
    elif attention == "flex_attention":
        problems += _flex_problems(cfg, runs_here)
    if "activation_checkpointing" in cfg:
        problems += _checkpointing_problems(cfg)
    if "compile" in cfg and str(cfg.compile.mode) not in COMPILE_MODES:
        problems.append(f"compile.mode={cfg.compile.mode!r} is not one of {COMPILE_MODES}; fix: compile=default")
    return problems
