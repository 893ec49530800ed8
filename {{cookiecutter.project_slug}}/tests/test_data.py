"""The classification data module: labels, splits, caching, padding and clear errors."""

from __future__ import annotations

import os

import datasets
import pytest

from {{ cookiecutter.package_name }}.data.classification import ClassificationDataModule
from {{ cookiecutter.package_name }}.data.classification import build_label_map
from {{ cookiecutter.package_name }}.data.loading import DataError

from .conftest import toy_rows, write_csv


@pytest.fixture
def make_datamodule(tokenizer_dir, toy_data, tmp_path):
    def make(**changes) -> ClassificationDataModule:
        options = dict(
            splits={"train": str(toy_data["train"]), "validation": str(toy_data["validation"]), "test": str(toy_data["test"])},
            hub_name=None, hub_config=None, text_column="text", text_pair_column=None, label_column="label",
            tokenizer=str(tokenizer_dir), max_length=32, batch_size=8, val_fraction=0.25, val_split_seed=0,
            num_workers=0, pad_to_multiple_of=8, cache_dir=str(tmp_path / "cache"), fetch=None, group_by_length=False,
        )
        options.update(changes)
        return ClassificationDataModule(**options)

    return make


def test_string_labels_are_sorted_and_mapped_once(make_datamodule):
    datamodule = make_datamodule()
    datamodule.setup("fit")
    assert datamodule.label2id == {"negative": 0, "positive": 1}
    assert datamodule.id2label == {0: "negative", 1: "positive"}
    assert set(datamodule.datasets["train"]["labels"]) == {0, 1}


def test_integer_labels_sort_numerically(tmp_path):
    rows = [{"text": "a", "label": label} for label in (10, 2, 2, 1)]
    dataset = datasets.Dataset.from_list(rows)
    assert build_label_map(dataset, "label", "rows") == {"1": 0, "2": 1, "10": 2}


def test_class_label_columns_keep_their_own_order():
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    dataset = datasets.Dataset.from_dict({"text": ["x", "y"], "label": [1, 0]}, features=features)
    assert build_label_map(dataset, "label", "hub") == {"neg": 0, "pos": 1}


def test_numeric_and_string_spellings_of_a_label_agree(make_datamodule, tmp_path):
    # train.csv has integer labels; test.jsonl has the same labels as strings ("1", not 1)
    train = write_csv(tmp_path / "train.csv", [{"text": "good", "label": 1}, {"text": "bad", "label": 0}] * 4)
    test = tmp_path / "test.jsonl"
    test.write_text('{"text": "good", "label": "1"}\n{"text": "bad", "label": "0"}\n')
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train), "test": str(test)})
    datamodule.setup("fit")
    datamodule.setup("test")
    assert datamodule.label2id == {"0": 0, "1": 1}
    assert datamodule.datasets["test"]["labels"] == [1, 0]


def test_validation_split_is_seeded_and_sized(make_datamodule):
    splits = lambda dm: (dm.setup("fit"), dm.datasets["validation"]["input_ids"])[1]  # noqa: E731
    first = splits(make_datamodule(splits={"train": make_datamodule().splits["train"]}))
    again = splits(make_datamodule(splits={"train": make_datamodule().splits["train"]}))
    other = splits(make_datamodule(splits={"train": make_datamodule().splits["train"]}, val_split_seed=1))
    assert len(first) == 24  # 25% of 96
    assert first == again and first != other


def test_tokenisation_is_cached_across_runs(make_datamodule):
    first = make_datamodule()
    first.setup("fit")
    files = [f["filename"] for f in first.datasets["train"].cache_files]
    assert files, "the tokenised split should be backed by a cache file"
    mtimes = [os.path.getmtime(f) for f in files]
    second = make_datamodule()  # a new object, as in a second run
    second.setup("fit")
    assert [f["filename"] for f in second.datasets["train"].cache_files] == files
    assert [os.path.getmtime(f) for f in files] == mtimes  # re-used, not rewritten


def test_batches_are_dynamically_padded_to_a_multiple_of_8_and_truncated(make_datamodule, tmp_path):
    long_rows = [{"text": " ".join(["good"] * n), "label": "positive" if n % 2 else "negative"} for n in range(1, 60)]
    train = write_csv(tmp_path / "long.csv", long_rows)
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train)}, max_length=20, batch_size=4)
    datamodule.setup("fit")
    lengths = [len(ids) for ids in datamodule.datasets["train"]["input_ids"]]
    assert max(lengths) == 20
    batch = next(iter(datamodule.val_dataloader()))  # rows 1..4 words: 3..6 tokens -> padded to 8
    assert batch["input_ids"].shape == (4, 8)
    assert batch["labels"].shape == (4,)
    for batch in datamodule.train_dataloader():
        assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] <= 24


def test_length_grouped_batches_hold_similar_lengths(make_datamodule, tmp_path):
    rows = [{"text": " ".join(["good"] * (1 + i % 30)), "label": "positive" if i % 2 else "negative"} for i in range(240)]
    train = write_csv(tmp_path / "mixed.csv", rows)
    padded = {}
    for grouped in (False, True):
        datamodule = make_datamodule(splits={"train": str(train), "validation": str(train)}, group_by_length=grouped, pad_to_multiple_of=None)
        datamodule.setup("fit")
        batches = list(datamodule.train_dataloader())
        assert sum(len(b["labels"]) for b in batches) == 240  # every training row once
        padded[grouped] = sum(b["input_ids"].numel() for b in batches)
    assert padded[True] < 0.75 * padded[False]


def test_text_pairs_get_segment_ids(make_datamodule, tmp_path):
    rows = [{"premise": "good movie", "hypothesis": "bad plot", "label": label} for label in ("yes", "no")] * 4
    train = write_csv(tmp_path / "pairs.csv", rows)
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train)}, text_column="premise", text_pair_column="hypothesis")
    datamodule.setup("fit")
    assert 1 in datamodule.datasets["train"]["token_type_ids"][0]


def test_tokenizer_parallelism_is_off_before_workers_fork(make_datamodule, monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    datamodule = make_datamodule()
    datamodule.setup("fit")
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # tokenising in setup uses every core
    datamodule.num_workers = 1
    datamodule.train_dataloader()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # set before the workers fork


@pytest.mark.parametrize("field", ["text_column", "label_column"])
def test_missing_column_names_the_field_and_the_columns(make_datamodule, field):
    datamodule = make_datamodule(**{field: "nope"})
    with pytest.raises(DataError) as error:
        datamodule.setup("fit")
    message = str(error.value)
    assert f"data.{field}='nope' is not a column" in message and "['text', 'label']" in message and "fix:" in message


def test_empty_file_is_a_clear_error(make_datamodule, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DataError, match=r"data.splits.train=.*empty.csv' is empty"):
        make_datamodule(splits={"train": str(empty)}).setup("fit")


def test_header_only_file_is_a_clear_error(make_datamodule, tmp_path):
    header = tmp_path / "header.csv"
    header.write_text("text,label\n")
    with pytest.raises(DataError, match="has a header but no rows"):
        make_datamodule(splits={"train": str(header)}).setup("fit")


def test_missing_file_is_a_clear_error(make_datamodule, tmp_path):
    with pytest.raises(DataError, match=r"data.splits.validation=.*nothere.csv' does not exist"):
        make_datamodule(splits={"train": make_datamodule().splits["train"], "validation": str(tmp_path / "nothere.csv")}).setup("fit")


def test_unknown_label_in_test_names_it_and_the_split(make_datamodule, tmp_path):
    test = write_csv(tmp_path / "test.csv", toy_rows(4, seed=3) + [{"text": "good film", "label": "neutral"}])
    datamodule = make_datamodule(splits={**make_datamodule().splits, "test": str(test)})
    with pytest.raises(DataError) as error:
        datamodule.setup("fit")  # before training, not after it
    assert "the test split" in str(error.value) and "['neutral']" in str(error.value)


def test_single_class_training_set_is_refused(make_datamodule, tmp_path):
    train = write_csv(tmp_path / "one.csv", [{"text": "good", "label": "positive"}] * 8)
    with pytest.raises(DataError, match="at least two classes"):
        make_datamodule(splits={"train": str(train)}).setup("fit")
