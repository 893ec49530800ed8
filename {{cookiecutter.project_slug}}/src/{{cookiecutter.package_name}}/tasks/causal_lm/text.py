"""Plain-text data for causal language models: load, tokenise once, pack or pad, batch.

Two ways to turn documents into training sequences (``mode``):

- ``pack`` (the default for pretraining): every document is tokenised, an EOS token is
  appended, the token streams are concatenated and cut into blocks of exactly ``max_length``
  tokens (only the split's last block may be shorter, and is padded).  Almost no padding;
  a block may span two documents (the model attends across the EOS, as in GPT-2/Llama
  pretraining).
- ``pad``: one sequence per document, truncated to ``max_length`` tokens, padded per micro-batch
  to the longest one (rounded up to ``pad_to_multiple_of``); with ``group_by_length`` batches hold
  documents of similar length.  For instruction data, where a row must stay whole.

Labels are the input ids, with -100 (ignored by the loss) wherever the attention mask is 0.
They are masked from the attention mask, never from the pad id: tokenizers without a pad token
(GPT-2, Llama, SmolLM2) pad with their EOS id, and a label mask built from the pad id would
silently stop the model from learning to end a document.
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
    """Tokenise documents and end each with ``eos_token_id``.

    The tokenizer's own special tokens are kept (e.g. Llama's BOS); an EOS is appended unless
    the tokenizer already ended the document with one.  Returns ``input_ids`` and ``length``
    (tokens per row, kept as a column so counts and length grouping never read the ids).

    A document longer than :func:`...core.data.tokenization.piece_chars` is never given to the tokenizer whole
    (the module docstring of :mod:`...core.data.tokenization`): with ``max_length`` (``pad`` mode, which keeps
    that many) it is cut to the pieces that hold them (:func:`...core.data.tokenization.cut_for_tokens`); without
    (``pack``, every token kept) it is tokenised piece by piece when ``in_pieces`` (the tokenizer
    :func:`...core.data.tokenization.splits_at_whitespace`), else whole.
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
    """Concatenate the token lists of all rows, in order, and cut the one stream into blocks of
    ``block_size``: every token is kept exactly once, every block holds exactly ``block_size``
    tokens but the split's last one, which may be shorter.

    The blocks are cut from the whole split, not per map batch: a ``map`` over the blocks'
    start offsets gathers each batch of blocks from the rows their offsets fall in (found from
    the ``length`` column), so memory stays one map batch of blocks however large the corpus.

    Args:
        tokenized: rows with ``input_ids`` (token lists) and ``length`` (their lengths).
        batch_size: blocks per map batch.

    Returns:
        a data set of ``input_ids`` (the blocks) and ``length`` (their token counts).
    """
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
    """Pad a list of ``{"input_ids": [...]}`` rows into a batch for next-token prediction.

    Returns ``input_ids``, ``attention_mask`` and ``labels``, each ``(B, T)`` int64, where ``T``
    is the longest row rounded up to a multiple of ``pad_to_multiple_of``.  Padding goes on the
    right with ``pad_token_id``; ``labels`` equal ``input_ids`` where ``attention_mask`` is 1 and
    are -100 elsewhere.  The model shifts them by one (position ``t`` predicts ``labels[t+1]``).
    """

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
    """Causal-LM batches from local text (.txt files or folders of them), jsonl/parquet/csv
    with a text column, or a hub data set.

    Each batch is a dict of ``input_ids``, ``attention_mask`` and ``labels``, each
    ``(micro_batch, T)`` with ``T <= max_length`` (rounded up to ``pad_to_multiple_of`` in ``pad``
    mode; exactly ``max_length`` for all but the last block in ``pack`` mode).  Every sequence has
    at least two tokens, so every batch has at least one supervised target.

    Args (and the shared ones of :class:`...core.data.batching.TokenizedDataModule`; a split is a
    ``.txt`` file, a folder of them (sorted), a jsonl/json/parquet/csv/tsv file or a hub split):
        sample_by: for ``.txt``: ``document`` (one document per file) or ``paragraph`` (one per
            block of text between blank lines).
        mode: ``pack`` or ``pad`` (see the module docstring); ``max_length`` is the block size when packing.

    Raises (from ``setup``, before any model weights load):
        DataError: missing file or column, a split with no text (empty, or only blank lines),
            a tokenizer without an EOS token.
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
            # Zero bytes in all: datasets' text builder would fail on it. (Whitespace-only text is
            # caught below, by the blank-row filter, without reading a large corpus twice.)
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
