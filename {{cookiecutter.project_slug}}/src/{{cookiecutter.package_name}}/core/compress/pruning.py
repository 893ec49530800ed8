"""Pruning during training (the ``pruning`` group) on ``torch.nn.utils.prune``, driven by :class:`..callbacks.pruning.Pruning`.

- ``magnitude``: global L1 pruning of the transformer blocks' ``nn.Linear`` weights, ramped to ``final_sparsity`` along
  the cubic schedule of Zhu & Gupta 2017 (:func:`scheduled_sparsity`); the zeros stay dense, saving no memory or time.
- ``structured``: whole FFN neurons, the same count per block, ramped the same way; :func:`shrink_ffn` removes them.
- ``semi_structured_2_4``: the 2 smallest of every 4 consecutive input weights zeroed once, at ``begin_step`` (NVIDIA's
  sparse tensor cores, Ampere and later); :func:`to_semi_structured_sparse` converts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import prune

from ..errors import ConfigError
from . import CONV1D_MODEL_TYPES, conv1d_refusal

METHODS = ("none", "magnitude", "structured", "semi_structured_2_4")
# Families whose FFN ``structured`` knows: BERT-style (intermediate.dense -> output.dense), gated (gate/up_proj -> down_proj).
BERT_FFN_TYPES = ("bert", "roberta", "xlm-roberta", "electra")
GATED_FFN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# to_sparse_semi_structured (CUTLASS) takes fp16/bf16 weights of multiples of 32 x 64: torch/sparse/semi_structured.py, 2.13.
SEMI_STRUCTURED_ROWS, SEMI_STRUCTURED_COLS = 32, 64


def pruning_problems(
    pruning: dict, peft: dict | None = None, qat: dict | None = None, trainer: dict | None = None, model: dict | None = None
) -> list[str]:
    """What is wrong with a ``pruning`` group (and its conflicts), one line each with the fix; ``[]`` if nothing.

    Refused: bad method, steps, frequency or ``final_sparsity`` (0.5 for 2:4, which prunes once); LoRA/QLoRA (frozen
    base); QAT; FSDP (it shards the masked weights); Conv1D families; ``structured`` on a family whose FFN it does not know.
    """
    method = pruning.get("method")
    if method not in METHODS:
        return [f"pruning.method={method!r} is not one of {METHODS}; fix: pruning=magnitude (or none, structured, semi_structured_2_4)"]
    if method == "none":
        return []
    problems = []

    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    begin, end, frequency, final = (pruning.get(key) for key in ("begin_step", "end_step", "frequency", "final_sparsity"))
    if not is_int(begin) or begin < 0:
        problems.append(
            f"pruning.begin_step={begin!r} must be an integer >= 0 (optimizer steps before the first pruning); fix: e.g. pruning.begin_step=0"
        )
    if method == "semi_structured_2_4":
        for key, value in (("end_step", end), ("frequency", frequency)):
            if value is not None:
                problems.append(f"pruning.{key}={value!r}: semi_structured_2_4 prunes once, at begin_step; fix: pruning.{key}=null")
        if final != 0.5:
            problems.append(
                f"pruning.final_sparsity={final!r}: the 2:4 pattern keeps 2 of every 4 weights; fix: pruning.final_sparsity=0.5"
            )
    else:
        if not is_int(end):
            problems.append(
                f"pruning.end_step={end!r} must be an integer (the optimizer step the ramp ends at); fix: e.g. pruning.end_step=200"
            )
        elif is_int(begin) and begin >= end:
            problems.append(
                f"pruning.begin_step={begin} >= pruning.end_step={end}: the ramp needs at least one step; fix: pruning.end_step={begin + 100}"
            )
        if not is_int(frequency) or frequency < 1:
            problems.append(
                f"pruning.frequency={frequency!r} must be an integer >= 1 (optimizer steps between prunings); fix: e.g. pruning.frequency=10"
            )
        if not isinstance(final, (int, float)) or isinstance(final, bool) or not 0 <= final < 1:
            problems.append(
                f"pruning.final_sparsity={final!r} must be in [0, 1) (the fraction of weights zeroed); fix: e.g. pruning.final_sparsity=0.5"
            )
    if peft and peft.get("method", "none") != "none":
        problems.append(
            f"pruning={method} with peft={peft.get('method')}: the base weights are frozen, so there is nothing trained to prune; "
            "fix: peft=none (prune a full fine-tune), or pruning=none"
        )
    if qat and qat.get("scheme", "none") != "none":
        problems.append(
            f"pruning={method} with qat={qat.get('scheme')}: one change of the Linear layers per run; fix: prune first, then QAT"
        )
    if trainer:
        from ..run.distributed import is_fsdp

        if is_fsdp(trainer):
            problems.append(f"pruning={method} with trainer=fsdp: FSDP shards the weights the masks cover; fix: trainer=ddp or one GPU")
    model_type = model_type_named(model) if model else None
    if model_type in CONV1D_MODEL_TYPES:
        problems.append(conv1d_refusal(f"pruning={method}", model_type, "pruning=none"))
    elif method == "structured" and model_type is not None and model_type not in BERT_FFN_TYPES + GATED_FFN_TYPES:
        problems.append(structured_refusal(model_type))
    return problems


def model_type_named(model: dict) -> str | None:
    """The model family a ``model`` group names without reading files (``config``, else ``architecture``), or ``None``."""
    for node in (model.get("config"), model.get("architecture")):
        if node and isinstance(node.get("model_type"), str):
            return node["model_type"]
    return None


def hidden_size_named(model: dict) -> int | None:
    """The hidden size a ``model`` group names without reading files (``hidden_size``, GPT-2's ``n_embd``), or ``None``."""
    for node in (model.get("config"), model.get("architecture")):
        for key in ("hidden_size", "n_embd"):
            if node and isinstance(node.get(key), int):
                return node[key]
    return None


def structured_refusal(model_type: str) -> str:
    """The refusal of ``pruning=structured`` for a model family whose FFN it does not know."""
    return (
        f"pruning=structured does not know the FFN of model_type={model_type!r} (it knows {', '.join(BERT_FFN_TYPES + GATED_FFN_TYPES)}); "
        "fix: pruning=magnitude or semi_structured_2_4, or a model of those families"
    )


def scheduled_sparsity(step: int, begin_step: int, end_step: int, final_sparsity: float, frequency: int, initial: float = 0.0) -> float:
    """Sparsity after ``step`` optimizer steps: Zhu & Gupta 2017, "To prune, or not to prune", eq. 1,

        s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))**3,   t in {t0, t0 + dt, ..., t0 + n * dt}

    with ``t0 = begin_step``, ``dt = frequency``, last point ``end_step``, ``s_i = initial``; held between points, 0
    before ``begin_step``.
    """
    if step < begin_step:
        return 0.0
    point = min(begin_step + (step - begin_step) // frequency * frequency, end_step)
    if step >= end_step:
        point = end_step
    progress = (point - begin_step) / (end_step - begin_step)
    return final_sparsity + (initial - final_sparsity) * (1 - progress) ** 3


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: children of the ``nn.ModuleList``(s) as long as ``config.num_hidden_layers``.

    Raises:
        ConfigError: none found.
    """
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    blocks = [block for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers for block in m]
    if not blocks:
        raise ConfigError(f"pruning: no list of {n_layers} transformer blocks in {type(model).__name__}; fix: pruning=none for this model")
    return blocks


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(qualified name, layer)`` of every ``nn.Linear`` inside the transformer blocks (not embeddings or heads), in order.

    Raises:
        ConfigError: no such layer (GPT-2's blocks use ``Conv1D``).
    """
    inside = {id(m) for block in transformer_blocks(model) for m in block.modules()}
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]
    if not found:
        raise ConfigError(f"pruning: {type(model).__name__} has no nn.Linear layer in its transformer blocks; fix: pruning=none")
    return found


@dataclass
class FFNBlock:
    """One block's FFN: ``rows``, the layers whose output rows (and biases) are the neurons; ``columns``, whose inputs are."""

    rows: list[nn.Linear]
    columns: nn.Linear

    @property
    def width(self) -> int:
        return self.columns.in_features


def ffn_blocks(model: nn.Module) -> list[FFNBlock]:
    """Each block's FFN: BERT ``intermediate.dense`` -> ``output.dense``, Llama ``mlp.gate_proj``/``up_proj`` -> ``down_proj``.

    Raises:
        ConfigError: a block with neither layout.
    """
    blocks = []
    for block in transformer_blocks(model):
        intermediate, output, mlp = (getattr(block, name, None) for name in ("intermediate", "output", "mlp"))
        if isinstance(getattr(intermediate, "dense", None), nn.Linear) and isinstance(getattr(output, "dense", None), nn.Linear):
            blocks.append(FFNBlock([intermediate.dense], output.dense))
        elif mlp is not None and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            blocks.append(FFNBlock([mlp.gate_proj, mlp.up_proj], mlp.down_proj))
        else:
            raise ConfigError(structured_refusal(getattr(getattr(model, "config", None), "model_type", type(model).__name__)))
    return blocks


def pruned_tensors(model: nn.Module, method: str) -> list[tuple[nn.Module, str]]:
    """``(module, tensor name)`` of every tensor ``method`` masks: block Linear weights, or (``structured``) FFN weights and biases.

    Raises:
        ConfigError: see :func:`block_linears`, :func:`ffn_blocks`; for 2:4, ``in_features`` not a multiple of 4.
    """
    if method == "structured":
        tensors = []
        for block in ffn_blocks(model):
            for layer in block.rows:
                tensors += [(layer, "weight")] + ([(layer, "bias")] if layer.bias is not None else [])
            tensors.append((block.columns, "weight"))
        return tensors
    linears = block_linears(model)
    if method == "semi_structured_2_4":
        odd = [f"{name} ({layer.in_features})" for name, layer in linears if layer.in_features % 4]
        if odd:
            raise ConfigError(
                f"pruning=semi_structured_2_4 needs in_features divisible by 4 (groups of 4 input weights); not: {', '.join(odd[:5])}; "
                "fix: pruning=magnitude"
            )
    return [(layer, "weight") for _, layer in linears]


@dataclass
class PruningMemory:
    """Bytes torch's pruning adds to training, for the planner (``torch.nn.utils.prune``, torch 2.13).

    ``masks``: per tensor, the ``<name>_mask`` buffer (its dtype) and the 1-byte mask ``prune.custom_from_mask`` keeps;
    ``recomputed``: ``<name> = <name>_orig * <name>_mask``, kept on the module; ``transient``: one pruning event's
    temporaries (``global_unstructured``: ~5 copies of all pruned weights + 8-byte ``topk`` indices; else 4 of the largest).
    """

    masks: int
    recomputed: int
    transient: int


def pruning_memory(model: nn.Module, method: str) -> PruningMemory:
    """The :class:`PruningMemory` of ``method`` on ``model`` (real or fake tensors).

    Raises:
        ConfigError: see :func:`pruned_tensors`.
    """
    sizes = []
    for module, name in pruned_tensors(model, method):
        tensor = getattr(module, name + "_orig", getattr(module, name))
        sizes.append((tensor.numel(), tensor.element_size()))
    masks = sum(numel * size + numel for numel, size in sizes)
    recomputed = sum(numel * size for numel, size in sizes)
    if method == "magnitude":
        transient = sum(5 * numel * size + 8 * numel for numel, size in sizes)
    else:
        transient = 4 * max(numel * size for numel, size in sizes)
    return PruningMemory(masks, recomputed, transient)


def apply_mask(module: nn.Module, name: str, mask: torch.Tensor) -> None:
    """Set ``module.<name>``'s mask (bool; its zeros must include the old ones) with ``prune.custom_from_mask``, folding the
    old one in first (``prune.remove``) so masks don't pile up; ``<name>_orig`` stays the same parameter for the optimizer."""
    if prune.is_pruned(module) and hasattr(module, name + "_mask"):
        prune.remove(module, name)
    prune.custom_from_mask(module, name, mask)


def neuron_scores(block: FFNBlock) -> torch.Tensor:
    """Each FFN neuron's L2 norm over its rows, bias entries and column; ``(width,)`` fp32."""
    squares = block.columns.weight.detach().float().pow(2).sum(dim=0)  # (width,)
    for layer in block.rows:
        squares += layer.weight.detach().float().pow(2).sum(dim=1)
        if layer.bias is not None:
            squares += layer.bias.detach().float().pow(2)
    return squares.sqrt()


def prune_neurons(blocks: list[FFNBlock], count: int) -> None:
    """Mask the ``count`` lowest-scoring neurons (:func:`neuron_scores`) of every block; ones pruned before score lowest,
    so the masks only grow."""
    for block in blocks:
        scores = neuron_scores(block)
        if hasattr(block.columns, "weight_mask"):
            scores[block.columns.weight_mask[0] == 0] = -1.0  # pruned before: first out
        keep = torch.ones(block.width, dtype=torch.bool, device=scores.device)
        keep[torch.topk(scores, count, largest=False).indices] = False  # (width,)
        for layer in block.rows:
            apply_mask(layer, "weight", keep[:, None].expand_as(layer.weight).clone())
            if layer.bias is not None:
                apply_mask(layer, "bias", keep.clone())
        apply_mask(block.columns, "weight", keep[None, :].expand_as(block.columns.weight).clone())


def two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """2:4 mask of a ``(out, in)`` weight (``in`` a multiple of 4): the 2 largest of every 4 inputs kept; bool ``(out, in)``."""
    groups = weight.detach().abs().reshape(-1, 4)  # (out * in / 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, torch.topk(groups, 2, dim=1).indices, True)
    return keep.reshape(weight.shape)


def prune_magnitude(tensors: list[tuple[nn.Module, str]], count: int) -> None:
    """Mask the ``count`` smallest unmasked weights over all ``tensors`` (``prune.global_unstructured``, L1)."""
    if count > 0:
        prune.global_unstructured(tensors, pruning_method=prune.L1Unstructured, amount=count)


def masked_count(tensors: list[tuple[nn.Module, str]]) -> int:
    """How many entries of ``tensors`` are masked (one host sync)."""
    masks = [getattr(module, name + "_mask") for module, name in tensors if hasattr(module, name + "_mask")]
    return int(sum((mask == 0).sum() for mask in masks)) if masks else 0


def pruned_with(checkpoint: dict) -> str | None:
    """The ``pruning.method`` in a ``train`` checkpoint's :class:`..callbacks.pruning.Pruning` state, or ``None``."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and "masks" in state and isinstance(state.get("method"), str):
            return state["method"]
    return None


def shrink_ffn(model: nn.Module) -> nn.Module:
    """Remove in place the FFN neurons whose column is all zero (after ``pruning=structured``), shrinking the layers and
    ``config.intermediate_size`` for ``save_pretrained``.  Blocks keep one width, the largest live count, padded with
    dead neurons: outputs are unchanged.  Returns ``model``.

    Raises:
        ConfigError: no known FFN (:func:`ffn_blocks`).
        ValueError: masks still attached (make them permanent first; training does at the end of fit).
    """
    if prune.is_pruned(model):
        raise ValueError("shrink_ffn: the model still has pruning masks; fix: call torch.nn.utils.prune.remove on them first")
    blocks = ffn_blocks(model)
    alive = [block.columns.weight.detach().ne(0).any(dim=0) for block in blocks]  # (width,) each
    width = max(int(a.sum()) for a in alive)
    if width == blocks[0].width:
        return model
    for block, live in zip(blocks, alive, strict=True):
        # live neurons first, then dead ones to fill the width, each in model order
        order = torch.argsort((~live).to(torch.int8), stable=True)[:width].sort().values
        for layer in block.rows:
            _replace(model, layer, _rows(layer, order))
        _replace(model, block.columns, _columns(block.columns, order))
    model.config.intermediate_size = width
    for module in model.modules():
        if hasattr(module, "intermediate_size") and module is not model:
            module.intermediate_size = width  # (LlamaMLP keeps its own copy)
    return model


def _rows(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    new = nn.Linear(layer.in_features, len(keep), bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight[keep])
        if layer.bias is not None:
            new.bias.copy_(layer.bias[keep])
    return new


def _columns(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    new = nn.Linear(len(keep), layer.out_features, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight[:, keep])
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    return new


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)


def to_semi_structured_sparse(model: nn.Module) -> int:
    """Convert the 2:4-pruned block Linear weights (CUDA, fp16/bf16) with ``torch.sparse.to_sparse_semi_structured`` for
    the sparse tensor cores; others, or ones not multiples of 32 x 64, stay dense.  Returns how many were converted.

    Raises:
        RuntimeError: no CUDA GPU, or the model is not on one.
        ValueError: masks still attached, or weights neither fp16 nor bf16.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("to_semi_structured_sparse needs a CUDA GPU: torch.sparse.to_sparse_semi_structured has no CPU kernels")
    if prune.is_pruned(model):
        raise ValueError("to_semi_structured_sparse: the model still has pruning masks; fix: torch.nn.utils.prune.remove them first")
    converted = 0
    for name, layer in block_linears(model):
        weight = layer.weight
        if weight.device.type != "cuda":
            raise RuntimeError(f"to_semi_structured_sparse: {name} is on {weight.device}; fix: model.cuda() first")
        if weight.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"to_semi_structured_sparse: {name} is {weight.dtype}; fix: model.half() or model.bfloat16() first")
        rows, cols = weight.shape
        fits = rows % SEMI_STRUCTURED_ROWS == 0 and cols % SEMI_STRUCTURED_COLS == 0
        if fits and is_two_four(weight):
            layer.weight = nn.Parameter(torch.sparse.to_sparse_semi_structured(weight.detach()), requires_grad=False)
            converted += 1
    return converted


def is_two_four(weight: torch.Tensor) -> bool:
    """Whether at most 2 of every 4 consecutive input weights of each row are non-zero."""
    return bool((weight.reshape(-1, 4) != 0).sum(dim=1).le(2).all())


def sparsity(tensors: list[torch.Tensor]) -> float:
    """Fraction of exact zeros over ``tensors`` (one host sync)."""
    total = sum(t.numel() for t in tensors)
    return float(sum((t == 0).sum() for t in tensors)) / total if total else math.nan
