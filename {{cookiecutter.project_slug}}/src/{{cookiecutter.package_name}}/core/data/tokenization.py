"""Tokenisation shared by the data modules.

``tokenize_batch`` is a module-level function so ``Dataset.map`` fingerprints it alike in every process (cache reused).
A fast tokenizer keeps ~140 bytes of offsets a character and tokenises a whole text before truncating, so no call
gets more than :func:`piece_chars` characters: a longer text is cut into :func:`text_pieces`, each ending just before
a whitespace run that follows a non-whitespace character (a boundary). No pre-token spans a boundary (BERT's splits
at whitespace; byte-level BPE's, GPT-2's regex, starts each match holding whitespace with it), so pieces give the
ids of the whole; only a whitespace-free run longer than a piece (a base64 blob) may differ next to its cut.
Truncation (``data.mode=pad``) keeps the first pieces holding ``max_length + 2`` tokens (:func:`cut_for_tokens`; chat rows
cut from the left: the last, :func:`tail_for_tokens`);
packing (``data.mode=pack``) tokenises piece by piece (:func:`tokenize_in_pieces`) if the tokenizer
:func:`splits_at_whitespace` (a SentencePiece one prepending ``▁`` to every call gets the whole document)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..errors import DataError

log = logging.getLogger(__name__)


def disable_tokenizer_parallelism() -> None:
    """Set ``TOKENIZERS_PARALLELISM=false`` unless the user set it: the Rust thread pool does not survive ``fork``
    (DataLoader workers warn and may deadlock). Called just before workers fork, so ``setup``'s tokenisation keeps all cores."""
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
    """Give a tokenizer without a pad token its EOS token as pad, in place (GPT-2, Llama and SmolLM2 ship none);
    the collator, the classifier's ``config.pad_token_id`` and the saved tokenizer use it.

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
    """The most characters of a long text one tokenizer call gets: ``max(8192, 32 x max_length)`` (English runs
    4-5 characters a token, so one piece almost always holds the ``max_length`` tokens a truncation keeps)."""
    return max(8192, 32 * max_length)


def text_pieces(text: str, size: int) -> Iterator[str]:
    """Consecutive pieces of ``text`` (concatenated: ``text``), each but the last ending at a boundary (module
    docstring): the last within ``size`` characters, else the first within ``2 x size``, else a cut at ``size``."""

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
    """``text``, or if longer than ``size`` characters the shortest prefix of whole :func:`text_pieces` holding
    ``max_tokens + 2`` tokens or more (one call a piece, less one a piece for a per-call start token): its first
    ``max_tokens`` tokens are ``text``'s."""
    if len(text) <= size:
        return text
    count, end = 0, 0
    for index, piece in enumerate(text_pieces(text, size)):
        count += len(tokenizer(piece, add_special_tokens=False)["input_ids"]) - (1 if index else 0)
        end += len(piece)
        if count >= max_tokens + 2:
            break
    return text[:end]


def tail_for_tokens(text: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int, size: int) -> str:
    """As :func:`cut_for_tokens` from the end: ``text``, or the shortest suffix of whole :func:`text_pieces` holding
    ``max_tokens + 2`` tokens or more: its last ``max_tokens`` tokens are ``text``'s (a piece starts at a boundary)."""
    if len(text) <= size:
        return text
    count, start = 0, len(text)
    for piece in reversed(list(text_pieces(text, size))):
        count += len(tokenizer(piece, add_special_tokens=False)["input_ids"]) - 1
        start -= len(piece)
        if count >= max_tokens + 2:
            break
    return text[start:]


def tokenize_in_pieces(text: str, tokenizer: PreTrainedTokenizerBase, size: int) -> list[int]:
    """The ids of ``text`` (no special tokens), one call per :func:`text_pieces`; only if :func:`splits_at_whitespace`."""
    ids: list[int] = []
    for piece in text_pieces(text, size):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def splits_at_whitespace(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` gives :data:`PROBE` the same ids whole and cut at every boundary (not if it prepends a token per call)."""
    whole = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    pieces = re.split(r"(?<=\S)(?=\s)", PROBE)  # cut at every boundary
    return whole == [token for piece in pieces for token in tokenizer(piece, add_special_tokens=False)["input_ids"]]


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids ``add_special_tokens=True`` puts before and after a single text (``[CLS]``/``[SEP]``, Llama's BOS, none for GPT-2)."""
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
    """Tokenise a batch of texts (or pairs) to their first ``max_length`` tokens, unpadded (the collator pads per
    micro-batch); pairs truncate ``longest_first``; a null text is "" (predict keeps every row); a text over
    :func:`piece_chars` is cut first by :func:`cut_for_tokens` (same ids, bounded memory).

    Returns:
        ``input_ids``, ``attention_mask`` (and ``token_type_ids`` for BERT-style models): a list per row.
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
