"""Export a causal-LM checkpoint as a plain Hugging Face model folder.

    python -m <package>.export ckpt_path=RUN/checkpoints/last.ckpt output_dir=models/my_lm

LoRA/QLoRA adapters are merged into the base weights (``merge_and_unload``); a QLoRA adapter is
merged into the *unquantized* base (loaded in fp32 from ``model.name_or_path``), the usual way to
ship a QLoRA fine-tune.  Beside the merged model, ``output_dir/adapter/`` holds the adapter alone
(peft's ``save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors`` in fp32, and the
tokenizer), which ``PeftModel.from_pretrained(base, output_dir/adapter)`` loads onto the base.
The merged weights are saved in ``dtype``: by default the dtype the run computed in (bfloat16
for ``bf16-mixed``/``bf16-true``, float16 for ``16-*``, else float32).  The folder (``config.json``, ``model.safetensors``, tokenizer files)
loads with ``AutoModelForCausalLM.from_pretrained(output_dir)`` anywhere, without this project.
A model trained on chat data (``data=chat``) is written with its chat template, its end-of-turn
token as the EOS of the tokenizer and of ``generation_config.json`` (so ``generate`` stops at the
end of the answer anywhere), and ``chat.json`` (end-of-turn token, system prompt), from which
this project's ``generate model_dir=`` renders prompts as chat.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig

from .checks import validate_config
from .compress.pruning import pruned_with, shrink_ffn
from .errors import ConfigError
from .eval import full_precision_overrides
from .models.adapters import uses_peft
from .models.precision import compute_dtype
from .tasks.causal_lm.module import CHAT_FILE, causal_module_class
from .utils.checkpoints import load_trained_module, trained_checkpoint
from .utils.outputs import claim_outputs, replace_folder, staging_folder
from .utils.run import exit_cleanly_on_sigterm, exit_on_bad_input, hydra_main

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_FOLDER = "adapter"  # output_dir/adapter: the LoRA/QLoRA adapter alone (peft's save_pretrained)


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's model (adapters merged) and tokenizer to ``cfg.output_dir``.

    The folder is written under a temporary name (``.export-staging-<host>-<pid>-*``) and renamed,
    so it is complete or absent; such folders of dead exports are removed at start.

    Raises:
        ConfigError: a ``dtype`` not in :data:`DTYPES` (nor null), a missing or refused checkpoint, a non-causal-LM checkpoint, an output folder
            that exists (without ``overwrite=true``; with it, only a folder export wrote is
            replaced) or that lies inside another run's folder.
    """
    validate_config(cfg, required=("ckpt_path",), resumes=False)
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(
            f"dtype={cfg.dtype!r} is not one of {DTYPES} (the saved weights' floating-point type; null = the run's compute "
            f"dtype; int8/int4 weights are quantize's job); fix: dtype=bfloat16, or python -m {__package__}.quantize for integer weights"
        )
    output = Path(cfg.output_dir)
    # Memory-mapped: only the hyperparameters are read here, not the weights (loaded once, below).
    checkpoint = trained_checkpoint(cfg.ckpt_path)
    claim_outputs(cfg, {"output_dir": output}, {"ckpt_path": cfg.ckpt_path}, run_files=(), folder_markers={"output_dir": "config.json"})
    hparams = checkpoint.get("hyper_parameters", {})
    if "peft" not in hparams:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path!r} is not a causal-LM checkpoint; export writes causal LMs only")
    dtype = cfg.dtype or str(compute_dtype((checkpoint.get("model_inputs") or {}).get("precision", "32-true"))).removeprefix("torch.")
    module = load_trained_module(causal_module_class(cfg), cfg, cfg.ckpt_path, **full_precision_overrides(hparams))
    with staging_folder(output, "export") as tmp:
        staging = Path(tmp) / "model"
        if module.chat:  # the end-of-turn token ends generation (and is the folder's EOS)
            eot = module.inputs.end_of_turn
            module.tokenizer.eos_token = eot
            module.model.generation_config.eos_token_id = module.tokenizer.convert_tokens_to_ids(eot)
        if uses_peft(hparams.get("peft")):  # the adapter alone, before merging changes the weights
            module.model.save_pretrained(staging / ADAPTER_FOLDER)
            module.tokenizer.save_pretrained(staging / ADAPTER_FOLDER)
        model = module.merged_model()
        if pruned_with(checkpoint) == "structured":  # the zeroed FFN neurons go: a smaller folder, the same outputs
            shrink_ffn(model)
        model.to(getattr(torch, dtype))
        model.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)  # with the chat template it was trained with
        if module.chat:
            chat = {"end_of_turn": module.inputs.end_of_turn, "system_prompt": module.inputs.system_prompt}
            (staging / CHAT_FILE).write_text(json.dumps(chat, indent=1) + "\n", encoding="utf-8")
        replace_folder(staging, output, marker="config.json")
    adapter = f"; the adapter alone: {output / ADAPTER_FOLDER} (PeftModel.from_pretrained)" if uses_peft(hparams.get("peft")) else ""
    print(f"Exported: {output}, {dtype} (load with AutoModelForCausalLM.from_pretrained){adapter}")
    return output


@hydra_main("export")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input(), exit_cleanly_on_sigterm():
        export(cfg)


if __name__ == "__main__":
    main()
