"""Reward-model data: preference pairs to train on (:class:`..preference.data.PreferenceDataModule`), and for ``predict`` a
file of answers to score: rows ``completion`` and an optional ``prompt`` (text or ``{role, content}`` messages), each rendered
as a pair's side is."""

from __future__ import annotations

import datasets
from torch.utils.data import DataLoader

from ...core.data.loading import load_split
from ...core.data.tokenization import load_tokenizer
from ...core.errors import DataError
from ..causal_lm.chat import ChatCollator
from ..causal_lm.text import pad_token_id
from ..preference.data import PreferenceDataModule, answer_conversation, label_answer


def tokenize_texts(
    batch: dict[str, list], indices: list[int], tokenizer, template: str, system_prompt, eot_id: int, max_length: int
) -> dict:
    """A ``datasets`` map: each row's ``input_ids``, its conversation (``prompt`` if any, then ``completion``) as trained.

    Raises:
        DataError: a row with no ``completion``, or longer than ``max_length`` tokens (its score would be of a truncated text).
    """
    columns, out = list(batch), {"input_ids": []}
    for offset, index in enumerate(indices):
        row, where = {c: batch[c][offset] for c in columns}, f"input row {index}"
        if row.get("completion") is None:
            raise DataError(
                f"{where} has no completion (columns: {sorted(c for c, v in row.items() if v is not None)}); fix: rows like "
                '{"prompt": ..., "completion": ...} (the answer to score, and the prompt it answers)'
            )
        messages = answer_conversation(row, "completion", system_prompt, where)
        ids, _, _, _, cut = label_answer(tokenizer, template, messages, eot_id, max_length, where)
        if cut:
            length = f"{len(ids) + cut} tokens" if cut > 0 else f"more than {max_length} tokens"
            raise DataError(
                f"{where} (rows counted from 0) is {length}, longer than data.max_length={max_length}, so its reward would be of a "
                "truncated text; fix: a larger data.max_length (up to the model's positions), or a shorter row"
            )
        out["input_ids"].append(ids)
    return out


class RewardDataModule(PreferenceDataModule):
    """Pairs as :class:`..preference.data.PreferenceDataModule` (train, validation, test); ``predict_file``: the answers
    ``predict`` scores, one sequence a row in file order (:attr:`predict_rows` holds the rows as read)."""

    def __init__(self, *, predict_file: str | None = None, **shared: object) -> None:
        super().__init__(**shared)
        self.predict_file = predict_file
        self.predict_rows: datasets.Dataset | None = None
        self.text_pairs: bool | None = None  # an encoder's tokenizer: prompt and answer as its text pair, no chat template

    def prepare_tokenizer(self) -> None:
        """As chat data, unless the tokenizer is an encoder's (a separator token, no chat template, none configured): then the
        prompt and the answer are read as its text pair (:func:`..preference.data.label_answer` with no template)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        if self.text_pairs is None:
            self.text_pairs = self.chat_template is None and not self.tokenizer.chat_template and self.tokenizer.sep_token is not None
        if not self.text_pairs:
            super().prepare_tokenizer()

    def setup(self, stage: str) -> None:
        if stage != "predict":
            return super().setup(stage)
        self.prepare_tokenizer()
        if self.predict_file is None:
            raise DataError("no file to score; fix: input=path/to/answers.jsonl (rows: prompt, completion)")
        self.predict_rows = load_split("predict", self.predict_file, None, None, self.cache_dir)
        if "reward" in self.predict_rows.column_names:  # (before any row is scored)
            raise DataError(
                "input has a field 'reward', which predict writes; fix: rename it in the input (its fields are copied as they are)"
            )
        kwargs = {key: getattr(self, key) for key in ("tokenizer", "template", "system_prompt", "eot_id", "max_length")}
        self.datasets["predict"] = self.predict_rows.map(
            tokenize_texts, batched=True, with_indices=True, fn_kwargs=kwargs, remove_columns=self.predict_rows.column_names
        )

    def predict_dataloader(self) -> DataLoader:
        pad = ChatCollator(pad_token_id(self.tokenizer), self.pad_to_multiple_of, packed=False)
        rows = [{"input_ids": ids, "labels": ids} for ids in self.datasets["predict"]["input_ids"]]
        return DataLoader(rows, batch_size=self.batch_size, shuffle=False, collate_fn=pad)
