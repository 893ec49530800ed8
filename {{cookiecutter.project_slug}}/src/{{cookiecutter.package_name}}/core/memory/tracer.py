"""Peak memory of one training step, traced on fake tensors (shape, dtype and device, no storage).

The only module on PyTorch's private tracing API (``torch._subclasses.fake_tensor.FakeTensorMode``,
``torch.distributed._tools.mem_tracker.MemTracker``); ``tests/test_planner.py`` pins what we rely on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# MemTracker's categories -> ours (the planner's table rows).
CATEGORIES = {
    "PARAM": "params",
    "BUFFER": "buffers",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",  # allocated in forward and alive at the peak (saved for backward)
    "TEMP": "temporaries",  # allocated in backward: activation gradients, recomputation, workspaces
    "OTH": "temporaries",  # anything else (inputs, loss scalars)
}

# Ops CUDA autocast runs in float32 ("CUDA Ops that can autocast to float32", PyTorch AMP docs); CPU autocast keeps bf16.
CUDA_FP32_FUNCTIONS = {
    F.layer_norm,
    F.group_norm,
    F.softmax,
    F.log_softmax,
    F.cross_entropy,
    F.nll_loss,
    torch.layer_norm,
    torch.group_norm,
    torch.softmax,
    torch.log_softmax,
    torch.Tensor.softmax,
    torch.Tensor.log_softmax,
}


class CudaAutocastEmulation(TorchFunctionMode):
    """Under CPU autocast, run the ops CUDA autocast runs in float32 in float32, as CUDA would; both already agree on
    the matmul-class ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_FP32_FUNCTIONS and torch.is_autocast_enabled("cpu"):
            up = lambda value: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value  # noqa: E731
            with torch.autocast("cpu", enabled=False):
                return func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)


MASK_FREE_SDPA = "planner_mask_free_sdpa"


def mask_free_sdpa() -> str:
    """Register (idempotent) and name an attention implementation tracing kernels that need no dense mask
    (``flash_attention_2``, ``flex_attention``): transformers' SDPA with no mask (its ``is_causal`` path).

    Why: on fake tensors transformers cannot prove a causal mask skippable, so plain ``sdpa`` materialises a
    ``(B, 1, T, T)`` mask; one registered via ``transformers.AttentionInterface`` without a mask function gets none."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register(MASK_FREE_SDPA, attention)
    return MASK_FREE_SDPA


@contextmanager
def fake_tensors() -> Iterator[None]:
    """Every tensor created inside is a fake CPU tensor (no storage, no real memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        yield


def materialize_fake(model: torch.nn.Module) -> None:
    """Replace every parameter and buffer of a ``meta``-built model by a fake CPU tensor alike (tied ones stay tied);
    call inside :func:`fake_tensors`.  Built on ``meta`` first: ``nn.Module.to`` (peft and Lightning casts call it)
    cannot swap fake parameters in place.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in replaced:
                    fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                    replaced[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")


class _NoHook:
    def remove(self) -> None:
        pass


def _tracker():
    """``MemTracker`` with two changes, pinned by ``tests/test_planner.py``: only the global peak is kept (per-module
    peaks make a trace quadratic in depth), and frozen parameters get no gradient hook (PyTorch refuses one).
    """
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeakMemTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return GlobalPeakMemTracker()


def peak_bytes(step: Callable[[], None], tracked: list[torch.nn.Module | torch.optim.Optimizer], mixed: bool) -> dict[str, int]:
    """Run ``step`` (forward + backward + optimizer step built inside :func:`fake_tensors`, optimizer state already
    there) under the memory tracker; ``tracked``: the modules and optimizers whose tensors are params/buffers/grads/state;
    ``mixed``: under CPU autocast, emulate CUDA's float32 ops.

    Returns:
        Bytes alive at the peak by category (``params``, ``buffers``, ``grads``, ``optimizer``, ``activations``,
        ``temporaries``), and ``total``.
    """
    tracker = _tracker()
    tracker.track_external(*tracked)
    with tracker, warnings.catch_warnings():
        # step_in_backward frees each gradient before the tracker's hook reads it: a None warning (the free still counts).
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        if mixed:
            with CudaAutocastEmulation():
                step()
        else:
            step()
    snapshot = tracker.get_tracker_snapshot("peak")
    result = dict.fromkeys(["params", "buffers", "grads", "optimizer", "activations", "temporaries"], 0)
    for per_device in snapshot.values():
        for kind, size in per_device.items():
            if kind != "Total":
                result[CATEGORIES[kind.name]] += size
    result["total"] = sum(per_device["Total"] for per_device in snapshot.values())
    return result


class OpCounter:
    """Counts a step's kernels: per non-view aten op, its FLOPs (``torch.utils.flop_counter.flop_registry``, 0 without a
    formula) and the bytes of its tensor inputs and outputs (the roofline's memory traffic).  Not ``FlopCounterMode``: it
    decomposes ops without a formula, which changes what autograd saves.

    Use ``with counter:`` around the step, ``counter.phase`` ``"micro"`` (forward, backward) or ``"optimizer"``;
    ``counter.ops[phase]``: ``(flops, bytes, pointwise, low_precision)`` per kernel (``low_precision``: first floating
    input 16-bit).  A ``torch.utils._python_dispatch.TorchDispatchMode`` (private; ``tests/test_planner.py`` pins it).
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self
        self.phase = "micro"
        self.ops: dict[str, list[tuple[int, int, bool, bool]]] = {"micro": [], "optimizer": []}

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                # Kernels only: aten ops returning tensors or nothing (in-place foreach), not Python values or views.
                if (
                    func.namespace == "aten"
                    and not func.is_view
                    and func.overloadpacket.__name__ not in FREE_OPS
                    and _is_kernel_output(out)
                ):
                    formula = flop_registry.get(func.overloadpacket)
                    flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
                    moved = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
                    pointwise = torch.Tag.pointwise in func.tags
                    counter.ops[counter.phase].append((flops, moved, pointwise, _low_precision(args)))
                return out

        self._dispatch = _Dispatch()

    def __enter__(self) -> OpCounter:
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.__exit__(*exc)


# Ops that launch no kernel and move no bytes (allocation, aliasing) though not tagged as views.
FREE_OPS = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "detach",
        "alias",
        "set_",
        "_unsafe_view",
        "_reshape_alias",
    }
)


def _is_kernel_output(value) -> bool:
    if value is None or isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _low_precision(args) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    return first is not None and first.element_size() == 2


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0
