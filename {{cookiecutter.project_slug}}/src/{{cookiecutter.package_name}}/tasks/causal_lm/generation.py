"""Text generation for a causal-LM module: prompts as text or chat turns, batched greedy or
sampled completions that stop at the end token and never pass the model's positions."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn

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
        """Token ids of each prompt: as text, or for a :attr:`chat` model as one user turn (after
        the run's system prompt, if it set one) rendered with the chat template and its generation prompt."""
        if not self.chat:
            return [self.tokenizer(prompt)["input_ids"] for prompt in prompts]
        system = [{"role": "system", "content": self.inputs.system_prompt}] if self.inputs.system_prompt is not None else []
        texts = [
            self.tokenizer.apply_chat_template(system + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]

    @torch.no_grad()
    def complete(self, prompt_ids: list[list[int]], batch_size: int = 1, **generation: object) -> list[list[int]]:
        """The new token ids for each prompt, up to the first end token (end-of-turn for a chat model, else EOS).

        ``batch_size`` prompts a call, longest first (little padding; an OOM comes first), left-padded; results in
        ``prompt_ids`` order; ``generation`` goes to ``model.generate``. Prompt plus new tokens never pass the model's
        positions: with a warning, ``max_new_tokens`` is capped at ``positions - 1`` and a long prompt loses its start."""
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
        pad = pad_token_id(self.tokenizer)
        was_training = self.model.training
        self.model.eval()
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: prompts per generate call, at least 1")
        kept = []
        for ids in prompt_ids:
            if room is not None and len(ids) > room:
                rank_zero_warn(
                    f"a prompt of {len(ids)} tokens leaves no room for {new_tokens} new ones in the model's "
                    f"{limit} positions: its first {len(ids) - room} tokens are dropped"
                )
                ids = ids[-room:]
            kept.append(ids)
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

    def generate_text(self, prompts: list[str], batch_size: int = 1, **generation: object) -> list[str]:
        """Complete each prompt (:meth:`prompt_ids`, :meth:`complete`); return only the new text."""
        completions = self.complete(self.prompt_ids(prompts), batch_size=batch_size, **generation)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)
