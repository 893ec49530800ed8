r"""Complete prompts with a causal LM: a training checkpoint or an exported model folder.

    python -m <package>.generate ckpt_path=RUN/checkpoints/last.ckpt 'prompts=["ROMEO.\nO"]'
    python -m <package>.generate model_dir=models/my_lm prompts_file=prompts.txt generation.do_sample=true

A chat-trained model gets each prompt as a user turn and stops at its end-of-turn token. Prints each
completion and writes ``{"prompt", "completion"}`` rows to ``output`` (jsonl); exits 1 on bad config or data."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig

from .core.config.resolvers import to_plain
from .core.data.loading import read_prompt_file
from .core.errors import ConfigError
from .core.run.entry import atomic_write_path, exit_on_bad_input, hydra_main
from .core.run.outputs import claim_outputs
from .tasks import check_config


def read_prompts(cfg: DictConfig) -> list[str]:
    r"""``cfg.prompts`` (a literal ``\n`` is a newline) plus those of ``cfg.prompts_file`` (:func:`...read_prompt_file`).

    Raises:
        ConfigError: no prompt.  DataError: a bad prompts file (see :func:`.core.data.loading.read_prompt_file`).
    """
    prompts = [str(p).replace("\\n", "\n") for p in (cfg.prompts or [])]
    if cfg.prompts_file is not None:
        prompts += read_prompt_file("prompts_file", cfg.prompts_file)
    if not prompts or not all(prompts):
        raise ConfigError("no prompts; fix: 'prompts=[\"Once upon a time\"]' or prompts_file=path/to/prompts.txt")
    return prompts


def generation_problems(generation: DictConfig) -> list[str]:
    """What is wrong with the ``generation`` settings (checked before any weights load)."""
    problems = []
    tokens = generation.get("max_new_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        problems.append(f"generation.max_new_tokens={tokens!r} must be a positive number of tokens; fix: e.g. generation.max_new_tokens=64")
    if not isinstance(generation.get("do_sample"), bool):
        problems.append(
            f"generation.do_sample={generation.get('do_sample')!r} must be true or false; fix: generation.do_sample=false (greedy)"
        )
    temperature, top_p = generation.get("temperature"), generation.get("top_p")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        problems.append(f"generation.temperature={temperature!r} must be a number > 0; fix: e.g. generation.temperature=0.7")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        problems.append(f"generation.top_p={top_p!r} must be in (0, 1]; fix: e.g. generation.top_p=0.9 (1.0: off)")
    size = generation.get("batch_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        problems.append(f"generation.batch_size={size!r} must be a positive number of prompts; fix: e.g. generation.batch_size=16")
    return problems


def source_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with the model to load: not exactly one of ``ckpt_path``/``model_dir``, or a ``model_dir`` without
    ``config.json`` (generate, chat and serve read either)."""
    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        return ["give exactly one of ckpt_path=RUN/checkpoints/last.ckpt or model_dir=<exported folder>"]
    if cfg.model_dir is not None and not Path(cfg.model_dir, "config.json").is_file():
        return [f"model_dir={cfg.model_dir!r} has no config.json; fix: a folder written by the export entry point"]
    return []


def load_generator(cfg: DictConfig):
    """The causal-LM task module from ``ckpt_path``, or a ``CausalLMModule`` wrapping the HF folder ``model_dir``."""
    from .core.models.builder import config_to_dict
    from .core.models.inputs import ModelInputs
    from .tasks.causal_lm import causal_module_class
    from .tasks.causal_lm.module import CHAT_FILE, CausalLMModule

    if cfg.ckpt_path is not None:
        from .core.checkpoints.io import load_trained_module

        return load_trained_module(causal_module_class(cfg), cfg, cfg.ckpt_path)
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
        ConfigError: not exactly one of ``ckpt_path``/``model_dir``, a missing file, no prompts, bad ``generation``
            settings, a refused checkpoint, or an ``output`` that is an input or exists without ``overwrite=true``.
    """
    check_config(cfg, resumes=False)
    problems = source_problems(cfg) or generation_problems(cfg.generation)
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    prompts = read_prompts(cfg)
    output = Path(cfg.output)
    inputs = {"prompts_file": cfg.prompts_file, "ckpt_path": cfg.ckpt_path, "model_dir": cfg.model_dir}
    claim_outputs(cfg, {"output": output}, inputs, run_files=())
    module = load_generator(cfg)
    if torch.cuda.is_available():
        module.to("cuda")
    generation = to_plain(cfg.generation)
    batch_size = generation.pop("batch_size")  # (ours, not model.generate's)
    if not generation.get("do_sample"):  # greedy decoding ignores them (and transformers warns)
        generation.pop("temperature", None), generation.pop("top_p", None)
    completions = module.generate_text(prompts, batch_size=batch_size, **generation)
    rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    separator = "\n--- answer:\n" if getattr(module, "chat", False) else ""  # a chat model answers; a text model continues
    for row in rows:
        print(f"--- {row['prompt']!r}\n{row['prompt']}{separator}{row['completion']}\n")
    with atomic_write_path(output) as partial:
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"Completions: {output}")
    return rows


@hydra_main("generate")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input():
        generate(cfg)


if __name__ == "__main__":
    main()
