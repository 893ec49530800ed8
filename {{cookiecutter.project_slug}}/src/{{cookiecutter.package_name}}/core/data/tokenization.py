"""Tokenisation shared by the data modules.

``tokenize_batch`` is a module-level function taking everything as arguments, so
``datasets.Dataset.map`` fingerprints it the same way in every process and a second run
re-uses the cached result (a bound method or a lambda would hash differently per run).

**Bounded memory for long texts.**  A fast tokenizer keeps offsets, word ids and alignments for
every character it is given (about 140 bytes a character: a 50 MB CSV cell took 7.5 GB with
``max_length=64``), and a truncating call tokenises the whole text before it truncates.  So no
call is given more than :func:`piece_chars` characters of a longer text: it is cut into
consecutive *pieces* (:func:`text_pieces`), each ending just before a whitespace run that follows
a non-whitespace character.

Why a piece boundary cannot change the tokens: the tokens of a text are those of its
pre-tokens (the pre-tokenizer's pieces; BPE and WordPiece work inside one pre-token), and no
pre-token spans such a boundary -- WordPiece's BERT pre-tokenizer splits at every whitespace
character (and drops it), and byte-level BPE's pre-tokenizer (GPT-2's regex, also Llama 3's and
SmolLM2's) starts every match that holds whitespace at a whitespace character: a pre-token is
letters, digits or punctuation, each optionally led by one space, or a whitespace run.  So the
tokens of a prefix that ends at a boundary are exactly the first tokens of the whole text, and
(for these two families) the tokens of consecutive pieces, concatenated, are the tokens of the
whole.  Where a text has no whitespace for more than a piece (a base64 blob), the piece is cut
inside that run, and only the tokens of that run next to the cut may differ (exact, then, for
every text whose whitespace runs and words are shorter than a piece together).

- truncation (classification, ``data.mode=pad``): the text is cut after the first pieces that
  hold ``max_length + 2`` tokens or more (:func:`cut_for_tokens`) and tokenised as before: the
  first ``max_length`` tokens are those of the uncut text;
- packing (``data.mode=pack``, every token kept): a long document is tokenised piece by piece
  (:func:`tokenize_in_pieces`), when the tokenizer passes :func:`splits_at_whitespace` (a probe
  text gives the same ids whole and in pieces; a SentencePiece tokenizer that prepends ``▁`` to
  every call does not, and is given the whole document as before).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..errors import DataError

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


# A probe with the kinds of whitespace, punctuation and scripts a tokenizer meets (splits_at_whitespace).
PROBE = "The quick brown fox\n\njumps over  the lazy dog.\tIt's 2026: café, naïve, 東京 -- «ok»! \n End 12345 (x)"


def piece_chars(max_length: int) -> int:
    """The most characters of a long text one tokenizer call is given: ``max(8192, 32 x
    max_length)``.  English runs 4-5 characters a token, so one piece almost always holds the
    ``max_length`` tokens a truncation keeps; fewer tokens (whitespace or characters the tokenizer
    drops) just take more pieces."""
    return max(8192, 32 * max_length)


def text_pieces(text: str, size: int) -> Iterator[str]:
    """Consecutive pieces of ``text`` (concatenated: ``text``), each but the last ending just
    before a whitespace run that follows a non-whitespace character (a *boundary*, see the module
    docstring): the last boundary within ``size`` characters, else the first within ``2 x size``
    (a long whitespace run before a word), else a cut at ``size`` characters (no boundary that near)."""

    def boundary(i: int) -> bool:
        return text[i].isspace() and not text[i - 1].isspace()

    start = 0
    while len(text) - start > size:
        end = start + size
        cut = next((i for i in range(end, start, -1) if boundary(i)), None)
        if cut is None:
            cut = next((i for i in range(end + 1, min(start + 2 * size, len(text))) if boundary(i)), end)
        yield text[start:cut]
        start = cut
    if start < len(text) or not text:
        yield text[start:]


def cut_for_tokens(text: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int, size: int) -> str:
    """``text``, or for a text longer than ``size`` characters the shortest prefix of whole
    :func:`text_pieces` that holds at least ``max_tokens + 2`` tokens (counted per piece, less one
    per piece for tokenizers that add a token at the start of every call): its first ``max_tokens``
    tokens are those of ``text`` (module docstring).  The tokenizer is given one piece at a time."""
    if len(text) <= size:
        return text
    count, end = 0, 0
    for index, piece in enumerate(text_pieces(text, size)):
        count += len(tokenizer(piece, add_special_tokens=False)["input_ids"]) - (1 if index else 0)
        end += len(piece)
        if count >= max_tokens + 2:
            break
    return text[:end]


def tokenize_in_pieces(text: str, tokenizer: PreTrainedTokenizerBase, size: int) -> list[int]:
    """The ids of ``text`` without special tokens, from its :func:`text_pieces` one call each
    (only for a tokenizer that :func:`splits_at_whitespace`)."""
    ids: list[int] = []
    for piece in text_pieces(text, size):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def splits_at_whitespace(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` gives :data:`PROBE` the same ids whole and cut at every piece boundary
    (WordPiece and byte-level BPE do; a tokenizer that prepends a token to every call does not)."""
    whole = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    pieces = re.split(r"(?<=\S)(?=\s)", PROBE)  # cut at every boundary
    return whole == [token for piece in pieces for token in tokenizer(piece, add_special_tokens=False)["input_ids"]]


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids ``add_special_tokens=True`` puts before and after a single text (``[CLS]``/``[SEP]``,
    Llama's BOS, none for GPT-2), read from the tokenizer itself."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    start = next(i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare)
    return full[:start], full[start + len(bare) :]


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

    A text longer than :func:`piece_chars` is cut first (:func:`cut_for_tokens`): the same ids,
    in bounded memory.

    Returns:
        ``input_ids``, ``attention_mask`` (and ``token_type_ids`` for BERT-style models):
        one list of token ids per row, each at most ``max_length`` long.
    """
    size = piece_chars(max_length)

    def text(values: list) -> list[str]:  # predict keeps null rows: "" in, a row out
        return [cut_for_tokens("" if value is None else str(value), tokenizer, max_length, size) for value in values]

    pairs = text(batch[text_pair_column]) if text_pair_column else None
    return tokenizer(text(batch[text_column]), pairs, truncation=True, max_length=max_length)


IGNORE_INDEX = -100  # the label value torch's cross_entropy skips (its ``ignore_index`` default)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad with: the tokenizer's pad token, else its EOS (padding is masked anyway).

    Raises:
        DataError: the tokenizer has neither (it cannot mark document ends either).
    """
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise DataError(
        f"model.tokenizer ({tokenizer.name_or_path!r}) has no EOS token, which marks document ends; "
        "fix: use a tokenizer with an eos_token (every causal-LM tokenizer on the Hub has one)"
    )
