"""Prompts for GRPO: rows with a ``prompt`` (text, a user turn, or ``{role, content}`` messages ending with a user turn) and
any other fields, which reach the reward functions as read (:mod:`.rewards`). Pair files work too (``chosen``/``rejected``
are then fields the rewards may ignore). Each prompt is rendered with the chat template and its generation prompt as
``generate`` renders one; a prompt that leaves fewer than ``max_completion_length`` of ``max_length`` tokens is refused by
its row (never truncated: the model would answer another question). Batches: ``input_ids``, ``attention_mask`` ``(P, T)``
left-padded, ``row`` ``(P,)`` (index in the split's file) and ``rows`` (each row's fields as read)."""

from __future__ import annotations

import json

import datasets
import torch

from ...core.data.tokenization import IGNORE_INDEX, pad_token_id
from ...core.errors import DataError
from ..causal_lm.chat import chat_prompt_ids, special_token_problem, special_token_texts
from ..preference.data import PreferenceDataModule, side_messages


def tokenize_prompts(
    batch: dict[str, list], indices: list[int], tokenizer, template: str, system_prompt: str | None, room: int, split: str, rule: str = ""
) -> dict[str, list]:
    """A ``datasets`` map: each row's prompt ids (``input_ids``), ``length``, ``row`` and ``fields`` (the row as JSON), and
    the chat rows' bookkeeping columns, for ``inspect_data``: ``labels`` (all -100: a prompt is not trained, its sampled
    completions are), ``n_trained`` and ``n_content`` 0, ``truncated`` 0 (none is cut).

    Raises:
        DataError: no ``prompt``, a prompt not ending with a user turn, one spelling a special token, or longer than ``room``.
    """
    columns, specials = list(batch), special_token_texts(tokenizer)
    out = {key: [] for key in ("input_ids", "labels", "length", "row", "fields", "n_trained", "n_content", "truncated")}
    for offset, index in enumerate(indices):
        row, where = {c: batch[c][offset] for c in columns}, f"data.splits.{split} row {index}"
        if row.get("prompt") is None:
            raise DataError(
                f"{where} has no prompt (columns: {sorted(c for c, v in row.items() if v is not None)}); fix: rows like "
                '{"prompt": ...} (text or {role, content} messages), with any fields your reward functions read'
            )
        messages = side_messages(row["prompt"], where, "prompt")
        if messages[-1]["role"] != "user":
            raise DataError(f"{where}: the prompt ends with a {messages[-1]['role']} turn; fix: end it with the user's turn to answer")
        if system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}] + [turn for turn in messages if turn["role"] != "system"]
        problem = special_token_problem(messages, specials, where)
        if problem:
            raise DataError(problem)
        ids = chat_prompt_ids(tokenizer, template, messages)
        if len(ids) > room:
            raise DataError(
                f"{where}: its prompt is {len(ids)} tokens, and data.max_length - data.max_completion_length leaves {room} for it; "
                "fix: a larger data.max_length, a smaller data.max_completion_length, or a shorter prompt"
            )
        columns_of_row = (("input_ids", ids), ("labels", [IGNORE_INDEX] * len(ids)), ("length", len(ids)), ("row", index))
        for key, value in (*columns_of_row, ("n_trained", 0), ("n_content", 0), ("truncated", 0)):
            out[key].append(value)
        out["fields"].append(json.dumps(row, ensure_ascii=False, default=str))
    return out


class PromptCollator:
    """Left-pad prompts into ``input_ids``/``attention_mask`` ``(P, T)`` (generation appends on the right), with ``row``
    ``(P,)`` and ``rows`` (the fields as read)."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, prompts: list[dict]) -> dict:
        longest = max(len(prompt["input_ids"]) for prompt in prompts)
        ids = [[self.pad] * (longest - len(p["input_ids"])) + p["input_ids"] for p in prompts]
        mask = [[0] * (longest - len(p["input_ids"])) + [1] * len(p["input_ids"]) for p in prompts]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "row": torch.tensor([p["row"] for p in prompts]),
            "rows": [json.loads(p["fields"]) for p in prompts],
        }


class PromptDataModule(PreferenceDataModule):
    """Batches of prompts (module docstring); ``rewards``: ``{name: {weight, function}}`` (:mod:`.rewards`), read by the
    module each step; ``max_completion_length``: tokens sampled per completion at most. Other arguments as
    :class:`..preference.data.PreferenceDataModule` (the judged samples of ``data.judge`` included)."""

    SIDE_PREFIXES = ("",)  # what inspect_data shows of a row: the rendered prompt
    BATCH_ITEM = "prompts"
    RULE = "grpo-prompts-2"
    TOKENIZE = staticmethod(tokenize_prompts)

    def __init__(self, *, rewards: dict, max_completion_length: int, **shared: object) -> None:
        super().__init__(**shared)
        self.rewards, self.max_completion_length = rewards, max_completion_length

    @property
    def task_objects(self) -> dict:
        """Handed to the module (:class:`...core.models.inputs.ConnectData`): the reward functions and the completion length."""
        return {"rewards": self.rewards, "max_completion_length": self.max_completion_length}

    def tokenize_kwargs(self) -> dict:
        return {"room": self.max_length - self.max_completion_length}

    def drops(self, rows: datasets.Dataset) -> dict[str, list[int]]:
        return {}  # a prompt is never dropped: one without room is refused when rendered

    def kept_columns(self) -> list[str]:
        return ["input_ids", "length", "row", "fields"]

    def finish(self, split: str, kept: datasets.Dataset) -> datasets.Dataset:
        return kept

    def count_tokens(self, kept: datasets.Dataset) -> int:
        return sum(kept["length"])

    def collator(self) -> PromptCollator:
        return PromptCollator(pad_token_id(self.tokenizer))
