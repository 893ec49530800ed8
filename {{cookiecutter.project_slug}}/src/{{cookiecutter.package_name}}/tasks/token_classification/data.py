"""Word-tagging data (NER, POS, chunking): sentences of words with one tag each, from jsonl/parquet
rows or CoNLL-style text; tags mapped once from train; words aligned to sub-tokens; batched."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorForTokenClassification, PreTrainedTokenizerBase

from ...core.data.batching import TokenizedDataModule
from ...core.data.loading import first_non_utf8, load_split, require_columns, split_field
from ...core.data.tokenization import IGNORE_INDEX, load_tokenizer, use_eos_as_pad
from ...core.errors import ConfigError, DataError
from .spans import entity_spans, tag_problem

log = logging.getLogger(__name__)

# Read as CoNLL text (a word a line, blank lines between sentences); data.format=conll reads any suffix as CoNLL.
CONLL_SUFFIXES = (".conll", ".conll03", ".conllx", ".iob", ".iob2", ".bio", ".bioes", ".txt")
TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
METRIC_SPLIT = {"validation": "val"}  # the metrics' name of a split
PER_WORD = ("word_tags", "word_kept")  # a row's per-word lists (WordTagsCollator pads them)
NOT_INPUTS = ("labels", *PER_WORD, "words_cut", "words_no_token")  # batch keys the model does not read
WHERE = "__where__"  # the column of each row's place in its file while it is checked (a line or row number)


def read_conll(path: str, field: str, tag_column: int | None) -> tuple[dict[str, list], int]:
    """A CoNLL-style file's sentences as ``{"tokens", "tags", "line"}`` lists (``tags`` only with ``tag_column``) and the number
    of empty sentences dropped.  A line is a word, then columns; ``tag_column`` picks the tag (0-based, -1 = last).  Blank and
    ``-DOCSTART-`` lines end a sentence.

    Raises:
        DataError: a missing, non-UTF-8 or empty file, or a line without the tag column or with another width (its number).
    """
    if not Path(path).is_file():
        raise DataError(f"{field}={path!r} does not exist; fix: point {field} at an existing file")
    try:
        with open(path, encoding="utf-8-sig") as file:
            lines = [*file, ""]  # a final blank line ends the last sentence
    except UnicodeDecodeError:
        bad = first_non_utf8([path])  # (read again only to name the first bad byte)
        raise DataError(f"{field}={path!r}: {bad} is not UTF-8 text; fix: re-encode it, e.g. iconv -f latin1 -t utf-8") from None
    rows: dict[str, list] = {"tokens": [], "tags": [], "line": []}
    words, tags, empty, extra_blanks, previous = [], [], 0, 0, "start"  # previous line: start | blank | docstart | word
    width = None  # the columns of the file's first word line: every word line must have as many
    for number, line in enumerate(lines, start=1):
        columns = line.split()
        if columns and columns[0] != "-DOCSTART-":
            if tag_column is not None and (len(columns) < 2 or not -len(columns) <= tag_column < len(columns)):
                raise DataError(
                    f"{field}={path!r} line {number}: {line.strip()!r} has {len(columns)} column(s), no tag column "
                    f"data.conll_tag_column={tag_column}; fix: one 'word TAG' per line (columns separated by spaces "
                    "or tabs), or data.conll_tag_column=<the tag's column, 0-based; -1 = last>"
                )
            if tag_column is not None and width is not None and len(columns) != width:
                # A line that lost a column would have its tag read from another one: refused, never guessed.
                raise DataError(
                    f"{field}={path!r} line {number}: {line.strip()!r} has {len(columns)} column(s), the file's first "
                    f"word line {width}; fix: give every word line the same columns (a missing tag: O)"
                )
            width = width or (len(columns) if tag_column is not None else None)
            if not words:
                rows["line"].append(number)
                empty, extra_blanks = empty + extra_blanks, 0  # (blank lines at the end of the file are no sentence)
            words.append(columns[0])
            tags.append(columns[tag_column] if tag_column is not None else None)
            previous = "word"
            continue
        if words:
            rows["tokens"].append(words)
            rows["tags"].append(tags)
        elif not columns and previous == "blank":
            extra_blanks += 1
        words, tags = [], []
        previous = "docstart" if columns else "blank"
    if not rows["tokens"]:
        raise DataError(f"{field}={path!r} holds no sentence; fix: one 'word TAG' per line, a blank line between sentences")
    if tag_column is None:
        del rows["tags"]
    return rows, empty


def is_empty(words: list | None) -> bool:
    """A row without words (dropped from training data and counted)."""
    return not words


def as_override(value: object) -> str:
    """A value as a command-line override writes it (``true``, ``IOB2``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def no_words_as_empty(words: list | None, column: str) -> dict[str, list]:
    """A predict row whose words (``column``) are null: no words (its output row has ``tags: []``)."""
    return {column: words or []}


def has_words(words: list | None) -> bool:
    """A row with words (kept)."""
    return not is_empty(words)


def tag_ids(tags: list[list], label2id: dict[str, int]) -> dict[str, list[list[int]]]:
    """Each row's tags as ids (a ``datasets`` batched map)."""
    return {"tag_ids": [[label2id[str(tag)] for tag in row] for row in tags]}


def class_names(tags: list[int], names: list[str], column: str) -> dict[str, list[str]]:
    """A row's class ids (``column``) as their names (a hub data set's ``Sequence(ClassLabel)`` column)."""
    return {column: [names[tag] for tag in tags]}


def align_tags(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, max_length: int, tags: bool) -> dict[str, list]:
    """Tokenise pre-split words; each word's tag id on its first sub-token (0 without ``tags``: predict), -100 elsewhere.

    Adds ``input_ids``/``attention_mask`` (``token_type_ids``) and ``labels`` (per sub-token); ``word_tags`` (every word's
    tag id, 0 without ``tags``) and ``word_kept`` (1: the word has a first sub-token in the input) per word; ``words_cut``
    (words ``max_length`` cut off) and ``words_no_token`` (words the tokenizer makes nothing of, e.g. a zero-width space or
    a soft hyphen) per row.  A word without a sub-token keeps its place: the next word's tag stays the next word's."""
    encoded = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    labels, kept_rows, missing = [], [], []
    for row, words in enumerate(batch["tokens"]):
        row_labels, kept = [], [0] * len(words)
        for word in encoded.word_ids(row):
            first = word is not None and not kept[word]
            row_labels.append((batch["tag_ids"][row][word] if tags else 0) if first else IGNORE_INDEX)
            if word is not None:
                kept[word] = 1
        labels.append(row_labels)
        kept_rows.append(kept)
        missing += [(row, words[index]) for index, seen in enumerate(kept) if not seen]
    # A missing word was cut off, or has no sub-token at all: tokenised alone, one at a time, it tells which.
    alone = tokenizer([[word] for _, word in missing], is_split_into_words=True, add_special_tokens=False) if missing else None
    no_token = [0] * len(batch["tokens"])
    for index, (row, _) in enumerate(missing):
        no_token[row] += not alone["input_ids"][index]
    cut = [kept.count(0) - empty for kept, empty in zip(kept_rows, no_token)]
    word_tags = batch["tag_ids"] if tags else [[0] * len(words) for words in batch["tokens"]]
    return {**encoded, "labels": labels, "word_tags": word_tags, "word_kept": kept_rows, "words_cut": cut, "words_no_token": no_token}


class WordTagsCollator:
    """Pads each micro-batch: the model's inputs and ``labels`` ``(B, T)`` (labels with -100) by
    ``DataCollatorForTokenClassification``, the per-word ``word_tags`` (with -100) and ``word_kept`` (with 0) to ``(B, W)``,
    ``W`` the most words of a row; ``words_cut``, ``words_no_token`` ``(B,)``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, pad_to_multiple_of: int | None) -> None:
        # Lengths a multiple of 8 for tensor cores.
        self.tokens = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=pad_to_multiple_of, label_pad_token_id=IGNORE_INDEX)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max((len(feature["word_tags"]) for feature in features), default=0)
        word_tags = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        word_kept = torch.zeros((len(features), width), dtype=torch.long)
        for row, feature in enumerate(features):
            word_tags[row, : len(feature["word_tags"])] = torch.tensor(feature["word_tags"], dtype=torch.long)
            word_kept[row, : len(feature["word_kept"])] = torch.tensor(feature["word_kept"], dtype=torch.long)
        batch = self.tokens([{k: v for k, v in feature.items() if k not in PER_WORD} for feature in features])
        return {**batch, "word_tags": word_tags, "word_kept": word_kept}


class TokenTagsDataModule(TokenizedDataModule):
    """Batches of tagged words (jsonl/json/parquet rows, CoNLL text, a hub data set): ``input_ids``, ``attention_mask``, ``labels``
    (a tag id on each word's first sub-token, else -100) ``(micro_batch, T)``, ``words_cut`` ``(micro_batch,)``.

    Args (the ``data`` group's keys, and :class:`...core.data.batching.TokenizedDataModule`'s):
        tokens_column, tags_column: a row's words and tags (strings, or a hub data set's class ids), one tag per word.
        format, conll_tag_column: ``auto`` (CoNLL for :data:`CONLL_SUFFIXES`) or ``conll``; the tag's column there (-1 = last).
        scheme, strict: the tag scheme and seqeval's strict mode (:mod:`.spans`).
        label2id, trained_facts: a checkpoint's tag mapping (``None``: built from train) and ``scheme``/``strict`` (must match).

    Raises (from ``setup``, before any weights load):
        DataError: missing file or column, words and tags of different lengths, an empty word, a tag outside ``scheme`` or train's.
        ConfigError: ``scheme``/``strict`` other than ``trained_facts``.
    """

    def __init__(
        self,
        *,
        tokens_column: str,
        tags_column: str,
        format: str,
        conll_tag_column: int,
        scheme: str,
        strict: bool,
        label2id: dict[str, int] | None = None,
        predict_file: str | None = None,
        trained_facts: dict | None = None,
        **shared: object,
    ) -> None:
        super().__init__(**shared)
        self.tokens_column, self.tags_column = tokens_column, tags_column
        self.format, self.conll_tag_column = format, conll_tag_column
        self.scheme, self.strict = scheme, strict
        self.label2id = label2id
        self.predict_file = predict_file
        self.trained_facts = trained_facts
        self.words_cut: dict[str, int] = {}  # per split: words max_length cut off (untagged; scored as O)
        self.predict_rows: datasets.Dataset | None = None  # the predict file's rows, their fields as read

    @property
    def task_facts(self) -> dict:
        """What the module's metrics parse tags by (stored in checkpoints: eval scores as training did)."""
        return {"scheme": self.scheme, "strict": self.strict}

    @property
    def id2label(self) -> dict[int, str] | None:
        """Tag id -> tag, once the tags are mapped (``None`` before)."""
        return None if self.label2id is None else {index: name for name, index in self.label2id.items()}

    def setup(self, stage: str) -> None:
        """Load, check, map and tokenise what ``stage`` needs (idempotent)."""
        differ = [key for key, value in (self.trained_facts or {}).items() if self.task_facts.get(key) != value]
        if differ:
            trained = " ".join(f"data.{key}={as_override(self.trained_facts[key])}" for key in differ)
            config = " ".join(f"data.{key}={as_override(self.task_facts[key])}" for key in differ)
            raise ConfigError(
                f"the checkpoint was trained, and is scored, with {trained}; the config says {config}; "
                f"fix: {trained} (the data config it was trained with)"
            )
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
            if getattr(self.tokenizer, "add_prefix_space", None) is False:
                # Byte-level BPE (GPT-2, RoBERTa) needs add_prefix_space for pre-split words: each one as after a space.
                self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name, add_prefix_space=True)
        use_eos_as_pad(self.tokenizer)  # decoders (GPT-2, Llama) ship no pad token
        self.tokenizer.padding_side = "right"  # each word's sub-tokens keep the positions they have alone
        if stage == "predict":
            self._setup_predict()
            return
        if self.label2id is None or (stage in ("fit", "validate") and "train" not in self.datasets):
            train = self._load("train", tags=True)
            if self.label2id is None:
                self.label2id = self._tag_map(train)
                log.info("Tags -> ids: %s", self.label2id)
            if "validation" in self.splits:
                validation = self._load("validation", tags=True)
            else:
                train, validation = self.hold_out_validation(
                    train, "sentence", "data.splits.validation=path/to/dev.conll, or more sentences"
                )
            self.datasets["train"] = self._prepare("train", train)
            self.datasets["validation"] = self._prepare("validation", validation)
        if stage in ("fit", "test") and self.has_test and "test" not in self.datasets:
            self.datasets["test"] = self._prepare("test", self._load("test", tags=True))
        if stage == "test" and "test" not in self.datasets:
            raise DataError("data.splits.test is null, so there is no test split to evaluate; fix: data.splits.test=path/to/test.conll")
        if stage in ("fit", "validate"):
            self.check_validation_interval()

    def _is_conll(self, source: str) -> bool:
        return self.hub_name is None and (self.format == "conll" or Path(source).suffix.lower() in CONLL_SUFFIXES)

    def _load(self, split: str, tags: bool) -> datasets.Dataset:
        """One split's rows (with ``tags``, ``tags_column`` as names), checked, with a :data:`WHERE` column (CoNLL line or 1-based
        row); empty sentences are dropped and counted, except in predict's input (one output row per input row)."""
        source = self.splits[split] if split != "predict" else self.predict_file
        field = split_field(split)
        if self._is_conll(source):
            columns, empty = read_conll(source, field, self.conll_tag_column if tags else None)
            named = {self.tokens_column: columns["tokens"], **({self.tags_column: columns["tags"]} if tags else {})}
            dataset, where = datasets.Dataset.from_dict({**named, WHERE: columns["line"]}), "line"
        else:
            suffix = Path(source).suffix.lower()
            if self.hub_name is None and suffix not in TABLE_SUFFIXES:
                fix = (
                    'a jsonl file, one {"tokens": [...], "tags": [...]} a line (a list of words does not fit a csv cell)'
                    if suffix in (".csv", ".tsv")
                    else "one of those, or data.format=conll if it is CoNLL text"
                )
                raise DataError(
                    f"{field}={source!r}: token classification reads jsonl/json/parquet rows ({self.tokens_column!r}: a list "
                    f"of words, {self.tags_column!r}: a list of tags) or CoNLL text {list(CONLL_SUFFIXES)}; fix: {fix}"
                )
            dataset = load_split(split, source, self.hub_name, self.hub_config, self.cache_dir)
            require_columns(
                dataset, split, source, {"tokens_column": self.tokens_column, "tags_column": self.tags_column if tags else None}
            )
            dataset, where = self._tags_as_names(dataset) if tags else dataset, "row"
            dataset = dataset.add_column(WHERE, list(range(1, len(dataset) + 1)))
            empty = 0 if split == "predict" else sum(map(is_empty, dataset[self.tokens_column]))
            if empty:
                dataset = dataset.filter(has_words, input_columns=self.tokens_column)
        if empty:
            log.warning(
                "%s=%r: %d empty sentence(s) (rows without words, or a blank line after a blank line) skipped", field, source, empty
            )
        self._check_rows(dataset, field, source, where, tags)
        return dataset

    def _where(self, source: str, where: int, word: int) -> str:
        """Where word ``word`` is: its CoNLL line (a sentence's words are on consecutive lines), else the row."""
        return f"line {where + word}" if self._is_conll(source) else f"row {where}"

    def _tags_as_names(self, dataset: datasets.Dataset) -> datasets.Dataset:
        """A hub data set's class ids (``Sequence(ClassLabel)``) as their names: tags are names here."""
        inner = getattr(dataset.features[self.tags_column], "feature", None)
        if not isinstance(inner, datasets.ClassLabel):
            return dataset
        features = dataset.features.copy()
        features[self.tags_column] = datasets.Sequence(datasets.Value("string"))  # (else map encodes the names back to ids)
        fn_kwargs = {"names": inner.names, "column": self.tags_column}
        return dataset.map(class_names, input_columns=self.tags_column, fn_kwargs=fn_kwargs, features=features)

    def _check_rows(self, dataset: datasets.Dataset, field: str, source: str, where: str, tags: bool) -> None:
        """Check every row: non-empty words, as many tags, each of ``scheme``; tags continuing no entity are counted and logged.

        Raises:
            DataError: a bad row (where, lengths or tag); tags but no entity under ``scheme``/``strict`` (every score would be 0).
        """
        malformed, first_malformed, entities, tagged = 0, None, 0, False
        columns = [self.tokens_column, WHERE] + ([self.tags_column] if tags else [])
        for row in dataset.select_columns(columns):
            words, at = row[self.tokens_column] or [], f"{where} {row[WHERE]}"
            if not isinstance(words, list) or not all(isinstance(word, str) and word.strip() for word in words):
                raise DataError(
                    f"{field}={source!r} {at}: data.tokens_column={self.tokens_column!r} must be a list of non-empty words, "
                    f"got {str(words)[:120]}; fix: one string per word"
                )
            if not tags:
                continue
            row_tags = row[self.tags_column]
            if not isinstance(row_tags, list) or len(row_tags) != len(words):
                held = f"{len(row_tags)} tags" if isinstance(row_tags, list) else f"tags that are not a list ({repr(row_tags)[:60]})"
                raise DataError(
                    f"{field}={source!r} {at}: {len(words)} words but {held} (data.tags_column={self.tags_column!r}); fix: one tag per word"
                )
            for i, tag in enumerate(row_tags):
                problem = tag_problem(str(tag), self.scheme)
                if problem:
                    raise DataError(
                        f"{field}={source!r} {self._where(source, row[WHERE], i)}: tag {problem} (data.scheme={self.scheme}); "
                        "fix: correct the tag, or data.scheme=none for tags without B-/I- prefixes (POS), data.scheme=BIOES "
                        "for E-/S- tags"
                    )
            spans, invalid = entity_spans([str(tag) for tag in row_tags], self.scheme, self.strict)
            entities, tagged = entities + len(spans), tagged or any(str(tag) != "O" for tag in row_tags)
            if invalid and first_malformed is None:
                first_malformed = row[WHERE]
            malformed += invalid
        if tagged and not entities:
            raise DataError(
                f"{field}={source!r} holds no entity under data.scheme={self.scheme} data.strict={self.strict}: every score "
                "would be 0; fix: data.strict=false, or data.scheme=IOB1 for files whose entities start with I- (the original "
                "CoNLL-2003 files)"
            )
        if malformed:
            counted = "they are not entities (strict)" if self.strict else "each begins an entity, as conlleval reads it"
            log.warning(
                "%s=%r: %d tag(s) continue no entity (an I- after O or another type; the first in the row at %s %d): %s. "
                "Files in IOB1 (the original CoNLL-2003 files: an entity starts with I-) are read right with data.scheme=IOB1",
                field,
                source,
                malformed,
                where,
                first_malformed,
                counted,
            )

    def _tag_map(self, train: datasets.Dataset) -> dict[str, int]:
        """Tag -> id from train: ``O`` first, then by name.

        Raises:
            DataError: fewer than two tags.
        """
        names = sorted({str(tag) for tags in train[self.tags_column] for tag in tags}, key=lambda tag: (tag != "O", tag))
        if len(names) < 2:
            raise DataError(
                f"data.tags_column={self.tags_column!r}: the train split ({self.splits['train']}) has only the tag(s) {names}; "
                "fix: check the tag column (data.conll_tag_column for CoNLL files)"
            )
        return {name: index for index, name in enumerate(names)}

    def _prepare(self, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
        """Tags -> ids (refusing ones train lacks), then tokenise and align; counts cut words."""
        unknown = sorted({str(tag) for tags in dataset[self.tags_column] for tag in tags} - set(self.label2id))
        if unknown:
            source = self.splits.get(split, "cut from train")
            first = next(
                self._where(source, row[WHERE], i) for row in dataset for i, tag in enumerate(row[self.tags_column]) if str(tag) in unknown
            )
            raise DataError(
                f"{split_field(split)}={source!r} {first}: the {split} split has tags {unknown[:10]} that the training tags "
                f"{sorted(self.label2id)} do not include; fix: correct those rows, or add examples of those tags to train"
            )
        self.split_sizes[split] = len(dataset)
        dataset = dataset.map(tag_ids, input_columns=self.tags_column, batched=True, fn_kwargs={"label2id": self.label2id})
        return self._tokenize(split, dataset, tags=True)

    def _tokenize(self, split: str, dataset: datasets.Dataset, tags: bool) -> datasets.Dataset:
        dataset = dataset.rename_column(self.tokens_column, "tokens") if self.tokens_column != "tokens" else dataset
        tokenized = dataset.map(
            align_tags,
            batched=True,
            fn_kwargs={"tokenizer": self.tokenizer, "max_length": self.max_length, "tags": tags},
            remove_columns=dataset.column_names,
            desc=f"Tokenizing {split}",
        )
        self.words_cut[split] = cut = sum(tokenized["words_cut"])
        outcome = "null in the predictions" if split == "predict" else "scored as O: an entity there is a miss"
        if cut:
            log.warning(
                "%s: data.max_length=%d cut %d word(s) off %d of %d row(s): they get no tag (%s, %s/words_cut); fix: a larger "
                "data.max_length, or shorter sentences",
                split_field(split),
                self.max_length,
                cut,
                sum(1 for n in tokenized["words_cut"] if n),
                len(tokenized),
                outcome,
                METRIC_SPLIT.get(split, split),
            )
        rows = [index for index, n in enumerate(tokenized["words_no_token"]) if n]
        if rows:
            unkept = [word for word, kept in zip(dataset[rows[0]]["tokens"], tokenized[rows[0]]["word_kept"]) if not kept]
            example = next(w for w in unkept if not self.tokenizer([w], is_split_into_words=True, add_special_tokens=False)["input_ids"])
            log.warning(
                "%s: %d word(s) in %d row(s) have no sub-token under this tokenizer (the first, in sentence %d: %s): they get no tag "
                "(%s, %s/words_no_token); the other words keep theirs. Fix, if they are not meant as words: remove them",
                split_field(split),
                sum(tokenized["words_no_token"]),
                len(rows),
                rows[0] + 1,
                ascii(example),
                outcome,
                METRIC_SPLIT.get(split, split),
            )
        return tokenized

    def _setup_predict(self) -> None:
        if self.predict_file is None:
            raise DataError("no file to tag; fix: input=path/to/sentences.conll (or .jsonl)")
        rows = self._load("predict", tags=False)
        self.predict_rows = rows.remove_columns(WHERE)
        words = rows.select_columns([self.tokens_column]).map(
            no_words_as_empty, input_columns=self.tokens_column, fn_kwargs={"column": self.tokens_column}
        )
        self.datasets["predict"] = self._tokenize("predict", words, tags=False)

    @property
    def groups_by_length(self) -> bool:
        return self.group_by_length

    def collator(self) -> WordTagsCollator:
        return WordTagsCollator(self.tokenizer, self.pad_to_multiple_of)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
