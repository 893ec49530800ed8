"""Entity spans from tag sequences, and entity-level precision/recall/F1 as a torchmetrics metric.

Schemes (``data.scheme``): ``IOB2``/``BIO`` (``B-X`` begins an entity, ``I-X`` continues it, ``O`` is outside), ``IOB1``
(CoNLL-2003's files: ``B-X`` only after an entity of the same type; read as IOB2, an ``I-`` after ``O`` no error),
``BIOES`` (also ``E-X`` ends an entity, ``S-X`` is a one-token one) and ``none`` (no prefixes, e.g. POS: every tag but
``O`` is a one-token span, so F1 is token micro F1). ``data.strict=false`` scores as ``conlleval`` and seqeval's default
(a stray ``I-X``/``E-X`` begins an entity); ``true`` as seqeval's ``mode="strict"`` (only well-formed entities count).
Stray tags are counted either way (``{split}/invalid_tags``). An entity is right when its type, first and last word
match (CoNLL-2003, Tjong Kim Sang & De Meulder 2003). Not seqeval: last released in 2020, it pulls in scikit-learn."""

from __future__ import annotations

import torch
from torchmetrics import Metric

SCHEMES = {"IOB2": ("B", "I"), "BIO": ("B", "I"), "IOB1": ("B", "I"), "BIOES": ("B", "I", "E", "S"), "none": ()}


def split_tag(tag: str, scheme: str) -> tuple[str, str]:
    """``("B", "PER")`` for ``B-PER``; ``("O", "")`` for ``O``; scheme ``none``: ``("S", tag)``."""
    if tag == "O":
        return "O", ""
    if scheme == "none":
        return "S", tag
    prefix, _, kind = tag.partition("-")
    return prefix, kind


def tag_problem(tag: str, scheme: str) -> str | None:
    """Why ``tag`` is not a tag of ``scheme`` (``None``: it is)."""
    if scheme == "none" or tag == "O":
        return None
    prefix, kind = split_tag(tag, scheme)
    if prefix not in SCHEMES[scheme] or not kind:
        return f"{tag!r} is not O or one of {'/'.join(p + '-<type>' for p in SCHEMES[scheme])}"
    return None


def entity_spans(tags: list[str], scheme: str, strict: bool) -> tuple[set[tuple[str, int, int]], int]:
    """The entities of one sentence's word tags as ``{(type, first word, last word)}``, and the number of tags that
    continue no entity (strict BIOES also counts a ``B-X`` left without its ``E-X``)."""
    spans, invalid = set(), 0
    start, kind, last = None, "", "O"  # the open entity: first word, type, prefix of its last tag
    for index, tag in enumerate([*tags, "O"]):  # a final O closes the last entity
        prefix, this = split_tag(tag, scheme)
        continues = start is not None and this == kind and last in ("B", "I") and prefix in ("I", "E")
        if start is not None and not continues:  # the open entity ends before this word
            if strict and scheme == "BIOES" and last != "E" and last != "S":
                invalid += 1  # B-X I-X* without its E-X: no entity
            else:
                spans.add((kind, start, index - 1))
            start = None
        if continues:
            last = prefix
        elif prefix in ("B", "S"):
            start, kind, last = index, this, prefix
        elif prefix in ("I", "E"):
            invalid += scheme != "IOB1"  # (IOB1 starts every entity so)
            if not strict:  # conlleval: it begins an entity
                start, kind, last = index, this, "B" if prefix == "I" else "E"
        if start is not None and last in ("E", "S"):  # BIOES: the entity ends at this word
            spans.add((kind, start, index))
            start = None
    return spans, invalid


def per_word(predicted: torch.Tensor, labels: torch.Tensor, word_tags: torch.Tensor, word_kept: torch.Tensor) -> list[list]:
    """Each row's predicted tag id per word, ``None`` for a word without a sub-token in the input (cut off or none at all).

    Args: ``predicted``, ``labels`` ``(B, T)`` (a word's tag on its first sub-token, -100 elsewhere); ``word_tags``,
    ``word_kept`` ``(B, W)`` (-100 past a row's words; 1 for a word with a first sub-token): the labelled positions are the
    kept words, in order."""
    rows = []
    for row_predicted, row_labels, tags, kept in zip(predicted.tolist(), labels.tolist(), word_tags.tolist(), word_kept.tolist()):
        guesses = iter(p for p, label in zip(row_predicted, row_labels) if label != -100)
        rows.append([next(guesses) if keep else None for tag, keep in zip(tags, kept) if tag != -100])
    return rows


class EntityScores(Metric):
    """Entity-level true positives, predicted and gold entities per type (summed over batches and processes), and the
    predicted tags that continue no entity.  ``update(predicted, labels, word_tags, word_kept)`` (see :func:`per_word`):
    scored against every word's gold tag, so an entity in words the model did not see (cut off by ``data.max_length``, or
    without a sub-token) is a miss, as conlleval/seqeval count it on the same gold file; such words are predicted ``O``."""

    full_state_update = False

    def __init__(self, id2label: dict[int, str], scheme: str, strict: bool) -> None:
        super().__init__()
        self.names = [id2label[i] for i in range(len(id2label))]
        self.scheme, self.strict = scheme, strict
        self.types = sorted({split_tag(name, scheme)[1] for name in self.names} - {""})
        for state in ("true_positives", "predicted", "gold"):
            self.add_state(state, default=torch.zeros(len(self.types), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("invalid", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, predicted: torch.Tensor, labels: torch.Tensor, word_tags: torch.Tensor, word_kept: torch.Tensor) -> None:
        index = {kind: i for i, kind in enumerate(self.types)}
        for guesses, tags in zip(per_word(predicted, labels, word_tags, word_kept), word_tags.tolist()):
            guess, invalid = entity_spans(["O" if p is None else self.names[p] for p in guesses], self.scheme, self.strict)
            truth, _ = entity_spans([self.names[g] for g in tags if g != -100], self.scheme, self.strict)
            self.invalid += invalid
            for spans, state in ((guess, self.predicted), (truth, self.gold), (guess & truth, self.true_positives)):
                for kind, _, _ in spans:
                    state[index[kind]] += 1

    def compute(self) -> dict[str, torch.Tensor]:
        """``precision``, ``recall``, ``f1`` (micro: over all entities), ``f1_<type>`` per type
        (0 where nothing was predicted or there is nothing to find), ``invalid_tags``."""
        scores = {}
        for name, (tp, predicted, gold) in {
            "": (self.true_positives.sum(), self.predicted.sum(), self.gold.sum()),
            **{f"_{kind}": (self.true_positives[i], self.predicted[i], self.gold[i]) for i, kind in enumerate(self.types)},
        }.items():
            precision = tp / predicted if predicted else torch.zeros(())
            recall = tp / gold if gold else torch.zeros(())
            f1 = 2 * tp / (predicted + gold) if predicted + gold else torch.zeros(())
            if not name:
                scores.update(precision=precision.float(), recall=recall.float())
            scores[f"f1{name}"] = f1.float()
        scores["invalid_tags"] = self.invalid.float()
        return scores
