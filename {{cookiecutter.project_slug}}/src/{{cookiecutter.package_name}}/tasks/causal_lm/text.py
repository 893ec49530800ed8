"""Plain-text data for causal LMs: load, tokenise once, pack or pad, batch.

``mode``: ``pack`` (pretraining) ends each document with EOS, concatenates them and cuts blocks of exactly ``max_length`` tokens
(the split's last may be shorter; a block may span documents, as in GPT-2/Llama pretraining); ``pad`` keeps one sequence per
document (rows that must stay whole), truncated to ``max_length``.  Labels are the input ids, -100 where the attention mask is
0, never where the pad id is: tokenizers without a pad token (GPT-2, Llama, SmolLM2) pad with EOS, which the model must learn.
"""

from __future__ import annotations

import glob
import logging
import os

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ...core.data.batching import TokenizedDataModule
from ...core.data.loading import first_non_utf8, load_split, require_column_types, require_columns
from ...core.data.tokenization import (  # noqa: F401 (IGNORE_INDEX, pad_token_id: read from here too)
    IGNORE_INDEX,
    cut_for_tokens,
    load_tokenizer,
    pad_token_id,
    piece_chars,
    special_tokens_around,
    splits_at_whitespace,
    tokenize_in_pieces,
)
from ...core.errors import DataError
from ...core.identity.hashes import content_cache_dir

log = logging.getLogger(__name__)

MODES = ("pack", "pad")
SAMPLE_BY = ("document", "paragraph")


def tokenize_documents(
    batch: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    eos_token_id: int,
    max_length: int | None = None,
    in_pieces: bool = False,
) -> dict[str, list[list[int]]]:
    """Tokenise documents (the tokenizer's special tokens kept) and end each with ``eos_token_id``: ``input_ids``, ``length``.

    A long document never goes to the tokenizer whole (:mod:`...core.data.tokenization`): with ``max_length`` (``pad``) it is cut
    to the pieces that hold that many tokens (:func:`...core.data.tokenization.cut_for_tokens`); without (``pack``) it is tokenised
    piece by piece when ``in_pieces``, else whole.
    """
    size = piece_chars(max_length or 0)
    texts = list(batch[text_column])
    if max_length is not None:
        texts = [cut_for_tokens(text, tokenizer, max_length, size) for text in texts]
    long = {index for index, text in enumerate(texts) if len(text) > size} if in_pieces and max_length is None else set()
    ids = tokenizer(["" if index in long else text for index, text in enumerate(texts)], add_special_tokens=True)["input_ids"]
    if long:
        before, after = special_tokens_around(tokenizer)
        for index in long:
            ids[index] = before + tokenize_in_pieces(texts[index], tokenizer, size) + after
    ids = [row if row and row[-1] == eos_token_id else row + [eos_token_id] for row in ids]
    return {"input_ids": ids, "length": [len(row) for row in ids]}


def pack_documents(tokenized: datasets.Dataset, block_size: int, batch_size: int = 1000, desc: str = "Packing") -> datasets.Dataset:
    """Concatenate all rows' tokens in order and cut blocks of ``block_size`` (the last may be shorter): ``input_ids``, ``length``.
    A ``map`` over block start offsets gathers each batch of ``batch_size`` blocks from the rows they span (found from the
    ``length`` column), so memory stays one batch of blocks however large the corpus."""
    ends = np.cumsum(np.asarray(tokenized["length"], dtype=np.int64))
    total = int(ends[-1]) if len(ends) else 0
    starts = datasets.Dataset.from_dict({"start": list(range(0, total, block_size))})
    kwargs = {"tokenized": tokenized, "ends": ends, "block_size": block_size}
    return starts.map(_gather_blocks, batched=True, batch_size=batch_size, fn_kwargs=kwargs, remove_columns=["start"], desc=desc)


def _gather_blocks(batch: dict[str, list], tokenized: datasets.Dataset, ends: np.ndarray, block_size: int) -> dict[str, list]:
    """The blocks starting at ``batch["start"]`` (global token offsets), from the rows they span."""
    first_token, last_token = batch["start"][0], min(batch["start"][-1] + block_size, int(ends[-1])) - 1
    first_row = int(np.searchsorted(ends, first_token, side="right"))
    last_row = int(np.searchsorted(ends, last_token, side="right"))
    offset = int(ends[first_row - 1]) if first_row else 0  # global offset of first_row's first token
    stream = [token for row in tokenized.select(range(first_row, last_row + 1))["input_ids"] for token in row]
    blocks = [stream[start - offset : start - offset + block_size] for start in batch["start"]]
    return {"input_ids": blocks, "length": [len(block) for block in blocks]}


def truncate_documents(batch: dict[str, list], max_length: int) -> dict[str, list[list[int]]]:
    """Keep the first ``max_length`` tokens of each document (``pad`` mode)."""
    return {"input_ids": [row[:max_length] for row in batch["input_ids"]], "length": [min(n, max_length) for n in batch["length"]]}


def has_target(row: dict) -> bool:
    """A sequence of one token has nothing to predict (the first token is never a target)."""
    return row["length"] >= 2


def has_text(row: dict, text_column: str) -> bool:
    """False for empty, whitespace-only and missing (null) rows."""
    text = row[text_column]
    return text is not None and bool(str(text).strip())


class CausalLMCollator:
    """Pad ``{"input_ids": [...]}`` rows on the right into ``input_ids``, ``attention_mask`` and ``labels`` ``(B, T)`` int64
    (``T`` rounded up to ``pad_to_multiple_of``; labels -100 on padding, shifted by the model)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for index, row in enumerate(rows):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            input_ids[index, : len(ids)] = ids
            attention_mask[index, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class TextDataModule(TokenizedDataModule):
    """Causal-LM batches from .txt files or folders, jsonl/json/parquet/csv/tsv with a text column, or a hub data set:
    ``input_ids``, ``attention_mask``, ``labels`` ``(micro_batch, T)``, ``T <= max_length``; every sequence has >= 2 tokens.

    Args (the ``data`` group's keys, and :class:`...core.data.batching.TokenizedDataModule`'s):
        sample_by: for ``.txt``: ``document`` (a file) or ``paragraph`` (text between blank lines).
        mode: ``pack`` or ``pad`` (module docstring); ``max_length`` is the block size when packing.

    Raises (from ``setup``, before any weights load):
        DataError: missing file or column, a split with no text, a tokenizer without an EOS token.
    """

    def __init__(self, *, text_column: str, sample_by: str, mode: str, **shared: object) -> None:
        super().__init__(**shared)
        self.text_column, self.sample_by, self.mode = text_column, sample_by, mode
        self.token_counts: dict[str, int] = {}  # real (non-pad) tokens per split, EOS included

    def setup(self, stage: str) -> None:
        """Load, check and tokenise what ``stage`` needs (idempotent; maps are cached on disk)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        pad_token_id(self.tokenizer)  # raises early when the tokenizer has no EOS
        if stage in ("fit", "validate") and "train" not in self.datasets:
            train = self._load("train")
            if "validation" in self.splits:
                validation = self._load("validation")
            else:
                fix = "data.splits.validation=path/to/val.txt, or more documents (or data.sample_by=paragraph to count blank-line blocks as documents)"
                train, validation = self.hold_out_validation(train, "document", fix)
            self.datasets["train"] = self._prepare("train", train)
            self.datasets["validation"] = self._prepare("validation", validation)
        if stage in ("fit", "test") and self.has_test and "test" not in self.datasets:
            self.datasets["test"] = self._prepare("test", self._load("test"))
        if stage == "test" and "test" not in self.datasets:
            raise DataError("data.splits.test is null, so there is no test split to evaluate; fix: data.splits.test=path/to/test.txt")
        if stage in ("fit", "validate"):  # train.py validates before fitting
            self.check_validation_interval()

    def _load(self, split: str) -> datasets.Dataset:
        source = self.splits[split]
        field = f"data.splits.{split}"
        if self.hub_name is None and not os.path.exists(source):
            raise DataError(
                f"{field}={source!r} does not exist; fix: point {field} at a .txt file, a folder of .txt files, "
                "or a jsonl/json/parquet/csv/tsv file"
            )
        if self.hub_name is None and (source.lower().endswith(".txt") or os.path.isdir(source)):
            files = sorted(glob.glob(os.path.join(source, "*.txt"))) if os.path.isdir(source) else [source]
            if not files:
                raise DataError(
                    f"{field}={source!r} is a folder with no .txt files; fix: point it at a folder of .txt files or at one file"
                )
            # All empty: datasets' text builder would fail (whitespace-only text is caught by the blank-row filter below).
            if all(os.path.getsize(f) == 0 for f in files):
                raise DataError(f"{field}={source!r} is empty; fix: give it some text")
            try:
                dataset = datasets.load_dataset(
                    "text",
                    data_files=files,
                    split="train",
                    cache_dir=content_cache_dir(self.cache_dir, files),  # (by content: see core/data/loading.py)
                    sample_by=self.sample_by,
                    keep_linebreaks=True,
                )
            except Exception as error:  # datasets wraps a decoding error in DatasetGenerationError
                bad = first_non_utf8(files)
                if bad is None:
                    raise
                raise DataError(
                    f"{field}={source!r}: {bad} is not UTF-8 text; fix: re-encode it, e.g. iconv -f latin1 -t utf-8 in.txt > out.txt"
                ) from error
            text_column = "text"
        else:
            dataset = load_split(split, source, self.hub_name, self.hub_config, self.cache_dir)
            require_columns(dataset, split, source, {"text_column": self.text_column})
            require_column_types(dataset, split, source, {"text_column": self.text_column}, {})
            text_column = self.text_column
        dataset = dataset.select_columns([text_column])
        if text_column != "text":
            dataset = dataset.rename_column(text_column, "text")
        kept = dataset.filter(has_text, fn_kwargs={"text_column": "text"}, desc=f"Dropping blank rows of {split}")
        if len(kept) == 0:
            raise DataError(
                f"{field}={source!r} has no text: all {len(dataset)} row(s) are empty or whitespace; fix: point it at a file with text"
            )
        if len(kept) < len(dataset):
            log.warning("%s: dropped %d empty or whitespace-only row(s) of %d", field, len(dataset) - len(kept), len(dataset))
        return kept

    def _prepare(self, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
        """Tokenise (EOS after each document), then pack or truncate; drop 1-token sequences."""
        self.split_sizes[split] = len(dataset)
        tokenized = dataset.map(
            tokenize_documents,
            batched=True,
            fn_kwargs={
                "tokenizer": self.tokenizer,
                "text_column": "text",
                "eos_token_id": self.tokenizer.eos_token_id,
                "max_length": None if self.mode == "pack" else self.max_length + 1,  # (+1: truncation is still seen, and warned)
                "in_pieces": self.mode == "pack" and splits_at_whitespace(self.tokenizer),
            },
            remove_columns=dataset.column_names,
            desc=f"Tokenizing {split}",
        )
        if self.mode == "pack":
            sequences = pack_documents(tokenized, self.max_length, desc=f"Packing {split}")
        else:
            sequences = tokenized.map(
                truncate_documents, batched=True, fn_kwargs={"max_length": self.max_length}, desc=f"Truncating {split}"
            )
            truncated = sum(1 for n in tokenized["length"] if n > self.max_length)
            if truncated:
                log.warning(
                    "data.mode=pad: %d of %d %s documents are longer than data.max_length=%d and were truncated",
                    truncated,
                    len(tokenized),
                    split,
                    self.max_length,
                )
        kept = sequences.filter(has_target, desc=f"Dropping 1-token sequences of {split}")
        self.token_counts[split] = sum(kept["length"])  # an int column: the ids are not read
        log.info("%s: %d documents -> %d sequences, %d tokens", split, len(dataset), len(kept), self.token_counts[split])
        return kept

    @property
    def groups_by_length(self) -> bool:
        return self.mode == "pad" and self.group_by_length  # packed blocks all have one length

    def sequence_lengths(self, split: str) -> list[int]:
        return self.datasets[split]["length"]

    def collator(self) -> CausalLMCollator:
        return CausalLMCollator(pad_token_id(self.tokenizer), self.pad_to_multiple_of)
