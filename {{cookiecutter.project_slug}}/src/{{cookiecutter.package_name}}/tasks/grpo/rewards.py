"""Reward functions for GRPO and the checked call that scores completions with them.

A reward function is called once per micro-batch as ``function(prompts=..., completions=..., **columns)`` and returns one
number per completion: ``prompts`` the rows' ``prompt`` values as read (text or messages), repeated for each of a prompt's
completions; ``completions`` the sampled texts (special tokens removed); ``columns`` every other field of the rows, one
list per field (e.g. ``answer``). ``data.rewards`` names them, each ``{weight, function}``; a config is the user's own
code, so ``function`` may be any importable callable (``_partial_: true`` binds its options). The shipped ones here are
made by a call with their options (``{_target_: ...format_reward, pattern: ...}``, no ``_partial_``), so a misspelt
option is refused by the config check.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from ...core.errors import ConfigError, DataError


def score_completions(
    rewards: dict[str, dict], prompts: list, completions: list[str], rows: list[dict], row_numbers: list[int], split: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of every reward ``(N,)`` float32 and each function's own ``{name: (N,)}``, for ``N`` completions and
    their rows (``rows[i]``: the fields of completion ``i``'s row, ``row_numbers[i]``: its index in ``data.splits.<split>``).

    Raises:
        DataError: a function raised, returned other than one number per completion, NaN/inf, a bool or a non-number;
            the message names ``data.rewards.<name>`` and the row (nothing is written: the step has not run).
    """
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"} if rows else {}
    total, each = torch.zeros(len(completions)), {}
    for name, spec in rewards.items():
        values = _checked_call(name, spec["function"], prompts, completions, columns, row_numbers, split)
        each[name] = torch.tensor(values, dtype=torch.float32)
        total += float(spec.get("weight", 1.0)) * each[name]
    return total, each


def _checked_call(name, function: Callable, prompts, completions, columns, row_numbers, split) -> list[float]:
    where = f"data.rewards.{name}"
    try:
        values = function(prompts=prompts, completions=completions, **columns)
    except Exception as error:  # noqa: BLE001  (a user's function: name it, and the first row it fails on)
        for i in range(len(completions)):
            try:
                function(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
            except Exception as row_error:  # noqa: BLE001
                raise DataError(
                    f"{where} raised {type(row_error).__name__}: {row_error} on data.splits.{split} row {row_numbers[i]} (completion "
                    f"{completions[i]!r:.80}); fix: the function, or the row"
                ) from row_error
        raise DataError(
            f"{where} raised {type(error).__name__}: {error} on a batch of {len(completions)} completions; fix: the function"
        ) from error
    if not isinstance(values, list | tuple) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
        raise DataError(
            f"{where} returned {got} for {len(completions)} completions (rows from data.splits.{split} row {row_numbers[0]}); "
            "fix: return a list with one float per completion"
        )
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise DataError(
                f"{where} returned {value!r} for data.splits.{split} row {row_numbers[i]} (completion {completions[i]!r:.80}); "
                "fix: a finite float for every completion (0.0 where the reward does not apply)"
            )
    return [float(value) for value in values]


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """A reward function: 1.0 for a completion that ``re.fullmatch``-es ``pattern`` (``re.DOTALL``: ``.`` spans lines), else 0.0.

    Raises:
        ConfigError: ``pattern`` is not a regular expression.
    """
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise ConfigError(f"format_reward pattern={pattern!r} is not a regular expression ({error}); fix: the pattern") from error

    def reward(prompts: list, completions: list[str], **columns: list) -> list[float]:
        return [1.0 if compiled.fullmatch(text.strip()) else 0.0 for text in completions]

    return reward


def exact_answer(extract: str | None = None) -> Callable[..., list[float]]:
    r"""A reward function: 1.0 where the completion's answer equals the row's ``answer`` field as text (both stripped),
    else 0.0; the completion's answer is the whole completion, or with ``extract`` (a regex with one group) its last
    match's group, e.g. ``"#### (.+)"`` (GSM8K) or ``r"\\boxed\{(.+?)\}"``. Called on rows without ``answer``, it raises
    DataError (named with the row by :func:`score_completions`).

    Raises:
        ConfigError: ``extract`` is not a regular expression with one group.
    """
    try:
        compiled = re.compile(extract) if extract is not None else None
    except re.error as error:
        raise ConfigError(f"exact_answer extract={extract!r} is not a regular expression ({error}); fix: the pattern") from error
    if compiled is not None and compiled.groups != 1:
        raise ConfigError(
            f"exact_answer extract={extract!r} has {compiled.groups} groups; fix: one group around the answer, e.g. '#### (\\S+)'"
        )

    def reward(prompts: list, completions: list[str], answer: list | None = None, **columns: list) -> list[float]:
        if answer is None:
            raise DataError(
                f"exact_answer needs an 'answer' field in each row (the rows have {sorted(columns)}); fix: add it, or another reward"
            )
        found = []
        for text in completions:
            matches = compiled.findall(text) if compiled is not None else [text]
            found.append(matches[-1].strip() if matches else None)
        return [1.0 if got is not None and got == str(want).strip() else 0.0 for got, want in zip(found, answer, strict=True)]

    return reward


def vader_sentiment() -> Callable[..., list[float]]:
    """A reward function: VADER's compound sentiment of each completion, in [-1, 1]
    (:func:`...core.assets.vader.sentiment_scores`)."""
    from ...core.assets.vader import sentiment_scores

    def reward(prompts: list, completions: list[str], **columns: list) -> list[float]:
        return [score["vader_compound"] for score in sentiment_scores(completions)]

    return reward


class RewardModelScore:
    """A trained reward model (a ``task=reward`` checkpoint, :mod:`..reward`) as a reward function: each completion's reward
    under it, the prompt and the completion rendered as that model was trained (the checkpoint's tokenizer and chat
    template, its run's ``data.system_prompt``, ``data.end_of_turn`` and ``data.max_length``), as ``predict`` scores them.
    Loaded once, as ``predict`` loads a checkpoint (nothing it names is instantiated); on the GPU when there is one.

    Raises (when called): DataError: a prompt and completion longer than the reward model's ``data.max_length``.
    """

    def __init__(self, ckpt_path: str, batch_size: int = 16) -> None:
        from omegaconf import OmegaConf

        from ...core.checkpoints.io import load_trained_module
        from ..causal_lm.chat import end_of_turn_id
        from ..reward.module import RewardModule

        self.module = load_trained_module(RewardModule, OmegaConf.create({"model": {}}), ckpt_path).eval()
        if torch.cuda.is_available():
            self.module.cuda()
        data = (getattr(self.module, "trained_config", None) or {}).get("data") or {}
        tokenizer = self.module.tokenizer
        text_pairs = not tokenizer.chat_template and tokenizer.sep_token is not None  # an encoder's (tasks/reward/data.py)
        self.render = {
            "tokenizer": tokenizer,
            "template": None if text_pairs else tokenizer.chat_template,
            "system_prompt": data.get("system_prompt"),
            "eot_id": None if text_pairs else end_of_turn_id(tokenizer, data.get("end_of_turn")),
            "max_length": data.get("max_length"),
        }
        self.batch_size = batch_size

    def __call__(self, prompts: list, completions: list[str], **columns: list) -> list[float]:
        from ..causal_lm.chat import ChatCollator
        from ..causal_lm.text import pad_token_id
        from ..reward.data import tokenize_texts

        rows = {"prompt": list(prompts), "completion": list(completions)}
        ids = tokenize_texts(rows, list(range(len(completions))), **self.render)["input_ids"]
        pad = ChatCollator(pad_token_id(self.render["tokenizer"]), None, packed=False)
        rewards = []
        with torch.inference_mode():
            for start in range(0, len(ids), self.batch_size):
                batch = pad([{"input_ids": row, "labels": row} for row in ids[start : start + self.batch_size]])
                inputs = {key: batch[key].to(self.module.device) for key in ("input_ids", "attention_mask")}
                rewards += self.module(inputs).float().tolist()  # (b,)
        return rewards


def reward_model_bytes(ckpt_path: str) -> int:
    """Bytes of a ``task=reward`` checkpoint's model as :class:`RewardModelScore` loads it: every parameter in fp32 (a QLoRA
    model's 4-bit base too: an upper bound), counted on a meta-device copy of the architecture the checkpoint stores, plus
    its stored LoRA tensors; nothing loaded.

    Raises:
        ConfigError: not a readable checkpoint of ``train`` (:func:`...core.checkpoints.io.trained_checkpoint`).
    """
    from transformers import AutoConfig

    from ...core.checkpoints.io import trained_checkpoint
    from ..reward.module import RewardModule

    checkpoint = trained_checkpoint(ckpt_path)
    fields = dict(checkpoint["hyper_parameters"]["hf_config"])
    with torch.device("meta"):
        model = RewardModule.AUTO_CLASS.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    adapters = sum(tensor.numel() for key, tensor in checkpoint["state_dict"].items() if "lora_" in key)
    return 4 * (sum(parameter.numel() for parameter in model.parameters()) + adapters)
