"""Post-training quantization: a trained model -> one folder per variant, each re-measured.

    python -m <package>.quantize experiment=demo_classification ckpt_path=RUN/checkpoints/last.ckpt
    python -m <package>.quantize experiment=demo_sft_sentiment model_dir=models/sft variants=[fp32,int8_dynamic,nf4]

Reads a checkpoint (as ``eval`` does) or an ``export`` folder.  Writes ``output_dir`` whole or not at all: a folder per
variant (docs/compression.md) and ``compress_report.{json,md}``: each variant's size, test metric and forward latency
(p50/p90, ms) against fp32, measured from its saved folder.  On a CPU torchao int8 is usually *slower* than fp32 (its
gain is size).  A variant this machine cannot make is skipped with its reason (``unavailable=error`` stops instead).

Exit codes: 0 done; 1 bad config or data, or a full disk (the message alone); 143 SIGTERM (the partial output is removed).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, ListConfig, open_dict

from .core.checkpoints.io import data_kwargs, load_trained_module, trained_checkpoint
from .core.compress import CONV1D_MODEL_TYPES, conv1d_refusal
from .core.compress.pruning import pruned_with, shrink_ffn
from .core.compress.quantization import (
    INT4_VARIANTS,
    ONNX_FILE,
    ONNXRUNTIME,
    TORCHAO_VARIANTS,
    VARIANTS,
    export_onnx,
    load_forward,
    load_line,
    quantize_onnx,
    quantize_torchao,
    save_nf4,
    save_torchao,
    unavailable,
    variant_problems,
)
from .core.compress.report import REPORT_JSON, Measurement, build_report, markdown_table, weight_bytes, write_report
from .core.errors import ConfigError
from .core.run.entry import exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main, print_config_tree
from .core.run.outputs import claim_outputs, replace_folder, staging_folder
from .core.task import Task, module_class, to_device
from .eval import exported_folder_problem, full_precision_overrides
from .tasks import check_config, task_of

UNAVAILABLE = ("skip", "error")
DEVICES = ("auto", "cpu", "cuda")


def quantize(cfg: DictConfig) -> dict:
    """Make, save and measure every variant of ``cfg.variants``; write the report; return it.

    Raises:
        ConfigError: invalid config or an existing ``output_dir`` (see :func:`read_source`, :func:`plan_variants`), before
            any weights load.
        DataError: bad evaluation data.
    """
    task = check_config(cfg, resumes=False)
    if not task.quality:  # (GRPO: rewards of samples, no reference answers to score a variant against)
        raise ConfigError(
            f"task={task.name} has no quality metric to re-measure on a quantized variant; fix: export the model "
            "(export format=hf) and quantize it with task=causal_lm on a text set (perplexity), or eval each variant yourself"
        )
    cfg = with_task_defaults(cfg, task)
    hparams, architecture = read_source(cfg)
    qat = hparams.get("qat") or {"scheme": "none"}  # (checkpoints written before the qat group have none)
    device = run_device(cfg.latency.device)
    names, refusals = plan_variants(cfg, task, device, qat["scheme"], architecture)
    output = Path(cfg.output_dir)
    claim_outputs(
        cfg, {"output_dir": output}, {"ckpt_path": cfg.ckpt_path, "model_dir": cfg.model_dir}, folder_markers={"output_dir": REPORT_JSON}
    )
    print_config_tree(cfg, save_to=Path(cfg.paths.output_dir) / "config_tree.log", show=bool(cfg.get("print_config")))
    for refusal in refusals:
        print(f"Skipped {refusal['variant']}: {refusal['reason']}; fix: {refusal['fix']}")

    model, tokenizer, datamodule_kwargs = load_source(cfg, hparams)
    shrunk = None
    if hparams.get("pruned_with") == "structured":  # the dead FFN neurons go: every variant is smaller
        width = model.config.intermediate_size
        shrink_ffn(model)
        shrunk = f"pruning=structured: shrink_ffn removed {width - model.config.intermediate_size} of {width} FFN neurons per block"
        print(shrunk)
    auto_class = module_class(cfg).AUTO_CLASS
    datamodule = hydra.utils.instantiate(cfg.data, **datamodule_kwargs)
    datamodule.prepare_data()
    split = "test" if datamodule.has_test else "validation"  # (a classifier without a test split was refused above)
    datamodule.setup("test" if split == "test" else "validate")
    loader = datamodule.test_dataloader() if split == "test" else datamodule.val_dataloader()
    sample = next(iter(loader))
    timing = timing_inputs(task, sample, model.config.vocab_size, cfg.latency.batch_size, cfg.latency.sequence_length)

    measurements = []
    with staging_folder(output, "quantize") as tmp:
        staging = Path(tmp) / output.name
        fp32_dir = staging / "fp32"
        for name in names:
            folder = staging / name
            print(f"[{name}] making ...")
            make_variant(name, model, tokenizer, folder, fp32_dir, auto_class, cfg.group_size, qat, device, timing)
            forward = load_forward(name, folder, auto_class, device)
            runtime = "onnxruntime-cpu" if VARIANTS[name].runtime == ONNXRUNTIME else f"pytorch-eager-{device}"
            print(f"[{name}] scoring on the {split} split, timing on {runtime} ...")
            metrics = task.score(forward, loader, device, datamodule)
            samples = time_forward(forward, to_device(timing, device if runtime.startswith("pytorch") else "cpu"), cfg.latency)
            measurements.append(
                Measurement(
                    name=name,
                    runtime=runtime,
                    latency_baseline="onnx_fp32" if VARIANTS[name].runtime == ONNXRUNTIME else "fp32",
                    size_bytes=weight_bytes(folder),
                    metrics=metrics,
                    latency_ms=samples,
                    load=load_line(name, output / name, auto_class),
                    storage=VARIANTS[name].storage.replace("group_size", f"{cfg.group_size}"),
                    path=str(output / name),
                )
            )
            del forward
        context = {
            "source": str(cfg.ckpt_path or cfg.model_dir),
            "task": task.name,
            "split": split,
            "rows": len(datamodule.datasets[split]),
            "metric_names": list(measurements[0].metrics),
            "latency": {
                "batch_size": cfg.latency.batch_size,
                "sequence_length": cfg.latency.sequence_length,
                "warmup": cfg.latency.warmup,
                "repeats": cfg.latency.repeats,
                "threads": torch.get_num_threads(),
                "device": device,
                # A load above the thread count means the timings are not this model's alone.
                "load_average": os.getloadavg()[0],
            },
            "group_size": cfg.group_size,
            "shrunk": shrunk,
        }
        report = build_report(measurements, refusals, context)
        write_report(staging, report)
        replace_folder(staging, output, marker=REPORT_JSON)
    print(markdown_table(report))
    print(f"Compressed: {output} (report: {output / 'compress_report.md'})")
    return report


# ------------------------------------------------------------------ checks (nothing loaded)
def read_source(cfg: DictConfig) -> tuple[dict, object]:
    """The checkpoint's hyperparameters (``{}`` for an exported folder) and the model's HF config, without the weights.

    Raises:
        ConfigError: neither or both of ``ckpt_path``/``model_dir``; a bad ``model_dir``; no stored architecture.
    """
    from transformers import AutoConfig

    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        raise ConfigError("give exactly one of ckpt_path=RUN/checkpoints/last.ckpt or model_dir=<folder written by export>")
    if cfg.model_dir is not None:
        exported_folder_problem(cfg)
        return {}, AutoConfig.from_pretrained(cfg.model_dir)
    # Memory-mapped: only the hyperparameters are read here, not the weights.
    checkpoint = trained_checkpoint(cfg.ckpt_path)
    hparams = dict(checkpoint.get("hyper_parameters", {}))
    hparams["pruned_with"] = pruned_with(checkpoint)  # (not a module argument: read here, used by load_source)
    if not hparams.get("hf_config"):
        raise ConfigError(f"ckpt_path={cfg.ckpt_path!r} stores no model architecture (hf_config); fix: a checkpoint written by train")
    fields = dict(hparams["hf_config"])
    return hparams, AutoConfig.for_model(fields.pop("model_type"), **fields)


def run_device(choice: str) -> str:
    """``latency.device``: ``auto`` is ``cuda`` when a CUDA GPU is visible, else ``cpu``.

    Raises:
        ConfigError: not one of :data:`DEVICES`, or ``cuda`` without a CUDA GPU.
    """
    if choice not in DEVICES:
        raise ConfigError(f"latency.device={choice!r} is not one of {DEVICES}; fix: latency.device=auto")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("latency.device=cuda but no CUDA GPU is visible; fix: latency.device=cpu (or auto)")
    return ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice


def plan_variants(cfg: DictConfig, task: Task, device: str, qat_scheme: str, architecture) -> tuple[list[str], list[dict]]:
    """The variants to make, in order, and the refusals (``{"variant", "reason", "fix"}``) of those that cannot be made.

    Raises:
        ConfigError: every config problem at once (with ``unavailable=error`` the refusals too).
    """
    from .core.models.builder import max_positions

    if not isinstance(cfg.variants, ListConfig):
        listed = "fp32" if str(cfg.variants) == "fp32" else f"fp32,{cfg.variants}"
        raise ConfigError(f"variants={cfg.variants!r} must be a list; fix: variants=[{listed}] (brackets, no spaces)")
    names = [str(name) for name in cfg.variants]
    problems = variant_problems(names, task.name, task.quantize_variants)
    if cfg.unavailable not in UNAVAILABLE:
        problems.append(f"unavailable={cfg.unavailable!r} is not one of {UNAVAILABLE}; fix: unavailable=skip")
    for field in ("batch_size", "sequence_length", "warmup", "repeats", "group_size"):
        value = cfg.group_size if field == "group_size" else cfg.latency[field]
        key = field if field == "group_size" else f"latency.{field}"
        least = 0 if field == "warmup" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            problems.append(f"{key}={value!r} must be an integer >= {least}; fix: {key}={max(least, 8)}")
    group, width = cfg.group_size, getattr(architecture, "hidden_size", None)
    int4 = [name for name in names if name in INT4_VARIANTS]
    if int4 and isinstance(group, int) and group >= 1 and width and width % group:
        problems.append(
            f"group_size={group} does not divide the hidden size ({width}): {', '.join(int4)} would leave the layers it does not "
            "divide in fp32; fix: group_size=32 (or another divisor)"
        )
    model_type = getattr(architecture, "model_type", None)
    if model_type in CONV1D_MODEL_TYPES:
        problems += [
            f"variants: {conv1d_refusal(name, model_type, f'drop {name}')}" for name in names if name in TORCHAO_VARIANTS and name != "qat"
        ]
    positions = max_positions(architecture)
    length = cfg.latency.sequence_length
    if positions is not None and isinstance(length, int) and length > positions:
        problems.append(
            f"latency.sequence_length={length} is more than the model's {positions} positions; fix: latency.sequence_length={positions}"
        )
    if task.scores_test_split_only and cfg.data.splits.get("test") is None:
        problems.append(
            f"data.splits.test is null: quantize scores task={task.name} on its test split; fix: data.splits.test=path/to/test.csv"
        )
    refusals = []
    for name in names:
        if name in task.quantize_variants:
            why = unavailable(name, device, qat_scheme)
            if why is not None:
                refusals.append({"variant": name, "reason": why[0], "fix": why[1]})
    if cfg.unavailable == "error":
        problems += [
            f"variants: {r['variant']} cannot be made here: {r['reason']}; fix: {r['fix']} (or unavailable=skip)" for r in refusals
        ]
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    skipped = {r["variant"] for r in refusals}
    return ["fp32"] + [name for name in names if name not in skipped and name != "fp32"], refusals  # fp32 first: nf4 loads its folder


# --------------------------------------------------------------------------- the model
def with_task_defaults(cfg: DictConfig, task: Task) -> DictConfig:
    """``cfg`` with a null ``variants`` and ``latency.batch_size`` taken from the task."""
    cfg = cfg.copy()
    with open_dict(cfg):
        if cfg.variants is None:
            cfg.variants = list(task.quantize_variants)
        if cfg.latency.batch_size is None:
            cfg.latency.batch_size = task.latency_batch_size
    return cfg


def load_source(cfg: DictConfig, hparams: dict) -> tuple[torch.nn.Module, object, dict]:
    """The plain fp32 HF model (eval mode, CPU; LoRA/QLoRA merged, QAT without fake quantisation), its tokenizer, and
    the data module's kwargs."""
    from transformers import AutoTokenizer

    if cfg.model_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        return module_class(cfg).AUTO_CLASS.from_pretrained(cfg.model_dir).eval(), tokenizer, {"tokenizer": tokenizer}
    module = load_trained_module(module_class(cfg), cfg, cfg.ckpt_path, **full_precision_overrides(hparams))
    return module.merged_model().eval(), module.tokenizer, data_kwargs(cfg, module, task_of(cfg).shaping_keys)


def make_variant(
    name: str,
    model: torch.nn.Module,
    tokenizer,
    folder: Path,
    fp32_dir: Path,
    auto_class: type,
    group_size: int,
    qat: dict,
    device: str,
    timing: dict[str, torch.Tensor],
) -> None:
    """Write variant ``name`` of the fp32 ``model`` into ``folder`` (with the tokenizer); ``fp32`` is written first."""
    folder.mkdir(parents=True)
    tokenizer.save_pretrained(folder)
    if name == "fp32":
        model.save_pretrained(folder)
    elif name == "nf4":
        save_nf4(fp32_dir, folder, auto_class, device)
    elif name == "onnx_fp32":
        model.config.save_pretrained(folder)  # the labels (id2label) next to the graph
        export_onnx(model, {key: value[:2, :16] for key, value in timing.items()}, folder / ONNX_FILE)
    elif name == "onnx_int8":
        model.config.save_pretrained(folder)
        source = folder.parent / "onnx_fp32" / ONNX_FILE
        if not source.is_file():  # (onnx_int8 asked for without onnx_fp32: export to a scratch file)
            export_onnx(model, {key: value[:2, :16] for key, value in timing.items()}, folder / "fp32.onnx")
            source = folder / "fp32.onnx"
        quantize_onnx(source, folder / ONNX_FILE)
        if source.parent == folder:
            source.unlink()
    else:
        quantized = copy.deepcopy(model)
        if name == "int4_weight_only":  # the int4 CUDA kernels take bf16 activations
            quantized.to(device=device, dtype=torch.bfloat16)
        save_torchao(quantized, quantize_torchao(quantized, name, group_size, qat), folder)


# ------------------------------------------------------------------------ measuring
def timing_inputs(task: Task, sample: dict[str, torch.Tensor], vocab_size: int, batch_size: int, length: int) -> dict[str, object]:
    """The timed batch: ``(batch_size, length)`` seeded random token ids, plus the task's other inputs."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch_size, length), generator=generator)  # (B, T)
    return task.timing_inputs(input_ids, sample)


def time_forward(forward: Callable[[dict], torch.Tensor], inputs: dict[str, torch.Tensor], latency: DictConfig) -> list[float]:
    """Milliseconds of each of ``latency.repeats`` forwards, after ``latency.warmup`` untimed ones; CUDA synchronised."""
    cuda = any(value.is_cuda for value in inputs.values() if isinstance(value, torch.Tensor))
    samples = []
    with torch.inference_mode():
        for index in range(latency.warmup + latency.repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            forward(inputs)
            if cuda:
                torch.cuda.synchronize()
            if index >= latency.warmup:
                samples.append((time.perf_counter() - start) * 1000.0)
    return samples


@hydra_main("quantize")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm():
        quantize(cfg)


if __name__ == "__main__":
    main()
