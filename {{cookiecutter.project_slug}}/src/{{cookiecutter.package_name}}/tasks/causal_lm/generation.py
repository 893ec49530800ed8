"""Text generation for a causal-LM module: prompts as text or chat turns, batched greedy or
sampled completions that stop at the end token and never pass the model's positions."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ...core.data.tokenization import pad_token_id
from ...core.models.builder import max_positions


class TextGeneration:
    """Mixed into a LightningModule holding ``model`` (a ``*ForCausalLM``, maybe peft-wrapped), ``tokenizer`` and
    ``inputs`` (:class:`...core.models.inputs.ModelInputs`: ``end_of_turn`` and ``system_prompt`` for chat data)."""

    @property
    def chat(self) -> bool:
        """Trained on chat rows (:mod:`.chat`): prompts get the chat template; generation stops at the end-of-turn token."""
        return self.inputs is not None and self.inputs.end_of_turn is not None

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt: as text, or for a :attr:`chat` model as one user turn (:meth:`messages_ids`)."""
        if not self.chat:
            return [self.tokenizer(prompt)["input_ids"] for prompt in prompts]
        return [self.messages_ids([{"role": "user", "content": p}]) for p in prompts]

    def messages_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation (``{"role", "content"}`` turns, the last a user's) as a prompt: the tokenizer's chat template (for a
        :attr:`chat` model the one it trained with, after the run's system prompt if it set one and ``messages`` has none)
        with its generation prompt.

        Raises:
            ValueError: the tokenizer has no chat template (a model trained on plain text from a base without one).
        """
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template (trained on plain text); fix: complete prompts with generate")
        if self.chat and self.inputs.system_prompt is not None and messages[:1] and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.inputs.system_prompt}, *messages]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def complete(self, prompt_ids: list[list[int]], batch_size: int = 1, **generation: object) -> list[list[int]]:
        """The new token ids for each prompt, up to the first end token (end-of-turn for a chat model, else EOS).

        ``batch_size`` prompts a call, longest first (little padding; an OOM comes first), left-padded; results in
        ``prompt_ids`` order; ``generation`` goes to ``model.generate``. Prompt plus new tokens never pass the model's
        positions: with a warning, ``max_new_tokens`` is capped at ``positions - 1`` and a long prompt loses its start."""
        generation, stops, kept = self._limits(prompt_ids, generation)
        pad = pad_token_id(self.tokenizer)
        was_training = self.model.training
        self.model.eval()
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: prompts per generate call, at least 1")
        order = sorted(range(len(kept)), key=lambda index: -len(kept[index]))  # longest first (stable: ties keep their order)
        completions: list[list[int]] = [[] for _ in kept]
        try:
            for first in range(0, len(order), batch_size):
                batch = order[first : first + batch_size]
                rows = [kept[index] for index in batch]
                longest = max(len(ids) for ids in rows)
                input_ids = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in rows], device=self.device)  # (b, T)
                attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in rows], device=self.device)
                output = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad, use_cache=True, **generation
                )  # (b, T + new tokens)
                for index, new in zip(batch, output[:, longest:].tolist(), strict=True):
                    end = next((i for i, token in enumerate(new) if token in stops), len(new))
                    completions[index] = new[:end]
        finally:
            self.model.train(was_training)
        return completions

    def _limits(self, prompt_ids: list[list[int]], generation: dict) -> tuple[dict, set[int], list[list[int]]]:
        """``generation`` with ``max_new_tokens`` capped below the model's positions and the end token set; the end ids;
        each prompt without the start that leaves no room for the new tokens (each cap with a warning)."""
        limit = max_positions(self.model.config)
        new_tokens = generation.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 20
        if limit is not None and new_tokens >= limit:
            rank_zero_warn(f"max_new_tokens={new_tokens} is not below the model's {limit} positions; generating {limit - 1}")
            new_tokens = limit - 1
        generation = {**generation, "max_new_tokens": new_tokens}
        stop = self.tokenizer.convert_tokens_to_ids(self.inputs.end_of_turn) if self.chat else None
        if stop is not None:
            generation["eos_token_id"] = stop
        stops = {stop} if stop is not None else set(_as_list(self.model.generation_config.eos_token_id))
        room = None if limit is None else limit - new_tokens
        kept = []
        for ids in prompt_ids:
            if room is not None and len(ids) > room:
                rank_zero_warn(
                    f"a prompt of {len(ids)} tokens leaves no room for {new_tokens} new ones in the model's "
                    f"{limit} positions: its first {len(ids) - room} tokens are dropped"
                )
                ids = ids[-room:]
            kept.append(ids)
        return generation, stops, kept

    @torch.no_grad()
    def stream(
        self, prompt_ids: list[int], stop: threading.Event | None = None, tokens: list[int] | None = None, **generation: object
    ) -> Iterator[str]:
        """The completion of one prompt as text pieces, yielded as ``model.generate`` makes its tokens (on a thread); the
        pieces join to :meth:`complete`'s text for the same prompt and settings (each piece is the growth of the decoded
        tokens so far; a piece ending in half a UTF-8 character waits for the rest).  Setting ``stop`` ends it after the
        next token; so does closing the iterator (a client that went away, Ctrl-C).  ``tokens`` (a list) receives the
        completion's ids as :meth:`complete` gives them (without the end token).

        Raises:
            whatever ``model.generate`` raised (re-raised here, on the caller's thread).
        """
        generation, stops, (ids,) = self._limits([prompt_ids], generation)
        stop = stop or threading.Event()
        arrived: queue.Queue = queue.Queue()
        streamer = _TokenQueue(arrived)
        ended = StoppingCriteriaList([_EventStop(stop)])
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with torch.no_grad():
                    input_ids = torch.tensor([ids], device=self.device)  # (1, T)
                    self.model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        pad_token_id=pad_token_id(self.tokenizer),
                        use_cache=True,
                        streamer=streamer,
                        stopping_criteria=ended,
                        **generation,
                    )
            except BaseException as error:  # noqa: BLE001  (handed to the caller's thread)
                failure.append(error)
            finally:
                arrived.put(None)

        was_training = self.model.training
        self.model.eval()
        worker = threading.Thread(target=run, name="generate", daemon=True)
        worker.start()
        new: list[int] = [] if tokens is None else tokens
        shown = ""
        try:
            while (token := arrived.get()) is not None:
                if token in stops:
                    stop.set()
                    continue
                if stop.is_set():
                    continue
                new.append(token)
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                if not text.endswith("\ufffd") and len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text
            if failure:
                raise failure[0]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            if len(text) > len(shown):
                yield text[len(shown) :]
        finally:
            stop.set()
            worker.join()
            self.model.train(was_training)

    def generate_text(self, prompts: list[str], batch_size: int = 1, **generation: object) -> list[str]:
        """Complete each prompt (:meth:`prompt_ids`, :meth:`complete`); return only the new text."""
        completions = self.complete(self.prompt_ids(prompts), batch_size=batch_size, **generation)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]


class _TokenQueue(BaseStreamer):
    """``model.generate``'s streamer: each new token id into ``tokens`` (the first ``put``, the prompt, is skipped)."""

    def __init__(self, tokens: queue.Queue) -> None:
        self.tokens, self.prompt_seen = tokens, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.tokens.put(token)

    def end(self) -> None:
        pass


class _EventStop(StoppingCriteria):
    """Ends generation once ``event`` is set (the caller stopped reading)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)
