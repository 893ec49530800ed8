"""Preference pairs: a prompt, a chosen and a rejected completion, rendered as chat SFT renders a conversation.

Rows: ``prompt``, ``chosen``, ``rejected``, each text (a user turn / an assistant answer) or ``{role, content}`` messages;
``chosen``/``rejected`` may hold the whole conversation without ``prompt`` (the "implicit prompt" format).  Each side,
``prompt + side``, is labelled as chat SFT with ``train_on=last_assistant`` (:func:`..causal_lm.chat.label_conversation`).
Refused, naming the row: a missing column, an empty side, ``chosen == rejected``, different prompts, a malformed turn.
Dropped and counted, by row: a pair with a side left with no scored token, and one whose sides are the same once truncated
(the answers differ only past ``max_length``: it always ties and trains nothing); sides keep their first ``max_length`` tokens.
Batches hold whole pairs: ``input_ids``, ``labels``, ``attention_mask``, ``token_mask`` ``(2P, T)``, chosen sides first, and
``pair`` ``(P,)`` (index in the split) and ``pair_fingerprint`` ``(P,)`` (:func:`pair_fingerprint`), for :mod:`.reference_logps`.

KTO's unpaired answers (:class:`UnpairedDataModule`): rows ``prompt``, ``completion``, ``label`` (or pairs, unpaired on load),
each answer labelled as a side is; a batch is its answers and then their mismatched answers (:func:`mismatched_answers`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable

import datasets
import jinja2
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ...core.data.loading import read_prompt_file
from ...core.errors import ConfigError, DataError, TemplateError
from ..causal_lm.chat import (
    GENERATION_MARKER,
    ChatCollator,
    ChatDataModule,
    conversation,
    label_conversation,
    special_token_problem,
    special_token_texts,
)
from ..causal_lm.text import IGNORE_INDEX

log = logging.getLogger(__name__)

SIDES = ("chosen", "rejected")
# The labelling rule, in the tokenised cache's key (as chat.LABEL_RULE).
PAIR_RULE = "pairs-last-assistant-2"


def side_messages(value: object, where: str, column: str) -> list[dict]:
    """One side (or the prompt) as messages: text is one turn (assistant, or user for the prompt); a list is checked as chat rows.

    Raises:
        DataError: missing, empty, or neither text nor a list of ``{role, content}`` turns.
    """
    role = "user" if column == "prompt" else "assistant"
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {column} is empty; fix: give the row a {column}, or drop the row")
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        messages, _ = conversation({"messages": value}, None, f"{where} ({column})")
        if not any(turn["content"].strip() for turn in messages):
            raise DataError(f"{where}: {column} is empty; fix: give the row a {column}, or drop the row")
        return messages
    raise DataError(
        f"{where}: {column} must be text or a non-empty list of {{role, content}} messages, got {value!r:.80}; "
        f"fix: the row's {column}, or drop the row"
    )


def answer_conversation(row: dict, column: str, system_prompt: str | None, where: str) -> list[dict]:
    """The row's prompt turns (``prompt``, if any) and then its ``column`` answer, with ``system_prompt`` set when given.

    Raises:
        DataError: the conversation does not end with an assistant answer; see :func:`side_messages`.
    """
    prompt = side_messages(row["prompt"], where, "prompt") if row.get("prompt") is not None else []
    messages = prompt + side_messages(row[column], where, column)
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: {column} does not end with an assistant answer; fix: end it with the assistant turn")
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [turn for turn in messages if turn["role"] != "system"]
    return messages


def pair_conversations(row: dict, system_prompt: str | None, where: str) -> tuple[list[dict], list[dict]]:
    """The chosen and the rejected conversations of a row (prompt turns, then the answer).

    Raises:
        DataError: a missing column, identical answers, different prompts, no final assistant answer; see :func:`side_messages`.
    """
    missing = [column for column in SIDES if row.get(column) is None]
    sides_are_text = all(isinstance(row.get(column), str) for column in SIDES)
    if not missing and sides_are_text and row.get("prompt") is None:
        missing = ["prompt"]
    if missing:
        raise DataError(
            f"{where} has no {' or '.join(missing)} (columns: {sorted(c for c, v in row.items() if v is not None)}); "
            'fix: rows like {"prompt": ..., "chosen": ..., "rejected": ...} (text, or lists of {role, content} messages)'
        )
    chosen, rejected = (answer_conversation(row, column, system_prompt, where) for column in SIDES)
    if chosen[:-1] != rejected[:-1]:
        turn = next(i for i, (a, b) in enumerate(zip(chosen[:-1] + [None], rejected[:-1] + [None], strict=False)) if a != b)
        raise DataError(
            f"{where}: chosen and rejected have different prompts (they differ at turn {turn}), so the pair does not compare two "
            "answers to one prompt; fix: the same turns before the answer on both sides (or a prompt column and one answer each)"
        )
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise DataError(f"{where}: chosen and rejected are the same answer, so the pair prefers nothing; fix: drop the row, or correct it")
    return chosen, rejected


def tokenize_pairs(
    batch: dict[str, list],
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    system_prompt: str | None,
    eot_id: int,
    max_length: int,
    split: str,
    rule: str = "",
) -> dict[str, list]:
    """Render, tokenise and label a batch of pairs (a ``datasets`` map; ``rule``: :data:`PAIR_RULE`, for the cache key).

    Returns per pair each side's ``input_ids``, ``labels``, ``n_trained`` (``chosen_``/``rejected_``), and for the pair, as chat
    rows report them, ``length``, ``n_trained``, ``n_content``, ``truncated`` (each its worse side's), ``row``, and ``tied``
    (both sides the same tokens once truncated: the answers differ only past ``max_length``).

    Raises:
        DataError: see :func:`pair_conversations`; a turn spelling a special token.
        TemplateError: as chat SFT.
    """
    columns = list(batch)
    out = {f"{side}_{key}": [] for side in SIDES for key in ("input_ids", "labels", "n_trained")}
    out.update({"length": [], "n_trained": [], "n_content": [], "truncated": [], "row": [], "tied": []})
    for offset, index in enumerate(indices):
        where = f"data.splits.{split} row {index}"
        pair = pair_conversations({c: batch[c][offset] for c in columns}, system_prompt, where)
        lengths, trained, content, cut = [], [], [], []
        for side, messages in zip(SIDES, pair, strict=True):
            ids, labels, n_trained, n_content, side_cut = label_answer(
                tokenizer, template, messages, eot_id, max_length, f"{where} ({side})"
            )
            out[f"{side}_input_ids"].append(ids)
            out[f"{side}_labels"].append(labels)
            out[f"{side}_n_trained"].append(n_trained)
            lengths.append(len(ids))
            trained.append(n_trained)
            content.append(n_content)
            cut.append(side_cut)
        out["length"].append(max(lengths))
        out["n_trained"].append(min(trained))
        out["n_content"].append(min(content))
        out["truncated"].append(-1 if -1 in cut else max(cut))
        out["row"].append(index)
        out["tied"].append(all(out[f"chosen_{key}"][-1] == out[f"rejected_{key}"][-1] for key in ("input_ids", "labels")))
    return out


def label_answer(
    tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict], eot_id: int, max_length: int, where: str
) -> tuple[list[int], list[int], int, int, int]:
    """One conversation labelled as chat SFT's ``train_on=last_assistant``, its first ``max_length`` tokens: ``(input_ids,
    labels, n_trained, n_content, truncated)`` (``n_content``: trained tokens other than the end of turn; ``truncated``: tokens
    cut, -1 for a long row cut before tokenising it whole).  ``template=None`` (an encoder reward model's): the turns before
    the answer and the answer as the tokenizer's own text pair (``[CLS] prompt [SEP] answer [SEP]``), every token labelled.

    Raises:
        DataError: a turn spelling a special token.
        TemplateError: the template failed on the row, or its answer spans cannot be found.
    """
    problem = special_token_problem(messages, special_token_texts(tokenizer), where)
    if problem:
        raise DataError(problem)
    if template is None:
        texts = ["\n".join(turn["content"] for turn in messages[:-1]), messages[-1]["content"]]
        texts = texts if texts[0] else texts[1:]
        whole = len(tokenizer(*texts)["input_ids"])
        ids = tokenizer(*texts, truncation=True, max_length=max_length)["input_ids"]
        return ids, list(ids), len(ids) - 1, len(ids) - 1, whole - len(ids)
    use_markers = bool(GENERATION_MARKER.search(template))
    try:
        ids, labels, long = label_conversation(
            tokenizer, template, messages, "last_assistant", eot_id, use_markers, where, (max_length, "right")
        )
    except jinja2.TemplateError as error:
        raise TemplateError(f"{where}: the chat template failed on this row: {type(error).__name__}: {error}") from error
    except TemplateError as error:
        raise TemplateError(f"{where}: {error}") from error
    cut = -1 if long and len(ids) > max_length else max(0, len(ids) - max_length)
    ids, labels = ids[:max_length], labels[:max_length]
    n_trained = sum(label != IGNORE_INDEX for label in labels[1:])  # position 0 is never a target
    return ids, labels, n_trained, sum(label not in (IGNORE_INDEX, eot_id) for label in labels[1:]), cut


def pair_fingerprint(pair: dict, prefixes: tuple[str, ...] = ("chosen_", "rejected_")) -> int:
    """CRC-32 of a tokenised pair's ids and labels (each side's, ``prefixes`` of its columns): a reference table computed for
    other pairs is refused (:meth:`.module.PreferenceModule.reference_logps`)."""
    checksum = 0
    for prefix in prefixes:
        for key in ("input_ids", "labels"):
            checksum = zlib.crc32(np.asarray(pair[f"{prefix}{key}"], dtype=np.int64).tobytes() + b"|", checksum)
    return checksum


class PairCollator:
    """Pad pairs into ``2P`` sequences with :class:`..causal_lm.chat.ChatCollator` (the ``prefixes[0]`` sides first: chosen,
    or KTO's answers before their mismatched ones), plus ``pair`` and ``pair_fingerprint`` ``(P,)``, and KTO's ``desirable``."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None, prefixes: tuple[str, ...] = ("chosen_", "rejected_")) -> None:
        self.pad = ChatCollator(pad_token_id, pad_to_multiple_of, packed=False)
        self.prefixes = prefixes

    def __call__(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        sides = [{"input_ids": pair[f"{p}input_ids"], "labels": pair[f"{p}labels"]} for p in self.prefixes for pair in pairs]
        batch = self.pad(sides)  # (2P, T) each, first side first
        for key in ("pair", "pair_fingerprint", "desirable"):
            if key in pairs[0]:
                batch[key] = torch.as_tensor([pair[key] for pair in pairs], dtype=torch.bool if key == "desirable" else torch.long)
        return batch


class PreferenceDataModule(ChatDataModule):
    """Batches of preference pairs (module docstring), loaded as :class:`..causal_lm.chat.ChatDataModule` loads chat rows.

    Args: as chat data, without ``train_on``, ``truncation``, ``mode`` and the exact-match answers (fixed for pairs); and, for
    judging samples (:meth:`.Preference.after_test`):
        sample_prompts: a prompt file (a .txt file, a prompt a line, or .jsonl ``{"prompt": text}`` rows), or ``None``.
        sample_seed: one seed before and after tuning (the same random stream); ``sample_batch_size``: samples generated at once.
        judge: scores texts, one ``{metric: value}`` each (e.g. :func:`...core.assets.vader.sentiment_scores`); ``None``: no samples.

    Raises (from ``setup``, before any weights load): as chat data, and the pair refusals above.
    """

    SIDE_PREFIXES = ("chosen_", "rejected_")  # what inspect_data shows of a row: each side
    BATCH_ITEM = "pairs"
    TOKENIZE = staticmethod(tokenize_pairs)  # a batch of file rows -> tokenised rows (a datasets map)
    RULE = PAIR_RULE

    def __init__(
        self,
        *,
        sample_prompts: str | None = None,
        samples_per_prompt: int = 4,
        sample_max_new_tokens: int = 48,
        sample_temperature: float = 1.0,
        sample_seed: int = 0,
        sample_batch_size: int = 128,
        judge: Callable[[list[str]], list[dict[str, float]]] | None = None,
        **shared: object,
    ) -> None:
        self.sample_prompts, self.samples_per_prompt = sample_prompts, samples_per_prompt
        self.sample_max_new_tokens, self.sample_temperature, self.sample_seed = sample_max_new_tokens, sample_temperature, sample_seed
        self.judge, self.sample_batch_size = judge, sample_batch_size
        fixed = {"train_on": "last_assistant", "truncation": "right", "mode": "pad", "answer_rows": 0, "answer_max_new_tokens": 0}
        if set(fixed) & set(shared):
            raise ConfigError(f"data.{sorted(set(fixed) & set(shared))[0]} is fixed for preference pairs ({fixed}); fix: drop it")
        super().__init__(**fixed, **shared)

    def tokenize_kwargs(self) -> dict:
        """What :attr:`TOKENIZE` takes beyond the tokenizer, template, system prompt, split and rule."""
        return {"eot_id": self.eot_id, "max_length": self.max_length}

    def tokenized(self, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
        kwargs = {
            "tokenizer": self.tokenizer,
            "template": self.template,
            "system_prompt": self.system_prompt,
            "split": split,
            "rule": self.RULE,
        }
        kwargs.update(self.tokenize_kwargs())
        return dataset.map(
            self.TOKENIZE,
            batched=True,
            with_indices=True,
            fn_kwargs=kwargs,
            remove_columns=dataset.column_names,
            desc=f"Rendering {split} {self.BATCH_ITEM}",
        )

    def drops(self, rows: datasets.Dataset) -> dict[str, list[int]]:
        """Chat data's, and pairs whose sides are the same once truncated to ``max_length`` (``tied``)."""
        reason = (
            f"whose chosen and rejected sides are the same once truncated to data.max_length={self.max_length} (the answers "
            "differ only past it: the pair always ties and trains nothing); fix: a larger data.max_length"
        )
        untrained = super().drops(rows)
        gone = {index for at in untrained.values() for index in at}
        return {**untrained, reason: [index for index, tied in enumerate(rows["tied"]) if tied and index not in gone]}

    def kept_columns(self) -> list[str]:
        return [f"{side}_{key}" for side in SIDES for key in ("input_ids", "labels")] + ["length"]

    def finish(self, split: str, kept: datasets.Dataset) -> datasets.Dataset:
        """Number (``pair``: the reference tables' index) and checksum (:func:`pair_fingerprint`) the kept pairs, once."""
        kept = kept.add_column("pair", list(range(len(kept))))
        return kept.add_column("pair_fingerprint", [pair_fingerprint(pair) for pair in kept])

    def count_tokens(self, kept: datasets.Dataset) -> int:
        return sum(len(ids) for side in SIDES for ids in kept[f"{side}_input_ids"])

    def pair_fingerprints(self, split: str) -> torch.Tensor:
        """``(pairs,)`` int64: :func:`pair_fingerprint` of each prepared pair of ``split``, in order."""
        return torch.as_tensor(self.datasets[split]["pair_fingerprint"], dtype=torch.long)

    def collator(self) -> PairCollator:
        from ..causal_lm.text import pad_token_id

        return PairCollator(pad_token_id(self.tokenizer), self.pad_to_multiple_of)

    def sample_prompt_texts(self) -> list[str]:
        """The instructions of :attr:`sample_prompts`, in file order (:func:`...core.data.loading.read_prompt_file`).

        Raises:
            DataError: a missing, empty or malformed file (by line).
        """
        return read_prompt_file("data.sample_prompts", self.sample_prompts)


def labelled_answers(row: dict, system_prompt: str | None, where: str) -> list[tuple[list[dict], bool]]:
    """A row of unpaired answers as ``[(conversation, desirable)]``: ``prompt``, ``completion`` and a boolean ``label`` (one
    answer), or a pair's ``prompt``, ``chosen``, ``rejected`` (two: the chosen desirable, the rejected not).

    Raises:
        DataError: neither form, a ``label`` that is not true or false, an answer not ending with an assistant turn; see
            :func:`pair_conversations`.
    """
    both = [column for column in SIDES if row.get(column) is not None]
    if row.get("completion") is not None and both:
        raise DataError(
            f"{where} has a completion and {' and '.join(both)}, so it is neither one answer nor a pair; fix: one form per row "
            '({"prompt", "completion", "label"} or {"prompt", "chosen", "rejected"})'
        )
    if row.get("completion") is None:
        if not both:
            raise DataError(
                f"{where} has no completion (columns: {sorted(c for c, v in row.items() if v is not None)}); fix: rows like "
                '{"prompt": ..., "completion": ..., "label": true} (or a pair\'s prompt, chosen, rejected: unpaired on load)'
            )
        chosen, rejected = pair_conversations(row, system_prompt, where)
        return [(chosen, True), (rejected, False)]
    label = row.get("label")
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: label={label!r} must be true (a desirable answer) or false (an undesirable one); fix: the row's label "
            "as a JSON boolean (csv: True/False)"
        )
    return [(answer_conversation(row, "completion", system_prompt, where), label)]


def tokenize_answers(
    batch: dict[str, list],
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    system_prompt: str | None,
    eot_id: int,
    max_length: int,
    split: str,
    rule: str = "",
) -> dict[str, list]:
    """Render, tokenise and label a batch of unpaired rows (a ``datasets`` map; a pair's row gives two answers): per answer
    ``input_ids``, ``labels``, ``desirable``, and as chat rows report them ``length``, ``n_trained``, ``n_content``,
    ``truncated``, ``row`` (the file's row). Raises as :func:`labelled_answers` and :func:`label_answer`."""
    columns = list(batch)
    keys = ("input_ids", "labels", "n_trained", "n_content", "truncated")
    out = {key: [] for key in (*keys, "length", "desirable", "row")}
    for offset, index in enumerate(indices):
        where = f"data.splits.{split} row {index}"
        for messages, desirable in labelled_answers({c: batch[c][offset] for c in columns}, system_prompt, where):
            for key, value in zip(keys, label_answer(tokenizer, template, messages, eot_id, max_length, where), strict=True):
                out[key].append(value)
            out["length"].append(len(out["input_ids"][-1]))
            out["desirable"].append(desirable)
            out["row"].append(index)
    return out


def mismatched_answers(input_ids: list[list[int]], labels: list[list[int]], max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """KTO's mismatched answers, one per answer ``i``: its own prompt (the tokens before its first scored one) followed by the
    answer of the next row whose prompt differs (wrapping round; the next row if every prompt is the same), labelled as that
    answer, its first ``max_length`` tokens. Fixed per split, so a full fine-tune's reference log-probs of them are a table."""
    starts = [next((t for t, label in enumerate(row) if label != IGNORE_INDEX), len(row)) for row in labels]
    prompts = [ids[:start] for ids, start in zip(input_ids, starts, strict=True)]
    n = len(input_ids)
    # differs[k], k < 2n (the rows twice round): the first index after k whose prompt differs from row k % n's (None: none).
    differs: list[int | None] = [None] * (2 * n)
    for k in range(2 * n - 2, -1, -1):
        differs[k] = k + 1 if prompts[(k + 1) % n] != prompts[k % n] else differs[k + 1]
    kl_ids, kl_labels = [], []
    for i in range(n):
        j = differs[i] % n if differs[i] is not None and differs[i] - i < n else (i + 1) % n
        kl_ids.append((prompts[i] + input_ids[j][starts[j] :])[:max_length])
        kl_labels.append(([IGNORE_INDEX] * starts[i] + labels[j][starts[j] :])[:max_length])
    return kl_ids, kl_labels


class UnpairedDataModule(PreferenceDataModule):
    """Batches of unpaired answers for KTO (``objective=kto``, configs/data/unpaired.yaml): rows ``prompt``, ``completion``,
    ``label`` (true: desirable), or pairs (``prompt``, ``chosen``, ``rejected``) unpaired on load into a desirable and an
    undesirable answer. A batch of ``P`` answers is ``2P`` sequences: the answers, then each one's mismatched answer
    (:func:`mismatched_answers`, for the KL estimate), with ``desirable`` ``(P,)``, ``pair`` and ``pair_fingerprint``.
    Dropped and counted: an answer left with no scored token. Arguments as :class:`PreferenceDataModule`."""

    SIDE_PREFIXES = ("",)
    BATCH_ITEM = "answers"
    TOKENIZE = staticmethod(tokenize_answers)
    RULE = "answers-last-assistant-1"
    PREFIXES = ("", "kl_")

    def drops(self, rows: datasets.Dataset) -> dict[str, list[int]]:
        return ChatDataModule.drops(self, rows)

    def kept_columns(self) -> list[str]:
        return ["input_ids", "labels", "length", "desirable"]

    def finish(self, split: str, kept: datasets.Dataset) -> datasets.Dataset:
        """Each answer's mismatched answer (``kl_input_ids``, ``kl_labels``), number (``pair``) and checksum."""
        desirable = sum(kept["desirable"])
        log.info("%s: %d desirable and %d undesirable answers", split, desirable, len(kept) - desirable)
        kl_ids, kl_labels = mismatched_answers(kept["input_ids"], kept["labels"], self.max_length)
        kept = kept.add_column("kl_input_ids", kl_ids).add_column("kl_labels", kl_labels)
        kept = kept.add_column("pair", list(range(len(kept))))
        return kept.add_column("pair_fingerprint", [pair_fingerprint(row, self.PREFIXES) for row in kept])

    def count_tokens(self, kept: datasets.Dataset) -> int:
        return sum(kept["length"])

    def collator(self) -> PairCollator:
        from ..causal_lm.text import pad_token_id

        return PairCollator(pad_token_id(self.tokenizer), self.pad_to_multiple_of, self.PREFIXES)
