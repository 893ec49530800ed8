"""Export a causal-LM checkpoint as a plain Hugging Face model folder, or as one GGUF file for llama.cpp.

    python -m <package>.export ckpt_path=RUN/checkpoints/last.ckpt output_dir=models/my_lm
    python -m <package>.export ckpt_path=RUN/checkpoints/last.ckpt output_dir=models/my_lm_gguf format=gguf outtype=q8_0

LoRA/QLoRA adapters are merged (QLoRA into the *unquantized* fp32 base, the usual way to ship it); ``output_dir/adapter/``
holds the adapter alone, for ``PeftModel.from_pretrained``.  Weights are saved in ``dtype`` (default: the run's compute
dtype); the folder loads with ``AutoModelForCausalLM.from_pretrained`` without this project.  A chat model keeps its
template, its end-of-turn token as EOS, and ``chat.json`` (for ``generate model_dir=``).  ``format=gguf`` writes
``output_dir/model.<TYPE>.gguf`` instead (Llama family: :mod:`.tasks.causal_lm.gguf_file`; anything it cannot write
faithfully is refused before writing).  Each output is reloaded as a user would (a GGUF file by transformers' GGUF
reader) and scored on ``data.splits.test`` against the checkpoint: ``export_report.{json,md}`` (``measure=false`` skips
it; no test split is not a failure).

Exit codes: 0 done; 1 bad config or data, or a full disk (the message alone); 143 SIGTERM (the partial output is removed).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from .core.checkpoints.io import data_kwargs, load_trained_module, trained_checkpoint
from .core.compress.pruning import pruned_with, shrink_ffn
from .core.compress.report import Measurement, build_report, markdown_table, weight_bytes, write_report
from .core.errors import ConfigError
from .core.models.adapters import save_adapter, uses_peft
from .core.models.precision import compute_dtype
from .core.run.entry import exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main
from .core.run.outputs import claim_outputs, replace_folder, staging_folder
from .eval import full_precision_overrides
from .tasks import check_config, task_of, tasks
from .tasks.causal_lm import causal_module_class
from .tasks.causal_lm.gguf_file import GGUF_TYPES

DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("hf", "gguf")
ADAPTER_FOLDER = "adapter"  # output_dir/adapter: the LoRA/QLoRA adapter alone (peft's save_pretrained)
REPORT_FILES = ("export_report.json", "export_report.md")


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's model (adapters merged) and tokenizer to ``cfg.output_dir``, whole or not at all.

    Raises:
        ConfigError: a ``dtype`` not in :data:`DTYPES` (nor null), a ``format`` not in :data:`FORMATS`, an ``outtype`` not
            in :data:`.tasks.causal_lm.gguf_file.GGUF_TYPES` (or a ``dtype`` with ``format=gguf``), ``measure`` not a bool, a missing, refused or
            non-causal-LM checkpoint, an existing output folder (without ``overwrite=true``) or one inside another run's.
    """
    check_config(cfg, required=("ckpt_path",), resumes=False)
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(
            f"dtype={cfg.dtype!r} is not one of {DTYPES} (the saved weights' floating-point type; null = the run's compute "
            f"dtype; int8/int4 weights are quantize's job); fix: dtype=bfloat16, or python -m {__package__}.quantize for integer weights"
        )
    gguf = cfg.format == "gguf"
    if cfg.format not in FORMATS:
        raise ConfigError(
            f"format={cfg.format!r} is not one of {FORMATS}; fix: format=hf (a Hugging Face folder) or format=gguf (llama.cpp)"
        )
    if gguf and (cfg.outtype not in GGUF_TYPES or cfg.dtype is not None):
        raise ConfigError(
            f"format=gguf takes its weight type from outtype (one of {sorted(GGUF_TYPES)}), not dtype; got outtype="
            f"{cfg.outtype!r}, dtype={cfg.dtype!r}; fix: outtype=f16 (or q8_0) and no dtype="
        )
    if not isinstance(cfg.measure, bool):
        raise ConfigError(
            f"measure={cfg.measure!r} must be true or false (score the written folders on data.splits.test); fix: measure=true"
        )
    output = Path(cfg.output_dir)
    # Memory-mapped: only the hyperparameters are read here, not the weights (loaded once, below).
    checkpoint = trained_checkpoint(cfg.ckpt_path)
    hparams, stored_task = checkpoint.get("hyper_parameters", {}), checkpoint.get("task")
    if stored_task in tasks() and cfg.format not in task_of(stored_task).export_formats:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {stored_task} model, which export does not write as format={cfg.format} (it "
            f"writes causal LMs); fix: use it through eval/predict as it is, or make it smaller with python -m {__package__}.quantize"
        )
    marker = REPORT_FILES[0] if gguf else "config.json"  # the file that marks a folder this command wrote
    claim_outputs(cfg, {"output_dir": output}, {"ckpt_path": cfg.ckpt_path}, run_files=(), folder_markers={"output_dir": marker})
    if "peft" not in hparams:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r} is not a causal-LM checkpoint; export writes causal LMs only (a Hugging Face folder or "
            f"GGUF); fix: a classifier is used through eval/predict as it is, or made smaller with python -m {__package__}.quantize"
        )
    dtype = cfg.dtype or str(compute_dtype((checkpoint.get("model_inputs") or {}).get("precision", "32-true"))).removeprefix("torch.")
    module = load_trained_module(causal_module_class(cfg), cfg, cfg.ckpt_path, **full_precision_overrides(hparams))
    scorer = Scorer(cfg, module)  # the test split, read (and refused when bad) before anything is written
    load = f"python -m {__package__}.eval {shlex.quote(f'ckpt_path={cfg.ckpt_path}')} (with the run's experiment=)"
    measurements = [
        scorer.measure(
            "checkpoint",
            module.model,
            Path(cfg.ckpt_path).stat().st_size,
            str(cfg.ckpt_path),
            QLORA_NOTE if (hparams.get("peft") or {}).get("method") == "qlora" else CHECKPOINT_NOTE,
            load,
        )
    ]
    if gguf:
        return export_gguf(cfg, module, checkpoint, scorer, measurements, output)
    with staging_folder(output, "export") as tmp:
        staging = Path(tmp) / "model"
        if module.chat:  # the end-of-turn token ends generation (and is the folder's EOS)
            eot = module.inputs.end_of_turn
            module.tokenizer.eos_token = eot
            module.model.generation_config.eos_token_id = module.tokenizer.convert_tokens_to_ids(eot)
        if uses_peft(hparams.get("peft")):  # the adapter alone, before merging changes the weights
            save_adapter(module.model, staging / ADAPTER_FOLDER, module.initial_adapter)  # (PiSSA/OLoRA: for the original base)
            module.tokenizer.save_pretrained(staging / ADAPTER_FOLDER)
        model = module.merged_model()
        if pruned_with(checkpoint) == "structured":  # the zeroed FFN neurons go: a smaller folder, the same outputs
            shrink_ffn(model)
        model.to(getattr(torch, dtype))
        model.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)  # with the chat template it was trained with
        if module.chat:
            chat = {"end_of_turn": module.inputs.end_of_turn, "system_prompt": module.inputs.system_prompt}
            from .tasks.causal_lm.module import CHAT_FILE  # (here: the module brings in torchao, which logs as it loads)

            (staging / CHAT_FILE).write_text(json.dumps(chat, indent=1) + "\n", encoding="utf-8")
        base_path, attention = module.hparams.model.get("name_or_path"), module.attn_implementation
        del model, module  # (one model in memory at a time from here)
        measurements += scorer.measure_folders(staging, output, dtype, base_path, attention)
        report = build_report(measurements, [], scorer.context(cfg), baseline="checkpoint")
        write_report(staging, report, REPORT_FILES)
        replace_folder(staging, output, marker="config.json")
    print(markdown_table(report))
    adapter = f"; the adapter alone: {output / ADAPTER_FOLDER} (PeftModel.from_pretrained)" if uses_peft(hparams.get("peft")) else ""
    print(f"Exported: {output}, {dtype} (load with AutoModelForCausalLM.from_pretrained){adapter}")
    return output


def export_gguf(cfg: DictConfig, module, checkpoint: dict, scorer: Scorer, measurements: list, output: Path) -> Path:
    """``output/model.<TYPE>.gguf`` (adapters merged, fp32 weights cast to ``outtype``) and its export report, whole or not at all.

    Raises:
        ConfigError: the model or tokenizer has no faithful GGUF form (:func:`.tasks.causal_lm.gguf_file.gguf_problems`),
            checked before anything is written.
    """
    from transformers import AutoModelForCausalLM

    from .tasks.causal_lm.gguf_file import gguf_problems, rope_factors, write_gguf

    end_of_turn = module.inputs.end_of_turn if module.chat else None
    model = module.merged_model()
    if pruned_with(checkpoint) == "structured":
        shrink_ffn(model)
    problems = gguf_problems(model, module.tokenizer, cfg.outtype)
    if problems:
        raise ConfigError("format=gguf cannot write this model faithfully:\n  - " + "\n  - ".join(problems))
    name = f"model.{GGUF_TYPES[cfg.outtype]}.gguf"
    llama3 = rope_factors(model.config) is not None
    config = model.config
    with staging_folder(output, "export") as tmp:
        staging = Path(tmp) / "model"
        staging.mkdir()
        write_gguf(model, module.tokenizer, staging / name, cfg.outtype, Path(str(cfg.ckpt_path)).parent.parent.name, end_of_turn)
        del model, module
        # transformers' GGUF reader reads no Llama 3 RoPE scaling (rope_freqs): the checkpoint's config keeps it in the score.
        reread = AutoModelForCausalLM.from_pretrained(
            staging, gguf_file=name, dtype=torch.float32, **({"config": config} if llama3 else {})
        )
        measurements.append(
            scorer.measure(
                f"gguf-{cfg.outtype}",
                reread,
                (staging / name).stat().st_size,
                str(output / name),
                f"one GGUF file, {GGUF_TYPES[cfg.outtype]} weights (1-D tensors F32), scored through transformers' GGUF reader"
                + (" with the checkpoint's config (the reader ignores Llama 3 RoPE scaling)" if llama3 else ""),
                f"llama-cli -m {shlex.quote(str(output / name))}",
            )
        )
        del reread
        context = {**scorer.context(cfg), "size_meaning": "the checkpoint file's bytes; the GGUF file's bytes"}
        report = build_report(measurements, [], context, baseline="checkpoint")
        write_report(staging, report, REPORT_FILES)
        replace_folder(staging, output, marker=REPORT_FILES[0])
    print(markdown_table(report))
    print(f"Exported: {output / name} (llama.cpp: llama-cli -m {shlex.quote(str(output / name))})")
    return output / name


CHECKPOINT_NOTE = "the training checkpoint (trained weights, optimizer and run state), loaded as export loads it"
QLORA_NOTE = (
    "the QLoRA checkpoint's adapters on the unquantized (fp32) base, as export merges them: not the 4-bit model that was "
    "trained (eval ckpt_path=... scores that)"
)


class Scorer:
    """The export report's measurements: each model's perplexity on the test split, on the GPU if there is one.

    Raises (at construction, before anything is written):
        DataError / ConfigError: a bad test split.
    """

    def __init__(self, cfg: DictConfig, module) -> None:
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.task = task_of(module.TASK_NAME)
        self.datamodule = self.loader = None
        self.unmeasured = ""
        if not cfg.measure:
            self.unmeasured = "measure=false"
        elif cfg.task.name != module.TASK_NAME:  # the data group is another task's: its rows are not this model's
            self.unmeasured = (
                f"the config's task is {cfg.task.name}, the checkpoint's {module.TASK_NAME}; pass the run's experiment= "
                f"(or task={module.TASK_NAME} and its data group) with data.splits.test"
            )
        elif (cfg.data.get("splits") or {}).get("test") is None:
            self.unmeasured = "no test split: data.splits.test is null; set it to measure the folders"
        else:
            self.datamodule = hydra.utils.instantiate(cfg.data, **data_kwargs(cfg, module, self.task.shaping_keys))
            self.datamodule.prepare_data()
            self.datamodule.setup("test")
            self.loader = self.datamodule.test_dataloader()

    def score(self, model: torch.nn.Module) -> dict[str, float]:
        """The task's metrics (perplexity) of ``model`` over the test split; ``{}`` when not measured."""
        if self.loader is None:
            return {}
        model.eval().to(self.device)
        forward: Callable[[dict], torch.Tensor] = lambda inputs: model(**inputs).logits  # noqa: E731  (B, T, V)
        metrics = self.task.score(forward, self.loader, self.device, self.datamodule)
        model.to("cpu")
        return metrics

    def measure(self, name: str, model: torch.nn.Module, size_bytes: int, path: str, storage: str, load: str = "") -> Measurement:
        if self.loader is not None:
            print(f"[{name}] scoring on the test split ({len(self.datamodule.datasets['test'])} rows, {self.device}) ...")
        note = f"not measured ({self.unmeasured})" if self.unmeasured else ""
        try:
            metrics = self.score(model)
        except torch.OutOfMemoryError:  # e.g. an 8B model in fp32 on a 24 GB card: the folder is still written
            model.to("cpu")
            torch.cuda.empty_cache()
            bytes_ = sum(p.numel() * p.element_size() for p in model.parameters())
            metrics, note = {}, f"not measured (out of memory on the {self.device}: its weights alone are {bytes_ / 2**30:.1f} GiB)"
        return Measurement(
            name=name,
            runtime=f"pytorch-eager-{self.device}",
            latency_baseline=name,
            size_bytes=size_bytes,
            metrics=metrics,
            latency_ms=[],
            load=load,
            storage=storage,
            path=path,
            note=note,
        )

    def measure_folders(self, staging: Path, output: Path, dtype: str, base_path: str | None, attention: str) -> list[Measurement]:
        """The adapter folder (if any) on a fresh fp32 base, then the merged folder, each reloaded by transformers/peft alone."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        measurements = []
        adapter = staging / ADAPTER_FOLDER
        if adapter.is_dir():
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, attn_implementation=attention)
            model = PeftModel.from_pretrained(base, adapter)
            measurements.append(
                self.measure(
                    "adapter",
                    model,
                    weight_bytes(adapter),
                    str(output / ADAPTER_FOLDER),
                    "peft adapter (fp32 safetensors), on the fp32 base model.name_or_path",
                    f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base_path!r}), {str(output / ADAPTER_FOLDER)!r})",
                )
            )
            del model, base
        model = AutoModelForCausalLM.from_pretrained(staging, dtype=getattr(torch, dtype), attn_implementation=attention)
        measurements.append(
            self.measure(
                "merged",
                model,
                weight_bytes(staging) - (weight_bytes(adapter) if adapter.is_dir() else 0),
                str(output),
                f"a plain Hugging Face folder, {dtype} safetensors (adapters merged)",
                f"AutoModelForCausalLM.from_pretrained({str(output)!r})",
            )
        )
        return measurements

    def context(self, cfg: DictConfig) -> dict:
        test = self.datamodule.datasets["test"] if self.loader is not None else None
        return {
            "title": "Export report",
            "source": str(cfg.ckpt_path),
            "task": self.task.name,
            "split": "test" if test is not None else None,
            "rows": len(test) if test is not None else 0,
            "data": str(cfg.data.splits.get("test")) if test is not None else None,
            "unmeasured": self.unmeasured,
            "metric_names": list(self.task.quality),
            "size_meaning": "the checkpoint file's bytes; each folder's weight files (safetensors)",
        }


@hydra_main("export")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm():
        export(cfg)


if __name__ == "__main__":
    main()
