"""Pruning during training (the ``pruning`` group): which tensors each method masks, the masks, the
schedule, and what to do with a pruned model afterwards.

Methods (all on ``torch.nn.utils.prune``; :class:`..callbacks.pruning.Pruning` drives them):

- ``magnitude``: global magnitude (L1) pruning of every ``nn.Linear`` weight inside the
  transformer blocks (not the embeddings, not the classifier or LM head), ramped to
  ``final_sparsity`` along the cubic schedule of Zhu & Gupta 2017 (:func:`scheduled_sparsity`).
- ``structured``: whole FFN neurons, the same count in every block (:func:`ffn_blocks`), ramped the
  same way; :func:`shrink_ffn` then removes them for real (a smaller model and file).
- ``semi_structured_2_4``: in every group of 4 consecutive input weights of a row, the 2 smallest
  are zeroed, once, at ``begin_step`` (the pattern of NVIDIA's sparse tensor cores, Ampere and
  later); :func:`to_semi_structured_sparse` converts the weights for a CUDA GPU's sparse kernels.

Unstructured zeros (``magnitude``) save neither memory nor time by themselves: the weights stay
dense.  torch's pruning keeps, per masked tensor, the trained ``<name>_orig`` parameter, a
``<name>_mask`` buffer of the same dtype and the recomputed ``<name>`` (:func:`pruning_memory`).
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
# Families whose FFN ``structured`` knows (checked from the config, before weights load):
# BERT-style (layer.intermediate.dense -> layer.output.dense) and gated (mlp.gate_proj, up_proj -> down_proj).
BERT_FFN_TYPES = ("bert", "roberta", "xlm-roberta", "electra")
GATED_FFN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The smallest fp16/bf16 weight ``torch.sparse.to_sparse_semi_structured`` takes is a multiple of
# 32 rows x 64 columns (CUTLASS backend; cuSPARSELt takes less): torch/sparse/semi_structured.py, torch 2.13.
SEMI_STRUCTURED_ROWS, SEMI_STRUCTURED_COLS = 32, 64


# ------------------------------------------------------------------------------ the config
def pruning_problems(
    pruning: dict, peft: dict | None = None, qat: dict | None = None, trainer: dict | None = None, model: dict | None = None
) -> list[str]:
    """What is wrong with a ``pruning`` group (and its conflicts), one line each with the fix; ``[]`` if nothing.

    Refused: an unknown method; ``begin_step`` not an integer >= 0; ``end_step <= begin_step`` or
    ``frequency < 1`` (``magnitude``/``structured``; ``semi_structured_2_4`` prunes once and takes
    neither: null); ``final_sparsity`` outside [0, 1) (exactly 0.5 for 2:4); LoRA/QLoRA (the base
    is frozen: prune a full fine-tune); QAT (one change of the Linear layers at a time); FSDP (it
    shards the weights the masks cover); ``structured`` on a model family whose FFN it does not
    know, when ``model.config``/``model.architecture`` names the family (else the callback checks
    it in ``setup``, still before the weights load).
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
    """The model family a ``model`` group names without reading files: ``model.config.model_type``,
    else ``model.architecture.model_type``, else ``None``."""
    for node in (model.get("config"), model.get("architecture")):
        if node and isinstance(node.get("model_type"), str):
            return node["model_type"]
    return None


def hidden_size_named(model: dict) -> int | None:
    """The hidden size a ``model`` group names without reading files (``model.config``, else
    ``model.architecture``: ``hidden_size``, or GPT-2's ``n_embd``), or ``None``."""
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


# --------------------------------------------------------------------------- the schedule
def scheduled_sparsity(step: int, begin_step: int, end_step: int, final_sparsity: float, frequency: int, initial: float = 0.0) -> float:
    """The sparsity the masks hold after ``step`` optimizer steps: Zhu & Gupta 2017, "To prune, or
    not to prune", eq. 1,

        s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))**3,   t in {t0, t0 + dt, ..., t0 + n * dt}

    with ``t0 = begin_step``, ``dt = frequency``, ``t0 + n * dt = end_step`` (the last point is
    ``end_step`` itself when ``frequency`` does not divide the ramp) and ``s_i = initial``.  Between
    pruning points the value of the last point holds; 0 before ``begin_step`` (and ``s_i`` at it),
    ``final_sparsity`` from ``end_step`` on.
    """
    if step < begin_step:
        return 0.0
    point = min(begin_step + (step - begin_step) // frequency * frequency, end_step)
    if step >= end_step:
        point = end_step
    progress = (point - begin_step) / (end_step - begin_step)
    return final_sparsity + (initial - final_sparsity) * (1 - progress) ** 3


# ------------------------------------------------------------------------ what is pruned
def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model: the children of its ``nn.ModuleList``(s)
    as long as ``config.num_hidden_layers`` (``bert.encoder.layer``, ``model.layers``).

    Raises:
        ConfigError: none found (a model without such a config or layer list).
    """
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    blocks = [block for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers for block in m]
    if not blocks:
        raise ConfigError(f"pruning: no list of {n_layers} transformer blocks in {type(model).__name__}; fix: pruning=none for this model")
    return blocks


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(qualified name, layer)`` of every ``nn.Linear`` inside the transformer blocks (attention
    and FFN), in model order: what ``magnitude`` and ``semi_structured_2_4`` prune.  Embeddings,
    poolers, the classifier and the LM head lie outside the blocks.

    Raises:
        ConfigError: no such layer (GPT-2's blocks use ``Conv1D``, not ``nn.Linear``).
    """
    inside = {id(m) for block in transformer_blocks(model) for m in block.modules()}
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]
    if not found:
        raise ConfigError(f"pruning: {type(model).__name__} has no nn.Linear layer in its transformer blocks; fix: pruning=none")
    return found


@dataclass
class FFNBlock:
    """One block's FFN: ``rows`` are the layers whose output rows are the neurons (with the bias
    entries of those that have one), ``columns`` the layer whose input columns are."""

    rows: list[nn.Linear]
    columns: nn.Linear

    @property
    def width(self) -> int:
        return self.columns.in_features


def ffn_blocks(model: nn.Module) -> list[FFNBlock]:
    """The FFN of each transformer block: BERT family ``intermediate.dense`` (rows) and
    ``output.dense`` (columns); Llama family ``mlp.gate_proj``/``up_proj`` (rows) and
    ``down_proj`` (columns).

    Raises:
        ConfigError: a block with neither layout (another architecture).
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
    """``(module, tensor name)`` of every tensor ``method`` masks: the block Linear weights
    (``magnitude``, ``semi_structured_2_4``), or the FFN weights and the row layers' biases
    (``structured``).

    Raises:
        ConfigError: see :func:`block_linears`, :func:`ffn_blocks`; for ``semi_structured_2_4``
            a Linear layer whose ``in_features`` is not a multiple of 4.
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
    """Bytes torch's pruning adds to training (what the planner counts; torch 2.13's
    ``torch.nn.utils.prune``).

    - ``masks``: per masked tensor, the ``<name>_mask`` buffer (the tensor's dtype) plus the
      1-byte boolean mask ``prune.custom_from_mask`` keeps in its pruning method (always for
      ``structured``/``semi_structured_2_4``; for ``magnitude`` after a resume).
    - ``recomputed``: the ``<name>`` recomputed as ``<name>_orig * <name>_mask`` before each
      forward and kept on the module (the tensor's size again).
    - ``transient``: the temporaries of one pruning event, alive outside forward/backward:
      ``global_unstructured`` builds the importance vector, the default-mask vector, the slice of
      unmasked scores, the cloned mask and ``abs`` for ``topk`` (about 5 copies of all the pruned
      weights) plus 8-byte ``topk`` indices (at most one per weight); ``structured`` and 2:4 work one
      tensor at a time (about 4 copies of the largest).
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


# --------------------------------------------------------------------------------- masks
def apply_mask(module: nn.Module, name: str, mask: torch.Tensor) -> None:
    """Set ``module.<name>``'s mask to ``mask`` (bool, the tensor's shape) with
    ``prune.custom_from_mask``, replacing any mask it had (pruned entries must stay pruned: the
    new mask's zeros include the old ones).  The parameter object is kept (``<name>_orig`` is the
    same ``nn.Parameter``), so an optimizer holding it is unaffected; the old mask is folded into
    the parameter first (``prune.remove``), so masks do not pile up in torch's pruning container."""
    if prune.is_pruned(module) and hasattr(module, name + "_mask"):
        prune.remove(module, name)
    prune.custom_from_mask(module, name, mask)


def neuron_scores(block: FFNBlock) -> torch.Tensor:
    """The L2 norm of each FFN neuron's weights: its rows in the row layers, its bias entries and
    its column in the column layer together; ``(width,)`` fp32."""
    squares = block.columns.weight.detach().float().pow(2).sum(dim=0)  # (width,)
    for layer in block.rows:
        squares += layer.weight.detach().float().pow(2).sum(dim=1)
        if layer.bias is not None:
            squares += layer.bias.detach().float().pow(2)
    return squares.sqrt()


def prune_neurons(blocks: list[FFNBlock], count: int) -> None:
    """Mask the ``count`` lowest-scoring neurons (:func:`neuron_scores`) of every block's FFN:
    their rows and bias entries, and their column.  Neurons pruned before stay pruned (they score
    below every live one), so the masks only grow."""
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
    """The 2:4 mask of a ``(out, in)`` weight: in every group of 4 consecutive input weights of a
    row, the 2 of largest magnitude kept; bool, ``(out, in)``.  ``in`` must be a multiple of 4."""
    groups = weight.detach().abs().reshape(-1, 4)  # (out * in / 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, torch.topk(groups, 2, dim=1).indices, True)
    return keep.reshape(weight.shape)


def prune_magnitude(tensors: list[tuple[nn.Module, str]], count: int) -> None:
    """Mask ``count`` more weights, globally over ``tensors``, the smallest in magnitude among those
    not masked yet (``prune.global_unstructured`` with ``L1Unstructured`` and an integer amount)."""
    if count > 0:
        prune.global_unstructured(tensors, pruning_method=prune.L1Unstructured, amount=count)


def masked_count(tensors: list[tuple[nn.Module, str]]) -> int:
    """How many entries of ``tensors`` are masked (one host sync)."""
    masks = [getattr(module, name + "_mask") for module, name in tensors if hasattr(module, name + "_mask")]
    return int(sum((mask == 0).sum() for mask in masks)) if masks else 0


# ---------------------------------------------------------------------- after training
def pruned_with(checkpoint: dict) -> str | None:
    """The ``pruning.method`` a checkpoint of ``train`` was pruned with (the :class:`..callbacks.pruning.Pruning`
    state it holds), or ``None``."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and "masks" in state and isinstance(state.get("method"), str):
            return state["method"]
    return None


def shrink_ffn(model: nn.Module) -> nn.Module:
    """Remove the FFN neurons that contribute nothing (after ``pruning=structured``), in place:
    smaller ``nn.Linear`` layers, ``config.intermediate_size`` updated, so ``save_pretrained`` writes
    a smaller model that ``from_pretrained`` reads back.  Returns ``model``.

    A neuron is removable when its column in the column layer is all zero (nothing it computes
    reaches the output).  Every block keeps the same width (the config has one
    ``intermediate_size``): the largest count of live neurons over the blocks, padded with dead
    ones where a block has fewer, so the outputs are unchanged.

    Raises:
        ConfigError: an architecture without a known FFN (see :func:`ffn_blocks`).
        ValueError: masks are still attached (``torch.nn.utils.prune``): make them permanent first
            (training does at the end of fit).
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
    """Convert the 2:4-pruned block Linear weights of ``model`` (on a CUDA GPU, fp16/bf16) with
    ``torch.sparse.to_sparse_semi_structured``, so their matmuls run on the sparse tensor cores
    (Ampere and later: the RTX 4090's).  Layers whose weight is not 2:4 sparse, or is smaller than
    or not a multiple of 32 x 64, are left dense.  Returns how many layers were converted.

    Raises:
        RuntimeError: no CUDA GPU, or the model is not on one (the sparse kernels are CUDA only).
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
