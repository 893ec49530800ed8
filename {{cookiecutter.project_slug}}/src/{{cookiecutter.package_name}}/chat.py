"""Talk to a causal LM in the terminal: a training checkpoint or an exported model folder.

    python -m <package>.chat ckpt_path=RUN/checkpoints/last.ckpt
    python -m <package>.chat model_dir=models/my_lm generation.do_sample=true generation.temperature=0.7

Each line typed is a user turn, rendered with the chat template the run trained with (and its system prompt); the answer
is printed as it is generated and joins the history. The oldest turns are dropped to keep the conversation within
``max_length`` tokens. ``/reset`` clears the history; ``/exit``, Ctrl-D or Ctrl-C at the prompt ends the session;
Ctrl-C during an answer stops it (it stays out of the history). Exits 0 when the session ends, 1 on bad config (a model
whose tokenizer has no chat template is refused before the first prompt: complete text with generate)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TextIO

import torch
from omegaconf import DictConfig, OmegaConf

from .core.config.resolvers import to_plain
from .core.errors import ConfigError
from .core.run.entry import exit_on_bad_input, hydra_main
from .generate import generation_problems, load_generator, source_problems
from .tasks import check_config

COMMANDS = "/reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer"


class TurnTooLong(ValueError):
    """The newest user turn alone is over the history budget (``tokens`` with the chat template, ``budget``)."""

    def __init__(self, tokens: int, budget: int) -> None:
        super().__init__(f"a turn of {tokens} tokens is over the {budget}-token budget")
        self.tokens, self.budget = tokens, budget


def chat_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with ``cfg``'s own settings (checked before any weights load)."""
    problems = source_problems(cfg)
    generation = OmegaConf.create({**to_plain(cfg.generation), "batch_size": 1})  # (generate's setting: one conversation here)
    problems += generation_problems(generation)
    length = cfg.get("max_length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length <= 0):
        problems.append(f"max_length={length!r} must be a positive number of tokens or null (the run's); fix: e.g. max_length=2048")
    return problems


def load_chat_model(cfg: DictConfig):
    """The causal-LM module of ``cfg`` (:func:`.generate.load_generator`), on the GPU when there is one.

    Raises:
        ConfigError: the tokenizer has no chat template (a model trained on plain text from a base without one); see
            :func:`.generate.load_generator` for the rest.
    """
    module = load_generator(cfg)
    if module.tokenizer.chat_template is None:
        source = f"ckpt_path={cfg.ckpt_path!r}" if cfg.ckpt_path is not None else f"model_dir={cfg.model_dir!r}"
        raise ConfigError(
            f"{source}: its tokenizer has no chat template (trained on plain text), so it cannot hold a conversation; "
            f"fix: complete text with generate (python -m {__package__}.generate ... 'prompts=[\"...\"]'), or train on chat data"
        )
    if torch.cuda.is_available():
        module.to("cuda")
    return module


def history_budget(cfg: DictConfig, module) -> int | None:
    """Tokens the rendered conversation may take before an answer: ``max_length`` (else the run's ``data.max_length``, the
    length it trained on; else the model's positions), and never more than the positions less
    ``generation.max_new_tokens`` (room for the answer); ``None``: no limit known.

    Raises:
        ConfigError: no room left for a prompt.
    """
    from .core.models.builder import max_positions

    positions = max_positions(module.model.config)
    run_length = getattr(getattr(module, "inputs", None), "max_length", None)
    limit = cfg.get("max_length") or run_length or positions
    if limit is None:
        return None
    budget = limit if positions is None else min(limit, positions - cfg.generation.max_new_tokens)
    if budget <= 0:
        raise ConfigError(
            f"the model's {positions} positions leave no room for a prompt before generation.max_new_tokens="
            f"{cfg.generation.max_new_tokens}; fix: a smaller generation.max_new_tokens"
        )
    return budget


def fit_history(module, history: list[dict[str, str]], budget: int | None) -> tuple[list[dict[str, str]], bool]:
    """``history`` (alternating user/assistant turns, the last a user's) without its oldest whole turns (a user turn and
    its answer) until :meth:`messages_ids` of it fits ``budget`` tokens; and whether any were dropped.

    Raises:
        TurnTooLong: the newest user turn alone does not fit.
    """
    kept = list(history)
    if budget is None:
        return kept, False
    while len(tokens := module.messages_ids(kept)) > budget:
        if len(kept) <= 1:
            raise TurnTooLong(len(tokens), budget)
        kept = kept[2:]
    return kept, len(kept) < len(history)


def answer(module, prompt_ids: list[int], generation: dict, out: TextIO) -> str | None:
    """Stream the answer to ``prompt_ids`` onto ``out`` piece by piece; its text, or ``None`` when Ctrl-C stopped it.

    Raises:
        whatever generation raised (:meth:`...tasks.causal_lm.generation.TextGeneration.stream`).
    """
    pieces: list[str] = []
    stream = module.stream(prompt_ids, **generation)
    try:
        for piece in stream:
            pieces.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:  # (the finally below ends generation after its next token)
        out.write("\n(stopped)\n")
        out.flush()
        return None
    finally:
        stream.close()
    out.write("\n")
    out.flush()
    return "".join(pieces)


def chat(cfg: DictConfig, read_line: Callable[[str], str] = input, out: TextIO | None = None) -> list[dict[str, str]]:
    """Hold a conversation: each ``read_line("> ")`` is a user turn, answered on ``out`` (stdout), until ``/exit``, EOF or
    Ctrl-C at the prompt; returns the history at the end.

    Raises:
        ConfigError: not exactly one of ``ckpt_path``/``model_dir``, a missing file, bad ``generation`` or ``max_length``
            settings, a refused checkpoint, a model without a chat template, or no room for a prompt.
    """
    out = out or sys.stdout
    check_config(cfg, resumes=False)
    problems = chat_problems(cfg)
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    module = load_chat_model(cfg)
    budget = history_budget(cfg, module)
    generation = to_plain(cfg.generation)
    generation.pop("batch_size", None)
    if not generation.get("do_sample"):  # greedy decoding ignores them (and transformers warns)
        generation.pop("temperature", None), generation.pop("top_p", None)
    source = cfg.ckpt_path if cfg.ckpt_path is not None else cfg.model_dir
    if not module.chat:
        out.write(f"Note: {source} was not trained on chat data by its run; its tokenizer's chat template (the base model's) is used.\n")
    within = f"history within {budget} tokens" if budget is not None else "no history limit known"
    out.write(f"Chatting with {source} ({within}): {COMMANDS}.\n")
    out.flush()
    history: list[dict[str, str]] = []
    noted = False
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history = []
            out.write("(history cleared)\n")
            continue
        if not text:
            continue
        try:
            kept, dropped = fit_history(module, [*history, {"role": "user", "content": text}], budget)
            prompt_ids = module.messages_ids(kept)
        except TurnTooLong as error:
            out.write(
                f"(that message takes {error.tokens} tokens with the chat template, over the {error.budget} the conversation "
                "may use before an answer: not sent; fix: a shorter message, or max_length=<more tokens> / a smaller "
                "generation.max_new_tokens)\n"
            )
            continue
        except KeyboardInterrupt:  # (before the answer started)
            out.write("\n(stopped)\n")
            continue
        if dropped and not noted:
            out.write(f"(older turns dropped to keep the conversation within {budget} tokens)\n")
            noted = True
        out.flush()
        reply = answer(module, prompt_ids, generation, out)
        if reply is not None:
            history = [*kept, {"role": "assistant", "content": reply}]
    out.flush()
    return history


@hydra_main("chat")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config exits 1 with its message alone; the session's end exits 0. Ctrl-C
    raises KeyboardInterrupt here even when the process started with SIGINT ignored (a background job of a shell)."""
    try:
        import readline  # noqa: F401  (line editing and recall for input())
    except ImportError:
        pass
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops an answer even if the launcher ignored SIGINT
    with exit_on_bad_input():
        chat(cfg)


if __name__ == "__main__":
    main()
