"""The causal-LM text pipeline: collation, packing, document splitting, EOS, bad input."""

from __future__ import annotations

import json
import random

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from {{ cookiecutter.package_name }}.core.errors import DataError
from {{ cookiecutter.package_name }}.tasks.causal_lm.text import CausalLMCollator, TextDataModule, pack_documents


@pytest.fixture
def make_text_dm(lm_tokenizer_dir, tmp_path):
    def make(**changes) -> TextDataModule:
        options = dict(
            splits={"train": None, "validation": None, "test": None},
            hub_name=None,
            hub_config=None,
            text_column="text",
            sample_by="document",
            tokenizer=str(lm_tokenizer_dir),
            mode="pack",
            max_length=16,
            batch_size=4,
            val_fraction=0.25,
            val_split_seed=0,
            num_workers=0,
            pad_to_multiple_of=8,
            group_by_length=True,
            cache_dir=str(tmp_path / "cache"),
            fetch=None,
        )
        options.update(changes)
        return TextDataModule(**options)

    return make


def test_collation_of_hand_made_ids_masks_labels_from_the_attention_mask():
    # pad id 2 is also the EOS id (GPT-2/SmolLM2 style): the real EOS at the end of row 1 stays a label.
    batch = CausalLMCollator(pad_token_id=2)([{"input_ids": [5, 6, 7, 2]}, {"input_ids": [8, 2]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2], [8, 2, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 2], [8, 2, -100, -100]]
    padded = CausalLMCollator(pad_token_id=0, pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}])
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7] + [-100] * 5]
    assert all(t.dtype == torch.long for t in padded.values())


@pytest.mark.parametrize("batch_size", [1, 3, 1000])
def test_packing_keeps_every_token_once_and_only_the_splits_last_block_is_short(batch_size):
    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(rng.randint(1, 50))] for _ in range(40)]
    tokenized = datasets.Dataset.from_dict({"input_ids": docs, "length": [len(doc) for doc in docs]})
    for block_size in (1, 7, 16, 64, 10_000):
        packed = pack_documents(tokenized, block_size, batch_size=batch_size)
        blocks = packed["input_ids"]
        assert [t for block in blocks for t in block] == [t for doc in docs for t in doc]
        assert all(len(block) == block_size for block in blocks[:-1])  # whatever the map batches
        assert 1 <= len(blocks[-1]) <= block_size and packed["length"] == [len(block) for block in blocks]


def test_documents_end_with_eos_and_every_batch_has_targets(make_text_dm, lm_text, lm_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    assert tokenizer.pad_token is None  # GPT-2 style: works without manual setup
    dm = make_text_dm(splits={"train": str(lm_text["train"]), "validation": str(lm_text["validation"])}, mode="pad", max_length=128)
    dm.setup("fit")
    assert dm.split_sizes == {"train": 24, "validation": 1}
    first = dm.datasets["train"][0]["input_ids"]
    assert first[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in first[:-1]
    for batch in dm.train_dataloader():
        assert int((batch["labels"][:, 1:] != -100).sum()) > 0
        assert batch["input_ids"].shape[1] % 8 == 0


def test_pack_mode_pads_only_its_last_block(make_text_dm, lm_text):
    padded = {}
    for mode in ("pack", "pad"):
        dm = make_text_dm(splits={"train": str(lm_text["train"]), "validation": str(lm_text["validation"])}, mode=mode, max_length=32)
        dm.setup("fit")
        real = total = 0
        for batch in dm.train_dataloader():
            real, total = real + int(batch["attention_mask"].sum()), total + batch["attention_mask"].numel()
        padded[mode] = total - real
        assert real == dm.token_counts["train"]  # every kept token reaches a batch exactly once
    # One map batch of documents -> one short block at most, padded to the block size.
    assert padded["pack"] < 32 < padded["pad"], padded


def test_paragraph_mode_splits_on_blank_lines_and_holds_out_validation(make_text_dm, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the king speaks {i}.\nthe fool answers." for i in range(8)) + "\n")
    dm = make_text_dm(splits={"train": str(corpus)}, sample_by="paragraph")
    dm.setup("fit")
    assert dm.split_sizes == {"train": 6, "validation": 2}  # 8 paragraphs, 25 % held out


def test_jsonl_with_a_text_column_and_blank_rows(make_text_dm, tmp_path):
    rows = [{"body": "the king speaks."}, {"body": "   "}, {"body": ""}, {"body": "a fool answers the queen."}]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = make_text_dm(splits={"train": str(path), "validation": str(path)}, text_column="body")
    dm.setup("fit")
    assert dm.split_sizes["train"] == 2  # the blank rows are dropped (and logged)
    with pytest.raises(DataError, match=r"data.text_column='text' is not a column .*\['body'\]"):
        make_text_dm(splits={"train": str(path), "validation": str(path)}).setup("fit")


def test_a_csv_corpus_keeps_text_cells_that_read_like_missing_values(make_text_dm, tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("body\nNA\nnull\nNone\nn/a\nthe king speaks.\n\n")
    dm = make_text_dm(splits={"train": str(path), "validation": str(path)}, text_column="body")
    dm.setup("fit")
    assert dm.split_sizes["train"] == 5  # NA, null, None and n/a are text; only the empty line is no row


@pytest.mark.parametrize("content", ["", "\n\n   \n\n"], ids=["empty", "only-blank-lines"])
def test_a_file_without_text_is_refused(make_text_dm, tmp_path, content):
    path = tmp_path / "train.txt"
    path.write_text(content)
    with pytest.raises(DataError, match=r"data.splits.train=.*(is empty|has no text)"):
        make_text_dm(splits={"train": str(path), "validation": str(path)}).setup("fit")


@pytest.mark.parametrize("name", ["nope.txt", "nope_dir", "nope_dir/", "nope.jsonl"])
def test_missing_paths_are_refused(make_text_dm, tmp_path, name):
    with pytest.raises(DataError, match=r"data.splits.train=.*nope.* does not exist; fix: .*folder of .txt files"):
        make_text_dm(splits={"train": str(tmp_path / name)}).setup("fit")


def test_a_folder_without_txt_files_is_refused(make_text_dm, tmp_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "notes.md").write_text("the king.")
    with pytest.raises(DataError, match="folder with no .txt files"):
        make_text_dm(splits={"train": str(tmp_path / "empty_dir")}).setup("fit")


def test_non_utf8_text_names_the_file_and_the_byte(make_text_dm, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the king speaks.\n")
    (folder / "b.txt").write_bytes("the queen of caf\u00e9s.\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"b.txt \(byte 16: b'\\xe9'\) is not UTF-8 text; fix: re-encode"):
        make_text_dm(splits={"train": str(folder)}).setup("fit")


def test_one_document_cannot_be_split_into_train_and_validation(make_text_dm, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("the king speaks.\n")
    with pytest.raises(DataError, match="too few to cut a validation split"):
        make_text_dm(splits={"train": str(path)}).setup("fit")
