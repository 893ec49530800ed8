"""Tokenisation shared by the data modules.

``tokenize_batch`` is a module-level function taking everything as arguments, so
``datasets.Dataset.map`` fingerprints it the same way in every process and a second run
re-uses the cached result (a bound method or a lambda would hash differently per run).
"""

from __future__ import annotations

import logging
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .loading import DataError

log = logging.getLogger(__name__)


def disable_tokenizer_parallelism() -> None:
    """Set ``TOKENIZERS_PARALLELISM=false`` unless the user set it.

    The Rust tokenizer's thread pool does not survive ``fork``: once used in the main process,
    forked DataLoader workers print a warning and may deadlock.  Set before any worker forks,
    and only then: the one-time tokenisation in ``setup`` keeps the thread pool (all cores).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a fast (Rust) tokenizer from a hub name or local folder.

    Raises:
        ValueError: the tokenizer is not a fast tokenizer (batched tokenisation would be slow).
    """
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not tokenizer.is_fast:
        raise ValueError(f"model.tokenizer={name_or_path!r} has no fast tokenizer; fix: use one with a tokenizer.json")
    return tokenizer


def use_eos_as_pad(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a tokenizer without a pad token its EOS token as pad (GPT-2, Llama and SmolLM2 ship
    none), in place: the collator pads with it, the classifier's ``config.pad_token_id`` is set
    from it (:func:`..models.builder.build_sequence_classifier`), and the checkpoint stores the
    tokenizer with it.  A tokenizer that has a pad token is left as it is.

    Raises:
        DataError: the tokenizer has neither a pad nor an EOS token.
    """
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise DataError(
            f"model.tokenizer={tokenizer.name_or_path!r} has neither a pad token nor an EOS token to pad batches with; "
            "fix: a tokenizer that has one (every Hub decoder tokenizer has an eos_token), or add one to its "
            'tokenizer_config.json ("pad_token": ...)'
        )
    tokenizer.pad_token = tokenizer.eos_token
    log.info("model.tokenizer has no pad token: padding with its EOS token %r (id %d)", tokenizer.eos_token, tokenizer.eos_token_id)


def tokenize_batch(
    batch: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    text_pair_column: str | None,
    max_length: int,
) -> dict[str, list[list[int]]]:
    """Tokenise a batch of texts (or text pairs), truncated to ``max_length`` tokens, unpadded.

    Padding happens per micro-batch in the collator (dynamic padding), so short batches stay short.
    A longer text keeps its first ``max_length`` tokens (the end is cut; for pairs, the longer of
    the two texts is cut first: ``truncation=True`` is the tokenizer's ``longest_first``).
    Null texts are tokenised as empty strings (training drops such rows before; predict keeps
    every row so its output lines up with its input).

    Returns:
        ``input_ids``, ``attention_mask`` (and ``token_type_ids`` for BERT-style models):
        one list of token ids per row, each at most ``max_length`` long.
    """

    def text(values: list) -> list[str]:
        return ["" if value is None else str(value) for value in values]  # predict keeps null rows: "" in, a row out

    pairs = text(batch[text_pair_column]) if text_pair_column else None
    return tokenizer(text(batch[text_column]), pairs, truncation=True, max_length=max_length)
