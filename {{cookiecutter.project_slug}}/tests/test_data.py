"""The classification data module: labels, splits, caching, padding and clear errors."""

from __future__ import annotations

import csv
import os

import datasets
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from {{ cookiecutter.package_name }}.core.data.loading import load_split
from {{ cookiecutter.package_name }}.core.errors import DataError
from {{ cookiecutter.package_name }}.tasks.classification.data import ClassificationDataModule, build_label_map, label_key

from .conftest import toy_rows, write_csv


@pytest.fixture
def make_datamodule(tokenizer_dir, toy_data, tmp_path):
    def make(**changes) -> ClassificationDataModule:
        options = dict(
            splits={"train": str(toy_data["train"]), "validation": str(toy_data["validation"]), "test": str(toy_data["test"])},
            hub_name=None,
            hub_config=None,
            text_column="text",
            text_pair_column=None,
            label_column="label",
            tokenizer=str(tokenizer_dir),
            max_length=32,
            batch_size=8,
            val_fraction=0.25,
            val_split_seed=0,
            num_workers=0,
            pad_to_multiple_of=8,
            cache_dir=str(tmp_path / "cache"),
            fetch=None,
            group_by_length=False,
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


def test_a_label_is_known_by_one_string_however_a_file_spells_it():
    assert label_key(1) == label_key(1.0) == label_key("1") == label_key("1.0") == label_key(" 1.00 ") == "1"
    assert label_key("007") == "007" and label_key("NA") == "NA" and label_key(None) is None


def test_integer_labels_sort_numerically(tmp_path):
    rows = [{"text": "a", "label": label} for label in (10, 2, 2, 1)]
    dataset = datasets.Dataset.from_list(rows)
    assert build_label_map(dataset, "label", "rows") == {"1": 0, "2": 1, "10": 2}


def test_labels_that_differ_only_in_case_stay_apart_with_a_warning(caplog):
    dataset = datasets.Dataset.from_dict({"label": ["Positive", " positive ", "negative", "NEGATIVE", "neutral"]})
    assert build_label_map(dataset, "label", "rows.csv") == {"NEGATIVE": 0, "Positive": 1, "negative": 2, "neutral": 3, "positive": 4}
    warnings = [r.getMessage() for r in caplog.records if "differ only in case" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "['Positive', 'positive']" in " ".join(warnings) and "['NEGATIVE', 'negative']" in " ".join(warnings)
    assert all("fix: spell them one way" in w for w in warnings)


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


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_csv_and_tsv_cells_are_read_as_written_so_na_is_a_label(make_datamodule, tmp_path, suffix, sep):
    words = ["good", "bad", "fine", "null", "None", "n/a", "NA", "nan"]
    rows = [{"text": words[i % len(words)], "label": ["positive", "negative", "NA"][i % 3], "id": f"00{i}"} for i in range(12)]
    train = tmp_path / f"train{suffix}"
    with train.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["text", "label", "id"], delimiter=sep)
        writer.writeheader()
        writer.writerows(rows)
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train), "test": str(train)})
    datamodule.setup("fit")
    assert datamodule.label2id == {"NA": 0, "negative": 1, "positive": 2}
    assert len(datamodule.datasets["train"]) + len(datamodule.datasets["validation"]) == 24  # (the train file twice)
    loaded = load_split("train", str(train), None, None, str(tmp_path / "cache"))
    assert loaded["text"] == [r["text"] for r in rows] and loaded["id"] == [r["id"] for r in rows]  # "007" stays "007"


def test_an_empty_label_cell_is_a_row_without_a_label(make_datamodule, tmp_path):
    rows = [{"text": "good", "label": "1"}, {"text": "bad", "label": "0"}, {"text": "so-so", "label": ""}]
    train = write_csv(tmp_path / "train.csv", rows)
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train), "test": str(train)})
    with pytest.raises(DataError, match="some rows of the train split .* have no label"):
        datamodule.setup("fit")


def test_a_csv_saved_with_its_index_and_a_repeated_column_name_loads(tmp_path):
    path = tmp_path / "saved.csv"
    path.write_text(",text,text\n0,a,b\n1,c,d\n")
    loaded = load_split("train", str(path), None, None, str(tmp_path / "cache"))
    assert loaded.column_names == ["Unnamed: 0", "text", "text.1"] and loaded["text.1"] == ["b", "d"]


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".csv", 'review,sentiment\n"good, fine",pos\nbad,neg\n'),
        (".tsv", "review\tsentiment\ngood, fine\tpos\nbad\tneg\n"),
        (".jsonl", '{"review": "good, fine", "sentiment": "pos"}\n{"review": "bad", "sentiment": "neg"}\n'),
    ],
)
def test_a_file_saved_with_a_byte_order_mark_loads_with_its_first_column_named_as_written(tmp_path, suffix, text):
    """Excel's "CSV UTF-8" starts the file with a byte-order mark: it belongs to no column name."""
    path = tmp_path / f"excel{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    loaded = load_split("train", str(path), None, None, str(tmp_path / "cache"))
    assert loaded.column_names == ["review", "sentiment"]
    assert loaded["review"] == ["good, fine", "bad"] and loaded["sentiment"] == ["pos", "neg"]


@pytest.mark.parametrize(("suffix", "sep"), [(".csv", ","), (".tsv", "\t")])
def test_a_row_with_more_cells_than_the_header_is_refused_naming_its_line(tmp_path, suffix, sep):
    for header, row, cells in (
        ("text", f"A gorgeous{sep} witty{sep} seductive movie.", 1),
        (f"text{sep}label", f"bad{sep} awful{sep}negative", 2),
    ):
        path = tmp_path / f"unquoted{cells}{suffix}"
        path.write_text(
            f"{header}\n{row.replace(sep, '') if cells == 1 else 'good' + sep + 'positive'}\n{row}\n"
        )  # pandas: an index, or a parse error
        with pytest.raises(DataError, match=rf"input=.*: line 3 has 3 cells but the header has {cells} .*fix: quote cells"):
            load_split("predict", str(path), None, None, str(tmp_path / "cache"))


@pytest.mark.parametrize("rows, ranks", [(5, 2), (41, 2), (7, 3), (2, 4), (8, 2), (1, 1)])
@pytest.mark.parametrize("ordered", [False, True])
def test_each_rank_evaluates_its_own_rows_and_every_row_once(rows, ranks, ordered):
    from {{ cookiecutter.package_name }}.core.data.sampling import EvaluationShardSampler

    order = sorted(range(rows), key=lambda row: -(row * 7 % 5)) if ordered else None  # (a length order)
    shards = [list(EvaluationShardSampler(rows, ranks, rank, order)) for rank in range(ranks)]
    assert sorted(i for shard in shards for i in shard) == list(range(rows))
    assert [len(EvaluationShardSampler(rows, ranks, rank, order)) for rank in range(ranks)] == [len(shard) for shard in shards]
    if ordered:  # each rank keeps the order's sequence
        assert all(shard == [row for row in order if row in shard] for shard in shards)


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
        datamodule = make_datamodule(
            splits={"train": str(train), "validation": str(train)}, group_by_length=grouped, pad_to_multiple_of=None
        )
        datamodule.setup("fit")
        batches = list(datamodule.train_dataloader())
        assert sum(len(b["labels"]) for b in batches) == 240  # every training row once
        padded[grouped] = sum(b["input_ids"].numel() for b in batches)
    assert padded[True] < 0.75 * padded[False]


def mixed_length_rows(n: int) -> list[dict[str, str]]:
    """Rows of 1..30 words in an order unrelated to their length."""
    return [{"text": " ".join(["good"] * (1 + 7 * i % 30)), "label": "positive" if i % 2 else "negative"} for i in range(n)]


def in_its_own_order(datamodule, split: str = "validation") -> DataLoader:
    """``split``'s batches in the file's order (what evaluation ran before it sorted)."""
    return DataLoader(datamodule.datasets[split], batch_size=datamodule.batch_size, collate_fn=datamodule.collator())


def token_ids(batch: dict) -> list[list[int]]:
    """Each row's token ids in ``batch``, without its padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_evaluation_runs_the_longest_rows_first_every_row_once_with_less_padding(make_datamodule, tmp_path):
    rows = write_csv(tmp_path / "mixed.csv", mixed_length_rows(90))
    datamodule = make_datamodule(splits={"train": str(rows), "validation": str(rows)}, group_by_length=True)
    datamodule.setup("fit")
    batches = list(datamodule.val_dataloader())
    widths = [batch["input_ids"].shape[1] for batch in batches]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    evaluated = [ids for batch in batches for ids in token_ids(batch)]
    assert sorted(evaluated) == sorted(datamodule.datasets["validation"]["input_ids"])  # every row once, as tokenised
    own = in_its_own_order(datamodule)
    assert sum(batch["input_ids"].numel() for batch in batches) < 0.75 * sum(batch["input_ids"].numel() for batch in own)


def test_each_rows_logits_are_the_same_in_the_evaluation_order_as_in_the_splits_own(make_datamodule, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    rows = write_csv(tmp_path / "mixed.csv", mixed_length_rows(40))
    datamodule = make_datamodule(splits={"train": str(rows), "validation": str(rows)}, group_by_length=True)
    datamodule.setup("fit")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(datamodule.tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = BertForSequenceClassification(config).eval()

    def logits(loader) -> torch.Tensor:  # (rows, num_labels), in the loader's order
        with torch.inference_mode():
            return torch.cat([model(**{k: v for k, v in batch.items() if k != "labels"}).logits for batch in loader])

    order = datamodule.evaluation_order("validation")
    assert order is not None and order != sorted(order)
    sorted_logits = logits(datamodule.val_dataloader())
    own_logits = logits(in_its_own_order(datamodule))
    torch.testing.assert_close(sorted_logits, own_logits[order], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("limit", [0.5, 3, 1])
def test_a_limited_evaluation_keeps_the_splits_own_order_so_its_batches_are_a_sample(make_datamodule, tmp_path, limit):
    rows = write_csv(tmp_path / "mixed.csv", mixed_length_rows(90))
    datamodule = make_datamodule(splits={"train": str(rows), "validation": str(rows), "test": str(rows)}, group_by_length=True)
    datamodule.setup("fit")
    datamodule.setup("test")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    datamodule.trainer = trainer
    assert datamodule.evaluation_order("validation") is not None and datamodule.evaluation_order("test") is not None
    for split, setting in (("validation", "limit_val_batches"), ("test", "limit_test_batches")):
        setattr(trainer, setting, limit)
        assert datamodule.evaluation_order(split) is None, split
        first = next(iter(datamodule.val_dataloader() if split == "validation" else datamodule.test_dataloader()))
        assert token_ids(first) == datamodule.datasets[split]["input_ids"][:8]


def test_without_length_grouping_evaluation_keeps_the_splits_own_order(make_datamodule):
    datamodule = make_datamodule(group_by_length=False)
    datamodule.setup("fit")
    assert datamodule.evaluation_order("validation") is None


def test_text_pairs_get_segment_ids(make_datamodule, tmp_path):
    rows = [{"premise": "good movie", "hypothesis": "bad plot", "label": label} for label in ("yes", "no")] * 4
    train = write_csv(tmp_path / "pairs.csv", rows)
    datamodule = make_datamodule(
        splits={"train": str(train), "validation": str(train)}, text_column="premise", text_pair_column="hypothesis"
    )
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


# ------------------------------------------------------------------ messy files (edge cases)
def test_blank_and_missing_texts_are_dropped_with_a_count(make_datamodule, tmp_path, caplog):
    rows = toy_rows(12, seed=3) + [{"text": "", "label": "positive"}, {"text": "   \t", "label": "negative"}]
    train = write_csv(tmp_path / "train.csv", rows + [{"text": None, "label": "negative"}])  # None -> an empty CSV cell
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train)})
    datamodule.setup("fit")
    assert len(datamodule.datasets["train"]) == 12
    assert "dropped 3 of 15 rows whose text is empty, whitespace or missing" in caplog.text


def test_a_file_of_only_blank_texts_is_refused(make_datamodule, tmp_path):
    train = write_csv(tmp_path / "blank.csv", [{"text": " ", "label": "positive"}, {"text": "", "label": "negative"}])
    with pytest.raises(DataError, match=r"data.splits.train: all 2 row\(s\) have empty or whitespace-only text"):
        make_datamodule(splits={"train": str(train)}).setup("fit")


def test_duplicates_are_kept_and_counted_and_leaks_into_validation_and_test_named(make_datamodule, tmp_path, caplog):
    rows = toy_rows(10, seed=4)
    train = write_csv(tmp_path / "train.csv", rows + rows[:3])
    validation = write_csv(tmp_path / "validation.csv", rows[:2] + toy_rows(6, seed=5))
    test = write_csv(tmp_path / "test.csv", rows[5:9] + toy_rows(3, seed=6))
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(validation), "test": str(test)})
    datamodule.setup("fit")
    assert len(datamodule.datasets["train"]) == 13
    assert "3 of 13 rows repeat an earlier row's text (kept)" in caplog.text
    assert "data.splits.validation: 2 of 8 rows have the same text as a training row" in caplog.text
    assert "data.splits.test: 4 of 7 rows have the same text as a training row" in caplog.text
    assert len(datamodule.datasets["test"]) == 7  # counted, not removed


def test_non_utf8_csv_names_the_file_and_the_byte(make_datamodule, tmp_path):
    train = tmp_path / "latin1.csv"
    train.write_bytes("text,label\ncafé good,positive\nbad,negative\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.csv \(byte 14: b'\\xe9'\) is not UTF-8 text; fix: re-encode it"):
        make_datamodule(splits={"train": str(train), "validation": str(train)}).setup("fit")


def test_a_very_long_text_keeps_its_first_max_length_tokens(make_datamodule, tmp_path):
    long_text = " ".join(["good"] + ["movie"] * 50_000)
    train = write_csv(tmp_path / "train.csv", [{"text": long_text, "label": "positive"}, {"text": "bad", "label": "negative"}])
    datamodule = make_datamodule(splits={"train": str(train), "validation": str(train)}, max_length=32)
    datamodule.setup("fit")
    lengths = sorted(len(ids) for ids in datamodule.datasets["train"]["input_ids"])
    assert lengths[-1] == 32
    first = datamodule.datasets["train"].filter(lambda row: len(row["input_ids"]) == 32)[0]["input_ids"]
    assert datamodule.tokenizer.convert_ids_to_tokens(first[:3]) == ["[CLS]", "good", "movie"]


def test_a_train_file_too_small_to_hold_out_validation_is_refused(make_datamodule, tmp_path):
    rows = [{"text": "good fun", "label": "positive"}, {"text": " ", "label": "negative"}, {"text": "bad", "label": "negative"}]
    train = write_csv(tmp_path / "train.csv", rows[:2])  # one usable row once the blank one is dropped
    with pytest.raises(DataError, match=r"has 1 usable row\(s\), too few to hold out data.val_fraction=0.25"):
        make_datamodule(splits={"train": str(train)}).setup("fit")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("broken.jsonl", '{"text": "good", "label": "positive"}\n{"text": "bad", label: "negative"}\n', "JSON parse error"),
    ],
)
def test_a_file_that_does_not_parse_names_the_reader_error_and_the_format(make_datamodule, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"data.splits.train=.*{name}' cannot be read as .*{message}.*; fix: "):
        make_datamodule(splits={"train": str(path), "validation": str(path)}).setup("fit")
