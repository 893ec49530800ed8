"""Text (or text-pair) classification data: load, map labels, split, tokenise once, batch."""

from __future__ import annotations

import logging
import math
import re

import datasets
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding

from ...core.data.batching import TokenizedDataModule
from ...core.data.loading import drop_blank_rows, is_blank, load_split, require_column_types, require_columns
from ...core.data.tokenization import load_tokenizer, tokenize_batch, use_eos_as_pad
from ...core.errors import DataError

log = logging.getLogger(__name__)


# A whole number written with a decimal point ("1.0", "-2.00").
WHOLE_DECIMAL = re.compile(r"-?\d+\.0+")


def label_key(value: object) -> str | None:
    """The string a raw label is known by: ``1``, ``1.0`` and ``"1"`` are the same label ``"1"``."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if WHOLE_DECIMAL.fullmatch(text):  # "1.0" as a csv cell reads it: the label 1
        text = text.split(".")[0]
    return text


def _label_sort_key(name: str) -> tuple[int, int | str]:
    # Integer-looking labels in numeric order ("2" before "10"), then the rest alphabetically.
    return (0, int(name)) if name.lstrip("-").isdigit() else (1, name)


def raw_label_names(dataset: datasets.Dataset, label_column: str) -> list[str | None]:
    """The distinct labels of a split as strings (class names for a ``ClassLabel`` column)."""
    feature = dataset.features[label_column]
    values = dataset.unique(label_column)
    if isinstance(feature, datasets.ClassLabel):
        return [feature.int2str(v) if v is not None and v >= 0 else None for v in values]
    return [label_key(v) for v in values]


def build_label_map(dataset: datasets.Dataset, label_column: str, source: str) -> dict[str, int]:
    """Map each training label to an id: a ``ClassLabel`` keeps its order, others are sorted (numerically if all integers).

    Raises:
        DataError: a row has no label, or there are fewer than two classes.
    """
    feature = dataset.features[label_column]
    names = raw_label_names(dataset, label_column)
    if any(is_blank(name) for name in names):  # (a csv/tsv cell is read as written: "" when empty)
        raise DataError(
            f"data.label_column={label_column!r}: some rows of the train split ({source}) have no label; fix: drop or label them"
        )
    if isinstance(feature, datasets.ClassLabel):
        names = feature.names
    else:
        names = sorted(set(names), key=_label_sort_key)
    if len(names) < 2:
        raise DataError(
            f"data.label_column={label_column!r}: the train split ({source}) has only the label(s) {names}; "
            "a classifier needs at least two classes; fix: check the label column or add rows of the other classes"
        )
    spellings: dict[str, list[str]] = {}
    for name in names:
        spellings.setdefault(str(name).casefold(), []).append(str(name))
    for same in (group for group in spellings.values() if len(group) > 1):
        log.warning(
            "data.label_column=%r: the labels %s of the train split (%s) differ only in case and are %d separate classes; "
            "fix: spell them one way in the file if they are one class",
            label_column,
            same,
            source,
            len(same),
        )
    return {name: index for index, name in enumerate(names)}


def encode_labels(
    batch: dict[str, list], label_column: str, label2id: dict[str, int], class_names: list[str] | None
) -> dict[str, list[int]]:
    """Replace raw labels by ids in a ``labels`` column (``class_names`` decodes a ``ClassLabel``)."""
    raw = batch[label_column]
    keys = [class_names[v] for v in raw] if class_names is not None else [label_key(v) for v in raw]
    return {"labels": [label2id[key] for key in keys]}


class ClassificationDataModule(TokenizedDataModule):
    """Classification batches from csv/tsv/jsonl/parquet files or a hub data set: ``input_ids``, ``attention_mask`` (and
    ``token_type_ids``) ``(micro_batch, T)``, ``T`` the longest row rounded up to ``pad_to_multiple_of``; ``labels`` ``(micro_batch,)``.
    The arguments are the ``data`` group's keys (and :class:`...core.data.batching.TokenizedDataModule`'s); ``label2id``: a fixed
    label mapping (a checkpoint's), ``None`` builds it from train.

    Raises (from ``setup``, before any weights load):
        DataError: missing file or column, empty file, an unknown label in validation/test, neither a pad nor an EOS token.
    """

    def __init__(
        self,
        *,
        text_column: str,
        text_pair_column: str | None,
        label_column: str,
        label2id: dict[str, int] | None = None,
        predict_file: str | None = None,
        **shared: object,
    ) -> None:
        super().__init__(**shared)
        self.text_column, self.text_pair_column, self.label_column = text_column, text_pair_column, label_column
        self.label2id = label2id
        self.train_texts: set[tuple] = set()  # the train split's texts, once read (overlap warnings)
        self.predict_file = predict_file
        self.predict_rows: datasets.Dataset | None = None

    @property
    def id2label(self) -> dict[int, str] | None:
        """Class index -> label name, once the labels are mapped (``None`` before)."""
        return None if self.label2id is None else {index: name for name, index in self.label2id.items()}

    def setup(self, stage: str) -> None:
        """Load, check, label-map and tokenise what ``stage`` needs (idempotent, cached on disk)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        use_eos_as_pad(self.tokenizer)  # decoders (GPT-2, Llama) ship no pad token
        # Right padding: rows keep their positions (GPT-2 counts from column 0), and a decoder reads its last real token.
        self.tokenizer.padding_side = "right"
        if stage == "predict":
            self._setup_predict()
            return
        if self.label2id is None or (stage in ("fit", "validate") and "train" not in self.datasets):
            self._setup_train_and_validation()
        # On fit the test split is checked too: an unknown test label stops the run before training.
        if stage in ("fit", "test") and self.has_test and "test" not in self.datasets:
            test = self._load("test")
            self._warn_about_overlap("test", test)  # (when this process has read the train split)
            self.datasets["test"] = self._prepare("test", test)
        if stage == "test" and "test" not in self.datasets:
            raise DataError("data.splits.test is null, so there is no test split to evaluate; fix: data.splits.test=path/to/test.csv")
        if stage in ("fit", "validate"):  # train.py validates before fitting
            self.check_validation_interval()

    @property
    def text_columns(self) -> list[str]:
        return [self.text_column] + ([self.text_pair_column] if self.text_pair_column else [])

    def _load(self, split: str) -> datasets.Dataset:
        """One split, with its columns checked and its blank-text rows dropped (with a warning)."""
        source = self.splits[split]
        dataset = load_split(split, source, self.hub_name, self.hub_config, self.cache_dir)
        text = {"text_column": self.text_column, "text_pair_column": self.text_pair_column}
        require_columns(dataset, split, source, {**text, "label_column": self.label_column})
        require_column_types(dataset, split, source, text, {"label_column": self.label_column})
        return drop_blank_rows(dataset, split, self.text_columns)

    def _setup_train_and_validation(self) -> None:
        train = self._load("train")
        if "validation" not in self.splits and len(train) - math.ceil(len(train) * self.val_fraction) < 1:
            # (datasets rounds the held-out part up)
            raise DataError(
                f"data.splits.train={self.splits['train']!r} has {len(train)} usable row(s), too few to hold out "
                f"data.val_fraction={self.val_fraction} for validation and still train; fix: "
                "data.splits.validation=path/to/val.csv, or more rows"
            )
        if self.label2id is None:
            self.label2id = build_label_map(train, self.label_column, self.splits["train"])
            log.info("Labels -> ids: %s", self.label2id)
        if "validation" in self.splits:
            validation = self._load("validation")
        else:
            parts = train.train_test_split(test_size=self.val_fraction, seed=self.val_split_seed)
            train, validation = parts["train"], parts["test"]
            log.info("No validation split given: took %d rows of train (seed %d)", len(validation), self.val_split_seed)
        self._warn_about_duplicates(train)
        self._warn_about_overlap("validation", validation)
        self.datasets["train"] = self._prepare("train", train)
        self.datasets["validation"] = self._prepare("validation", validation)

    def _texts(self, dataset: datasets.Dataset) -> list[tuple]:
        """Each row's text cells (text, and text pair when there is one)."""
        return list(zip(*(dataset[column] for column in self.text_columns)))

    def _warn_about_duplicates(self, train: datasets.Dataset) -> None:
        """Count duplicate texts (kept: they may be weighting); keep the train texts for :meth:`_warn_about_overlap`."""
        seen = self._texts(train)
        repeated = len(seen) - len(set(seen))
        if repeated:
            log.warning("data.splits.train: %d of %d rows repeat an earlier row's text (kept)", repeated, len(seen))
        self.train_texts = set(seen)

    def _warn_about_overlap(self, split: str, dataset: datasets.Dataset) -> None:
        """Count eval rows whose text is also in train (their scores flatter the model); nothing if train was not read here."""
        if not self.train_texts:
            return
        leaked = sum(1 for row in self._texts(dataset) if row in self.train_texts)
        if leaked:
            log.warning(
                "data.splits.%s: %d of %d rows have the same text as a training row; their scores overstate "
                "the model (fix: remove them from one of the two files)",
                split,
                leaked,
                len(dataset),
            )

    def _prepare(self, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
        """Labels -> ids (refusing unknown ones), then tokenise; both maps are cached by datasets."""
        unknown = sorted({name for name in raw_label_names(dataset, self.label_column) if name not in self.label2id}, key=str)
        if unknown:
            raise DataError(
                f"data.label_column={self.label_column!r}: the {split} split ({self.splits.get(split, 'cut from train')}) "
                f"has labels {unknown[:10]} that the training labels {sorted(self.label2id)} do not include; "
                "fix: correct those rows, or add examples of those labels to train"
            )
        feature = dataset.features[self.label_column]
        class_names = feature.names if isinstance(feature, datasets.ClassLabel) else None
        dataset = dataset.map(
            encode_labels,
            batched=True,
            fn_kwargs={"label_column": self.label_column, "label2id": self.label2id, "class_names": class_names},
            desc=f"Labels of {split}",
        )
        self.split_sizes[split] = len(dataset)
        return self._tokenize(split, dataset, keep=["labels"])

    def _tokenize(self, split: str, dataset: datasets.Dataset, keep: list[str]) -> datasets.Dataset:
        return dataset.map(
            tokenize_batch,
            batched=True,
            fn_kwargs={
                "tokenizer": self.tokenizer,
                "text_column": self.text_column,
                "text_pair_column": self.text_pair_column,
                "max_length": self.max_length,
            },
            remove_columns=[c for c in dataset.column_names if c not in keep],
            desc=f"Tokenizing {split}",
        )

    def _setup_predict(self) -> None:
        if self.predict_file is None:
            raise DataError("no file to predict on; fix: input=path/to/file.csv")
        rows = load_split("predict", self.predict_file, None, None, self.cache_dir)
        fields = {"text_column": self.text_column, "text_pair_column": self.text_pair_column}
        require_columns(rows, "predict", self.predict_file, fields)
        require_column_types(rows, "predict", self.predict_file, fields, {})
        self.predict_rows = rows
        self.datasets["predict"] = self._tokenize("predict", rows, keep=[])

    @property
    def groups_by_length(self) -> bool:
        return self.group_by_length

    def collator(self) -> DataCollatorWithPadding:
        # Multiples of 8 fill fp16/bf16 tensor cores (NVIDIA Deep Learning Performance Guide, "Matrix multiplication background").
        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
