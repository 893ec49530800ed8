r"""Complete prompts with a causal LM: a training checkpoint or an exported model folder.

    python -m <package>.generate ckpt_path=RUN/checkpoints/last.ckpt 'prompts=["ROMEO.\nO"]'
    python -m <package>.generate model_dir=models/my_lm prompts_file=prompts.txt generation.do_sample=true

A model trained on chat data (``data=chat``) gets each prompt as a user turn rendered with its
chat template, and stops at its end-of-turn token.  Prints each completion and writes ``{"prompt", "completion"}`` rows to ``output`` (jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from .utils.config import ConfigError, to_plain, validate_config
from .utils.outputs import claim_outputs
from .utils.run import atomic_write_path, exit_on_bad_input


def read_prompts(cfg: DictConfig) -> list[str]:
    r"""``cfg.prompts`` plus the non-empty lines of ``cfg.prompts_file``.  In both, the two
    characters ``\n`` stand for a newline (a shell passes them literally in single quotes).

    Raises:
        ConfigError: no prompt at all, or a prompts file that does not exist.
    """
    prompts = [str(p).replace("\\n", "\n") for p in (cfg.prompts or [])]
    if cfg.prompts_file is not None:
        path = Path(cfg.prompts_file)
        if not path.is_file():
            raise ConfigError(f"prompts_file={cfg.prompts_file!r} is not a file; fix: a text file, one prompt per line")
        lines = path.read_text(encoding="utf-8").splitlines()
        prompts += [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts or not all(prompts):
        raise ConfigError("no prompts; fix: 'prompts=[\"Once upon a time\"]' or prompts_file=path/to/prompts.txt")
    return prompts


def load_generator(cfg: DictConfig):
    """A :class:`CausalLMModule` from ``ckpt_path``, or one wrapping the HF folder ``model_dir``."""
    from .models.builder import config_to_dict
    from .models.causal_lm import CHAT_FILE, CausalLMModule
    from .models.inputs import ModelInputs

    if cfg.ckpt_path is not None:
        from .utils.checkpoints import load_trained_module

        return load_trained_module(CausalLMModule, cfg, cfg.ckpt_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir)
    module = CausalLMModule(
        model={"fetch": None}, optimizer={"step_in_backward": False}, peft={"method": "none"}, hf_config=config_to_dict(model.config)
    )
    module.model, module.tokenizer = model, AutoTokenizer.from_pretrained(cfg.model_dir)
    chat_file = Path(cfg.model_dir, CHAT_FILE)
    if chat_file.is_file():  # trained on chat data: prompts are rendered as a user turn
        chat = json.loads(chat_file.read_text(encoding="utf-8"))
        module.inputs = ModelInputs(module.tokenizer, None, 1, end_of_turn=chat["end_of_turn"], system_prompt=chat["system_prompt"])
    return module


def generate(cfg: DictConfig) -> list[dict[str, str]]:
    """Complete every prompt; write ``cfg.output`` (jsonl, atomically) and return the rows.

    Raises:
        ConfigError: neither or both of ``ckpt_path``/``model_dir``, a missing file, no prompts, a
            refused checkpoint, an ``output`` that is an input or that exists without ``overwrite=true``.
    """
    validate_config(cfg, resumes=False)
    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        raise ConfigError("give exactly one of ckpt_path=RUN/checkpoints/last.ckpt or model_dir=<exported folder>")
    if cfg.model_dir is not None and not Path(cfg.model_dir, "config.json").is_file():
        raise ConfigError(f"model_dir={cfg.model_dir!r} has no config.json; fix: a folder written by the export entry point")
    prompts = read_prompts(cfg)
    output = Path(cfg.output)
    inputs = {"prompts_file": cfg.prompts_file, "ckpt_path": cfg.ckpt_path, "model_dir": cfg.model_dir}
    claim_outputs(cfg, {"output": output}, inputs, run_files=())
    module = load_generator(cfg)
    if torch.cuda.is_available():
        module.to("cuda")
    generation = to_plain(cfg.generation)
    if not generation.get("do_sample"):  # greedy decoding ignores them (and transformers warns)
        generation.pop("temperature", None), generation.pop("top_p", None)
    completions = module.generate_text(prompts, **generation)
    rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    separator = "\n--- answer:\n" if getattr(module, "chat", False) else ""  # a chat model answers; a text model continues
    for row in rows:
        print(f"--- {row['prompt']!r}\n{row['prompt']}{separator}{row['completion']}\n")
    with atomic_write_path(output) as partial:
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"Completions: {output}")
    return rows


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input():
        generate(cfg)


if __name__ == "__main__":
    main()
