"""Post-training quantization variants: how each is made from the fp32 model, stored, and loaded.

PyTorch variants are Hugging Face folders for ``from_pretrained`` (torchao ones saved through transformers'
``TorchAoConfig``, recording each module's config); ONNX ones a ``model.onnx`` for ``onnxruntime.InferenceSession``.

The torchao variants: Linear layers get the variant's config where :func:`.qat.quantizable` allows (int4: ``in_features``
a multiple of ``group_size``); the word embeddings, half of a small encoder's weights, go int8 per row; a tied LM head is
untied first (transformers 5.24 cannot reload a tied torchao weight: torchao's tensors lack ``torch.equal``); biases,
LayerNorms and position embeddings stay fp32.  torchao's CPU int4 (``IntxUnpackedToInt8Tensor``) stores one value per
byte, no smaller than int8 on disk; packed int4 is ``Int4WeightOnlyConfig``, CUDA only (``mslk``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

PYTORCH, ONNXRUNTIME = "pytorch", "onnxruntime"
ONNX_FILE = "model.onnx"
COMPRESS_EXTRA = 'pip install -e ".[compress]"'


@dataclass(frozen=True)
class Variant:
    """One way to store the model: the ``runtime`` it runs on and its ``storage`` (report text); each task offers its own
    (``Task.quantize_variants``)."""

    runtime: str
    storage: str


INT8_TABLE = "word embeddings (and an LM head) int8 per row (IntxWeightOnlyConfig)"
VARIANTS: dict[str, Variant] = {
    "fp32": Variant(PYTORCH, "fp32 safetensors: the baseline"),
    "int8_weight_only": Variant(
        PYTORCH,
        f"Linear weights int8 per output channel with fp32 scales (torchao Int8WeightOnlyConfig), dequantized to fp32 "
        f"for the matmul; {INT8_TABLE}",
    ),
    "int8_dynamic": Variant(
        PYTORCH,
        f"Linear weights int8 per output channel, activations rounded to int8 per token at run time, int8 matmul "
        f"(torchao Int8DynamicActivationInt8WeightConfig); {INT8_TABLE}",
    ),
    "int4_weight_only": Variant(
        PYTORCH,
        f"Linear weights int4 in groups of group_size, packed two per byte, bf16 activations (torchao Int4WeightOnlyConfig, "
        f"CUDA kernels of mslk); {INT8_TABLE}",
    ),
    "intx4_weight_only": Variant(
        PYTORCH,
        f"Linear weights int4 in groups of group_size (torchao IntxWeightOnlyConfig), stored ONE int4 value per byte "
        f"(IntxUnpackedToInt8Tensor): no smaller than int8 on disk; dequantized to fp32 for the matmul; {INT8_TABLE}",
    ),
    "ptq_int8a_int4w": Variant(
        PYTORCH,
        f"the qat=int8a_int4w scheme applied after training: activations int8 per token, Linear weights int4 per group of "
        f"group_size stored one per byte (torchao Int8DynamicActivationIntxWeightConfig); {INT8_TABLE}",
    ),
    "qat": Variant(
        PYTORCH,
        f"the checkpoint's quantization-aware-trained Linear layers converted to integers (core.compress.qat.convert_qat: "
        f"its qat scheme, stored as ptq_int8a_int4w); {INT8_TABLE}",
    ),
    "nf4": Variant(
        PYTORCH,
        "Linear weights 4-bit NormalFloat, two per byte, one absmax per block of 64 (bitsandbytes, fp32 compute); "
        "embeddings and the LM head stay fp32 (bitsandbytes skips them)",
    ),
    "onnx_fp32": Variant(
        ONNXRUNTIME,
        "ONNX graph with fp32 weights (torch.onnx.export, dynamo exporter; dynamic batch and sequence axes)",
    ),
    "onnx_int8": Variant(
        ONNXRUNTIME,
        "onnx_fp32 through onnxruntime quantize_dynamic(weight_type=QInt8): MatMul weights and the embedding Gather int8, "
        "activations quantized at run time",
    ),
}
TORCHAO_VARIANTS = ("int8_weight_only", "int8_dynamic", "int4_weight_only", "intx4_weight_only", "ptq_int8a_int4w", "qat")
INT4_VARIANTS = ("int4_weight_only", "intx4_weight_only", "ptq_int8a_int4w")


def variant_problems(names: list[str], task: str, offered: tuple[str, ...]) -> list[str]:
    """What is wrong with ``variants`` for ``task`` on any machine (unknown, not ``offered``, repeated, no ``fp32`` baseline),
    one line each with the fix; ``[]`` if nothing."""
    problems = []
    for name in names:
        if name not in VARIANTS:
            problems.append(f"variants: {name!r} is not a variant; fix: one of {list(offered)}")
        elif name not in offered:
            problems.append(f"variants: {name!r} does not apply to task={task} (it offers {list(offered)}); fix: drop it")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        problems.append(f"variants lists {repeated} more than once; fix: name each variant once")
    if "fp32" not in names:
        problems.append(f"variants={names} has no fp32, the baseline every size, metric and latency is compared with; fix: add fp32")
    return problems


def unavailable(name: str, device: str, qat_scheme: str) -> tuple[str, str] | None:
    """``(reason, fix)`` when variant ``name`` cannot be made here (a package or CUDA GPU missing; ``device``: ``cpu`` or
    ``cuda``) or does not suit the checkpoint's ``qat_scheme``; else ``None``."""
    missing = [package for package in _packages(name) if importlib.util.find_spec(package) is None]
    if missing:
        return f"needs {', '.join(missing)}, not installed", COMPRESS_EXTRA if name != "nf4" else "pip install 'bitsandbytes>=0.45'"
    if name == "int4_weight_only" and device != "cuda":
        return (
            f"Int4WeightOnlyConfig packs int4 for CUDA kernels (the mslk package) and this run has no CUDA GPU (device={device})",
            "variants=[...,intx4_weight_only] for int4 groups on the CPU (stored one value per byte), or run on a CUDA GPU",
        )
    if name == "int4_weight_only" and importlib.util.find_spec("mslk") is None:
        return "Int4WeightOnlyConfig needs torchao's int4 CUDA kernels, the mslk package, not installed", "pip install mslk"
    if name == "qat" and qat_scheme == "none":
        return (
            "the checkpoint was not trained with quantization-aware training (its qat.scheme is none)",
            "train with qat=int8a_int4w, then quantize that checkpoint; ptq_int8a_int4w is the same scheme applied after training",
        )
    if name == "ptq_int8a_int4w" and qat_scheme != "none":
        return (
            f"for a checkpoint trained with qat={qat_scheme} it is the qat variant itself (the same weights, rounded the same way)",
            "compare qat with ptq_int8a_int4w of a checkpoint trained with qat=none",
        )
    return None


def _packages(name: str) -> list[str]:
    if name in TORCHAO_VARIANTS:
        return ["torchao"]
    if name == "nf4":
        return ["bitsandbytes"]
    if VARIANTS[name].runtime == ONNXRUNTIME:
        return ["onnx", "onnxscript", "onnxruntime"]
    return []


def untie_output_embeddings(model: nn.Module) -> bool:
    """Give an LM head sharing the input embedding's weight its own copy (``tie_word_embeddings=False``, so it reloads
    untied); return whether it was tied."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not table.weight:
        return False
    model.config.tie_word_embeddings = False
    head.weight = nn.Parameter(table.weight.detach().clone(), requires_grad=False)
    return True


def linear_config(name: str, group_size: int, qat: dict | None):
    """torchao's Linear config for variant ``name`` (``group_size``: input weights per int4 scale; ``qat``: the checkpoint's)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    from .qat import base_config

    return {
        "int8_weight_only": lambda: Int8WeightOnlyConfig(),
        "int8_dynamic": lambda: Int8DynamicActivationInt8WeightConfig(),
        "int4_weight_only": lambda: Int4WeightOnlyConfig(group_size=group_size),
        "intx4_weight_only": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size)),
        "ptq_int8a_int4w": lambda: base_config({"scheme": "int8a_int4w", "group_size": group_size}),
        "qat": lambda: base_config(qat),
    }[name]()


def quantize_torchao(model: nn.Module, name: str, group_size: int, qat: dict | None = None) -> dict[str, object]:
    """Quantize ``model`` in place as torchao variant ``name`` (``qat``: :func:`.qat.convert_qat`), then the embedding table
    and LM head int8 per row; return ``module name -> torchao config`` of every module quantized.
    """
    from torchao.quantization import quantize_

    from .qat import convert_qat, embedding_config, embedding_table, quantizable

    config = linear_config(name, group_size, qat)
    keep = quantizable(model, qat["group_size"] if name == "qat" else group_size if name in INT4_VARIANTS else 1)
    applied: dict[str, object] = {fqn: config for fqn, module in model.named_modules() if keep(module, fqn)}
    if name == "qat":
        table = embedding_table(model)  # converted with the Linear layers, as QAT rounded it
        convert_qat(model, qat)
        if table is not None:
            applied[table] = embedding_config()
    else:
        quantize_(model, config, filter_fn=keep)
    untie_output_embeddings(model)
    table_config = embedding_config()  # int8, one scale per row (token)
    tables = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = {fqn for fqn, module in model.named_modules() if any(module is t for t in tables if t is not None) and fqn not in applied}
    quantize_(model, table_config, filter_fn=lambda module, fqn: fqn in names)
    applied.update(dict.fromkeys(names, table_config))
    return applied


def save_torchao(model: nn.Module, applied: dict[str, object], folder: Path) -> None:
    """``save_pretrained`` a torchao-quantized model via transformers' torchao integration: the config records ``applied``,
    the tensors are flattened into safetensors that ``from_pretrained`` rebuilds."""
    from torchao.quantization import FqnToConfig
    from transformers import TorchAoConfig
    from transformers.quantizers import AutoHfQuantizer

    record = TorchAoConfig(FqnToConfig(dict(sorted(applied.items()))), include_input_output_embeddings=True)
    model.config.quantization_config = record
    model.hf_quantizer = AutoHfQuantizer.from_config(record)  # what from_pretrained sets on a quantized model
    model.save_pretrained(folder)


def save_nf4(fp32_dir: Path, folder: Path, auto_class: type, device: str) -> None:
    """Load the fp32 folder in NF4 through bitsandbytes (``BitsAndBytesConfig``) and save it."""
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    auto_class.from_pretrained(fp32_dir, quantization_config=nf4, device_map=device).save_pretrained(folder)


class LogitsOf(nn.Module):
    """``model(**inputs).logits`` of positional tensors named ``names`` (the signature the ONNX exporter traces)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, tensors))).logits


def export_onnx(model: nn.Module, example: dict[str, torch.Tensor], path: Path) -> None:
    """Export ``model`` (on the CPU, eval mode) to ``path`` with the dynamo exporter: inputs named
    as ``example``'s keys, each ``(batch, sequence)`` with both axes dynamic, output ``logits``."""
    names = list(example)
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    quiet = {name: logging.getLogger(name).level for name in ("onnx_ir", "onnxscript")}  # a line per initializer at INFO
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        torch.onnx.export(
            LogitsOf(model, names).eval(),
            tuple(example.values()),
            str(path),
            dynamo=True,
            input_names=names,
            output_names=["logits"],
            dynamic_shapes=(tuple({0: batch, 1: sequence} for _ in names),),  # (one entry: the *tensors of forward)
            verbose=False,
        )
    finally:
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)


def quantize_onnx(source: Path, path: Path) -> None:
    """onnxruntime's dynamic quantization of ``source`` into ``path``: ``QInt8`` MatMul and Gather weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(path), weight_type=QuantType.QInt8)


def load_line(name: str, folder: Path, auto_class: type) -> str:
    """The one line of Python that loads variant ``name`` saved in ``folder``."""
    if VARIANTS[name].runtime == ONNXRUNTIME:
        return f'onnxruntime.InferenceSession("{folder / ONNX_FILE}")'
    return f'{auto_class.__name__}.from_pretrained("{folder}")'


def load_forward(name: str, folder: Path, auto_class: type, device: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """Load the variant as :func:`load_line` does; return ``inputs -> logits`` (PyTorch on ``device``, eval; ONNX on the CPU
    provider, dropping inputs the graph does not take)."""
    if VARIANTS[name].runtime == ONNXRUNTIME:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(folder / ONNX_FILE), providers=["CPUExecutionProvider"])
        wanted = [node.name for node in session.get_inputs()]
        return lambda inputs: torch.from_numpy(session.run(["logits"], {key: inputs[key].cpu().numpy() for key in wanted})[0])
    options = {"device_map": device} if name == "nf4" else {}
    model = auto_class.from_pretrained(folder, **options).eval()
    if name != "nf4":
        model.to(device)
    return lambda inputs: model(**inputs).logits
