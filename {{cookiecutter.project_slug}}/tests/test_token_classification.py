"""Token classification: span scoring against hand counts, the CoNLL reader, sub-token alignment,
bad input refused before any weights load, and train -> eval -> predict on a tiny BERT."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.tasks.token_classification.data import read_conll
from {{ cookiecutter.package_name }}.tasks.token_classification.spans import EntityScores, entity_spans

from .conftest import common_overrides, compose_config, with_task

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PEOPLE = ["alice", "bob", "carol", "dave"]
PLACES = ["paris", "london", "rome"]  # "london" is two sub-tokens: lon ##don
WORDS = ["visited", "met", "works", "at", "in", "acme", "corp", "today", "and"]


def ner_rows(n: int, seed: int) -> list[dict]:
    """``n`` sentences with IOB2 tags: people (PER), places (LOC) and "acme corp" (ORG, two words)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        person, place = rng.choice(PEOPLE), rng.choice(PLACES)
        shape = rng.randrange(3)
        if shape == 0:
            tokens, tags = [person, "visited", place], ["B-PER", "O", "B-LOC"]
        elif shape == 1:
            tokens, tags = [person, "works", "at", "acme", "corp"], ["B-PER", "O", "O", "B-ORG", "I-ORG"]
        else:
            other = rng.choice([p for p in PEOPLE if p != person])
            tokens, tags = [person, "met", other, "in", place, "today"], ["B-PER", "O", "B-PER", "O", "B-LOC", "O"]
        rows.append({"tokens": tokens, "tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_conll(path: Path, rows: list[dict], docstart: bool = True) -> Path:
    """CoNLL-2003 layout: word, two filler columns, tag; a -DOCSTART- line first."""
    lines = ["-DOCSTART- -X- -X- O", ""] if docstart else []
    for row in rows:
        lines += [f"{word} X B-NP {tag}" for word, tag in zip(row["tokens"], row["tags"])] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_ner_tokenizer(folder: Path) -> Path:
    """A WordPiece tokenizer of the toy NER words ("london" is two sub-tokens), saved in ``folder``."""
    from transformers import BertTokenizer

    vocab = SPECIALS + PEOPLE + ["paris", "rome", "lon", "##don"] + WORDS
    BertTokenizer(vocab={token: index for index, token in enumerate(vocab)}).save_pretrained(folder)
    return folder


def make_ner_data(folder: Path) -> dict[str, Path]:
    """Train (CoNLL), validation (jsonl) and test (CoNLL) files of toy NER sentences in ``folder``."""
    return {
        "train": write_conll(folder / "train.conll", ner_rows(120, seed=0)),
        "validation": write_jsonl(folder / "validation.jsonl", ner_rows(30, seed=1)),
        "test": write_conll(folder / "test.conll", ner_rows(30, seed=2)),
    }


@pytest.fixture(scope="session")
def ner_tokenizer_dir(tmp_path_factory) -> Path:
    return make_ner_tokenizer(tmp_path_factory.mktemp("ner_tokenizer"))


@pytest.fixture(scope="session")
def ner_data(tmp_path_factory) -> dict[str, Path]:
    return make_ner_data(tmp_path_factory.mktemp("ner_data"))


def ner_overrides(tokenizer_dir: Path, data: dict[str, Path], run_dir: Path) -> list[str]:
    """Overrides that make a token classification train/eval/predict config run offline in seconds."""
    return [
        "task=token_classification",
        "model=tiny_bert",
        f"model.tokenizer={tokenizer_dir}",
        f"data.splits.train={data['train']}",
        f"data.splits.validation={data['validation']}",
        f"data.splits.test={data['test']}",
        "data.max_length=16",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=16",
        *common_overrides(run_dir),
    ]


# ---------------------------------------------------------------------------------------- spans
@pytest.mark.parametrize(
    ("tags", "scheme", "strict", "spans", "invalid"),
    [
        (["B-PER", "I-PER", "O", "B-LOC"], "IOB2", False, {("PER", 0, 1), ("LOC", 3, 3)}, 0),
        # conlleval: an I- after O begins an entity; I-LOC after I-PER another
        (["O", "I-PER", "I-PER", "I-LOC"], "IOB2", False, {("PER", 1, 2), ("LOC", 3, 3)}, 2),
        # strict: neither is an entity, each such tag counted
        (["O", "I-PER", "I-PER", "I-LOC"], "IOB2", True, set(), 3),
        (["B-PER", "B-PER", "I-PER"], "BIO", True, {("PER", 0, 0), ("PER", 1, 2)}, 0),
        (["B-ORG", "I-ORG", "E-ORG", "S-PER", "O"], "BIOES", True, {("ORG", 0, 2), ("PER", 3, 3)}, 0),
        # strict BIOES: B- without its E- is no entity; default mode keeps it
        (["B-ORG", "I-ORG", "O", "S-LOC"], "BIOES", True, {("LOC", 3, 3)}, 1),
        (["B-ORG", "I-ORG", "O", "S-LOC"], "BIOES", False, {("ORG", 0, 1), ("LOC", 3, 3)}, 0),
        (["NN", "VB", "O", "NN"], "none", False, {("NN", 0, 0), ("VB", 1, 1), ("NN", 3, 3)}, 0),
        # IOB1 (CoNLL-2003 as published): I- begins an entity, B- only splits two of one type
        (["I-PER", "I-PER", "B-PER", "O", "I-LOC"], "IOB1", False, {("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 4)}, 0),
    ],
)
def test_entity_spans(tags, scheme, strict, spans, invalid):
    assert entity_spans(tags, scheme, strict) == (spans, invalid)


def test_entity_f1_matches_a_hand_count():
    """Two sentences, counted by hand: gold PER(0-1), LOC(3), ORG(0-2), PER(4); predicted
    PER(0-1) right, LOC(3) right, ORG(0-1) wrong boundary, LOC(4) wrong type.
    tp 2, predicted 4, gold 4 -> P = R = F1 = 0.5; PER: tp 1 of pred 1 / gold 2 -> F1 2/3;
    LOC: tp 1, pred 2, gold 1 -> F1 2/3; ORG: 0."""
    names = ["O", "B-LOC", "B-ORG", "B-PER", "I-LOC", "I-ORG", "I-PER"]
    ids = {name: i for i, name in enumerate(names)}
    gold = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["B-ORG", "I-ORG", "I-ORG", "O", "B-PER"]]
    guess = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["B-ORG", "I-ORG", "O", "O", "B-LOC"]]

    def as_ids(rows):  # with a special position (-100) in front, as the data gives
        return torch.tensor([[-100] + [ids[t] for t in row] for row in rows])

    metric = EntityScores(dict(enumerate(names)), "IOB2", strict=False)
    predicted = as_ids(guess)
    predicted[:, 0] = 0
    metric.update(predicted, as_ids(gold), as_ids(gold)[:, 1:], torch.ones(2, 5, dtype=torch.long))
    scores = metric.compute()
    assert scores["precision"].item() == pytest.approx(0.5) and scores["recall"].item() == pytest.approx(0.5)
    assert scores["f1"].item() == pytest.approx(0.5)
    assert scores["f1_PER"].item() == pytest.approx(2 / 3) and scores["f1_LOC"].item() == pytest.approx(2 / 3)
    assert scores["f1_ORG"].item() == 0.0 and scores["invalid_tags"].item() == 0


def test_entities_in_words_the_model_did_not_see_are_misses():
    """Gold PER(0-1), LOC(4): the model saw words 0, 1 and 3 (2 has no sub-token, 4 was cut) and tagged them right. Scored
    over what it saw, recall would be 1; against the gold file LOC is a miss: P 1/1, R 1/2 (as conlleval on the same file)."""
    names = ["O", "B-LOC", "B-PER", "I-PER"]
    gold = torch.tensor([[2, 3, 0, 0, 1, -100]])  # (B, W): one row of 5 words, padded
    kept = torch.tensor([[1, 1, 0, 1, 0, 0]])
    labels = torch.tensor([[-100, 2, 3, 0, -100]])  # [CLS] w0 w1 w3 [SEP]
    metric = EntityScores(dict(enumerate(names)), "IOB2", strict=False)
    metric.update(labels.clamp(min=0), labels, gold, kept)
    scores = metric.compute()
    assert scores["precision"].item() == 1.0 and scores["recall"].item() == pytest.approx(0.5)
    assert scores["f1_PER"].item() == 1.0 and scores["f1_LOC"].item() == 0.0


# ---------------------------------------------------------------------------------------- data
def test_conll_reader_skips_docstart_counts_empty_sentences_and_picks_the_tag_column(tmp_path):
    path = tmp_path / "a.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\nPeter NNP B-NP B-PER\n")
    rows, empty = read_conll(str(path), "data.splits.train", -1)
    assert rows == {"tokens": [["EU", "rejects"], ["Peter"]], "tags": [["B-ORG", "O"], ["B-PER"]], "line": [3, 7]}
    assert empty == 1
    assert read_conll(str(path), "data.splits.train", 1)[0]["tags"] == [["NNP", "VBZ"], ["NNP"]]
    path.write_text("EU B-ORG\n\n\n\n")  # blank lines at the end: no sentence follows, none counted
    assert read_conll(str(path), "data.splits.train", -1)[1] == 0
    path.write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP\n")  # a line that lost its entity column
    with pytest.raises(DataError, match=r"line 2: 'rejects VBZ B-VP' has 3 column\(s\), the file's first word line 4; fix"):
        read_conll(str(path), "data.splits.train", -1)
    path.write_text("EU B-ORG\nrejects\n")
    with pytest.raises(DataError, match=r"line 2: 'rejects' has 1 column\(s\), no tag column data.conll_tag_column=-1"):
        read_conll(str(path), "data.splits.train", -1)


def datamodule(ner_tokenizer_dir, splits: dict, **changes):
    from transformers import AutoTokenizer

    from {{ cookiecutter.package_name }}.tasks.token_classification.data import TokenTagsDataModule

    args = dict(
        splits=splits, hub_name=None, hub_config=None, tokens_column="tokens", tags_column="tags", format="auto",
        conll_tag_column=-1, scheme="IOB2", strict=False, tokenizer=AutoTokenizer.from_pretrained(ner_tokenizer_dir),
        max_length=16, batch_size=4, val_fraction=0.2, val_split_seed=0, num_workers=0, pad_to_multiple_of=8,
        group_by_length=False, cache_dir=None, fetch=None, seed=0,
    )  # fmt: skip
    return TokenTagsDataModule(**{**args, **changes})


def test_tags_go_on_each_words_first_sub_token_and_cut_words_are_counted(ner_tokenizer_dir, tmp_path):
    rows = [{"tokens": ["alice", "visited", "london"], "tags": ["B-PER", "O", "B-LOC"]}] * 4
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dm = datamodule(ner_tokenizer_dir, {"train": str(train), "validation": str(train)})
    dm.setup("fit")
    assert dm.label2id == {"O": 0, "B-LOC": 1, "B-PER": 2}
    row = dm.datasets["train"][0]
    # [CLS] alice visited lon ##don [SEP]: the tag on "lon", -100 on "##don" and the specials
    assert row["labels"] == [-100, 2, 0, 1, -100, -100] and row["words_cut"] == 0
    batch = next(iter(dm.train_dataloader()))
    assert batch["labels"].shape == batch["input_ids"].shape == (4, 8)  # padded to a multiple of 8, labels with -100
    assert (batch["labels"][:, 6:] == -100).all() and batch["words_cut"].tolist() == [0, 0, 0, 0]

    short = datamodule(ner_tokenizer_dir, {"train": str(train), "validation": str(train)}, max_length=4)
    short.setup("fit")  # [CLS] alice visited [SEP]: "london" cut
    assert short.datasets["train"][0]["labels"] == [-100, 2, 0, -100] and short.words_cut["train"] == 4
    assert short.datasets["train"][0]["word_kept"] == [1, 1, 0] and short.datasets["train"][0]["words_no_token"] == 0


# Words the WordPiece tokenizer makes nothing of: zero-width space, soft hyphen, variation selector, a lone combining accent.
NO_TOKEN_WORDS = ["\u200b", "\u00ad", "\ufe0f", "\u0301", "\u200b\u00ad"]


@pytest.mark.parametrize("word", NO_TOKEN_WORDS)
def test_a_word_without_a_sub_token_keeps_its_place_and_is_counted_as_such(ner_tokenizer_dir, tmp_path, word, caplog):
    rows = [{"tokens": ["alice", word, "visited", "london"], "tags": ["B-PER", "O", "O", "B-LOC"]}] * 4
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dm = datamodule(ner_tokenizer_dir, {"train": str(train), "validation": str(train)}, max_length=5)
    dm.setup("fit")  # [CLS] alice visited lon [SEP]: "##don" cut, no word cut
    row = dm.datasets["train"][0]
    assert row["labels"] == [-100, 2, 0, 1, -100] and row["word_tags"] == [2, 0, 0, 1] and row["word_kept"] == [1, 0, 1, 1]
    assert row["words_no_token"] == 1 and row["words_cut"] == 0 and dm.words_cut["train"] == 0
    assert f"have no sub-token under this tokenizer (the first, in sentence 1: {ascii(word)})" in caplog.text
    assert "data.max_length" not in caplog.text  # not blamed on the length
    batch = next(iter(dm.train_dataloader()))
    assert batch["word_tags"].shape == batch["word_kept"].shape == (4, 4) and batch["words_no_token"].tolist() == [1] * 4


def with_no_token_words(rows: list[dict], every: int) -> list[dict]:
    """A copy of ``rows`` in which every ``every``-th sentence gains a no-sub-token word (tagged O) after its first word."""
    noisy = []
    for index, row in enumerate(rows):
        if index % every == 0:
            word = NO_TOKEN_WORDS[index // every % len(NO_TOKEN_WORDS)]
            row = {"tokens": [row["tokens"][0], word, *row["tokens"][1:]], "tags": [row["tags"][0], "O", *row["tags"][1:]]}
        noisy.append(row)
    return noisy


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"tokens": ["alice", "met"], "tags": ["B-PER"]}],
            r"train.jsonl' row 2: 2 words but 1 tags \(data.tags_column='tags'\); fix: one tag per word",
        ),
        ([{"tokens": ["alice"], "tags": "B-PER"}], r"row 2: 1 words but tags that are not a list \('B-PER'\)"),
        (
            [{"tokens": ["alice"], "tags": ["PER"]}],
            r"row 2: tag 'PER' is not O or one of B-<type>/I-<type> \(data.scheme=IOB2\); fix: .*data.scheme=none",
        ),
        ([{"tokens": ["alice", ""], "tags": ["B-PER", "O"]}], r"row 2: data.tokens_column='tokens' must be a list of non-empty words"),
    ],
)
def test_bad_rows_are_refused_with_their_row(ner_tokenizer_dir, tmp_path, rows, message):
    train = write_jsonl(tmp_path / "train.jsonl", [{"tokens": ["bob"], "tags": ["B-PER"]}, *rows])
    with pytest.raises(DataError, match=message):
        datamodule(ner_tokenizer_dir, {"train": str(train)}).setup("fit")


def test_a_tag_unseen_in_training_and_a_csv_file_are_refused_and_empty_sentences_dropped(ner_tokenizer_dir, tmp_path, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(10, 0) + [{"tokens": [], "tags": []}])
    validation = write_jsonl(tmp_path / "validation.jsonl", [{"tokens": ["acme"], "tags": ["B-MISC"]}])
    with pytest.raises(
        DataError, match=r"validation.jsonl' row 1: the validation split has tags \['B-MISC'\] that the training tags .* do not include"
    ):
        datamodule(ner_tokenizer_dir, {"train": str(train), "validation": str(validation)}).setup("fit")
    assert "1 empty sentence(s) (rows without words, or a blank line after a blank line) skipped" in caplog.text
    (tmp_path / "train.csv").write_text("tokens,tags\nalice,B-PER\n")
    with pytest.raises(DataError, match=r"token classification reads jsonl/json/parquet rows .* or CoNLL text"):
        datamodule(ner_tokenizer_dir, {"train": str(tmp_path / "train.csv")}).setup("fit")


def test_strict_mode_counts_an_i_tag_after_o(ner_tokenizer_dir, tmp_path, caplog):
    rows = ner_rows(10, 0) + [{"tokens": ["acme", "corp"], "tags": ["O", "I-ORG"]}]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    datamodule(ner_tokenizer_dir, {"train": str(train)}, strict=True).setup("fit")
    assert (
        "1 tag(s) continue no entity (an I- after O or another type; the first in the row at row 11): they are not entities (strict)"
        in caplog.text
    )
    only_i = write_jsonl(tmp_path / "iob1.jsonl", [{"tokens": ["acme", "corp"], "tags": ["I-ORG", "I-ORG"]}] * 4)
    with pytest.raises(DataError, match=r"holds no entity under data.scheme=IOB2 data.strict=True: every score would be 0; fix: .*IOB1"):
        datamodule(ner_tokenizer_dir, {"train": str(only_i)}, strict=True).setup("fit")


def test_a_byte_level_tokenizer_without_a_pad_token_tags_pre_split_words(ner_tokenizer_dir, tmp_path):
    """GPT-2-style tokenizers refuse pre-split words unless each is read as after a space, and
    have no pad token: the data module reloads with ``add_prefix_space`` and pads with EOS."""
    from transformers import GPT2TokenizerFast

    from .conftest import byte_level_bpe

    trained = byte_level_bpe([" ".join(row["tokens"]) for row in ner_rows(50, 0)], ["<eos>"], eos_token="<eos>")
    folder = tmp_path / "gpt2_style"
    GPT2TokenizerFast(tokenizer_object=trained.backend_tokenizer, eos_token="<eos>").save_pretrained(folder)
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(8, 0))
    dm = datamodule(ner_tokenizer_dir, {"train": str(train), "validation": str(train)}, tokenizer=str(folder))
    dm.setup("fit")
    assert dm.tokenizer.pad_token == "<eos>" and dm.tokenizer.add_prefix_space
    for row, source in zip(dm.datasets["train"], ner_rows(8, 0)):  # one label per word, none cut
        assert sum(label != -100 for label in row["labels"]) == len(source["tokens"]) and row["words_cut"] == 0
    batch = next(iter(dm.train_dataloader()))
    assert (batch["input_ids"][batch["attention_mask"] == 0] == dm.tokenizer.eos_token_id).all()


def test_a_hub_data_sets_class_id_tags_are_read_as_their_names(ner_tokenizer_dir):
    import datasets

    names = ["O", "B-PER", "I-PER"]
    features = datasets.Features(
        {"words": datasets.Sequence(datasets.Value("string")), "ner": datasets.Sequence(datasets.ClassLabel(names=names))}
    )
    rows = datasets.Dataset.from_dict({"words": [["alice", "met", "bob"]], "ner": [[1, 0, 1]]}, features=features)
    dm = datamodule(ner_tokenizer_dir, {"train": "train"}, tokens_column="words", tags_column="ner")
    assert dm._tags_as_names(rows)["ner"] == [["B-PER", "O", "B-PER"]]


def test_config_checks_name_the_field(make_ner_cfg):
    from {{ cookiecutter.package_name }}.tasks import check_config

    with pytest.raises(ConfigError) as error:
        check_config(make_ner_cfg("data.scheme=IOBES", "data.conll_tag_column=last"))
    with pytest.raises(ConfigError, match=r"data.strict=true has no meaning for data.scheme=IOB1"):
        check_config(make_ner_cfg("data.scheme=IOB1", "data.strict=true"))
    assert "data.scheme='IOBES' must be one of ['IOB2', 'BIO', 'IOB1', 'BIOES', 'none']" in str(error.value)
    assert "data.conll_tag_column='last' must be an integer" in str(error.value)


# ---------------------------------------------------------------------------------------- train, eval, predict
@pytest.fixture
def make_ner_cfg(ner_tokenizer_dir, ner_data, tmp_path):
    def make(*overrides: str, config_name: str = "train"):
        return compose_config(config_name, ner_overrides(ner_tokenizer_dir, ner_data, tmp_path / "run") + list(overrides))

    return make


@pytest.fixture(scope="module")
def ner_ckpt(ner_tokenizer_dir, ner_data, tmp_path_factory) -> tuple[Path, dict]:
    """A tiny BERT trained for 4 epochs on the toy NER data: (its last.ckpt, its metrics)."""
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path_factory.mktemp("ner") / "run"
    cfg = compose_config(
        "train",
        ner_overrides(ner_tokenizer_dir, ner_data, run_dir) + ["trainer.max_epochs=4", "optimizer.lr=3e-3", "callbacks.progress_bar=null"],
    )
    metrics = train(cfg)
    return run_dir / "checkpoints" / "last.ckpt", metrics


def test_train_learns_the_entities_and_eval_reproduces_the_test_scores(ner_ckpt, make_ner_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.eval import evaluate

    ckpt, metrics = ner_ckpt
    assert metrics["val/f1"] > 0.9 and metrics["test/f1"] > 0.9, metrics  # the toy entities are separable
    assert {"val/precision", "val/recall", "val/f1_PER", "val/f1_LOC", "val/f1_ORG", "val/f1_best", "test/words_cut"} <= set(metrics)
    evaluated = evaluate(make_ner_cfg(f"ckpt_path={ckpt}", f"paths.output_dir={tmp_path / 'eval'}", config_name="eval"))
    assert evaluated["test/f1"] == metrics["test/f1"] and evaluated["test/acc"] == metrics["test/acc"]


def test_predict_writes_one_tag_per_word_in_input_order_and_null_for_cut_words(ner_ckpt, make_ner_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.predict import predict

    rows = [
        {"id": "007", "tokens": ["bob", "visited", "rome"]},
        {"id": "1.50", "tokens": ["carol", "met", "dave", "in", "london", "today", "and", "alice", "met", "bob", "in", "paris"]},
        {"id": "x", "tokens": []},
        {"id": "y", "tokens": None},
    ]
    source = write_jsonl(tmp_path / "sentences.jsonl", rows)
    out = predict(make_ner_cfg(f"ckpt_path={ner_ckpt[0]}", f"input={source}", "data.max_length=12", config_name="predict"))
    assert out.name == "predictions.jsonl"
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in written] == ["007", "1.50", "x", "y"]  # the input's fields as read, in its order
    assert [row["tokens"] for row in written] == [row["tokens"] for row in rows]
    assert written[0]["tags"] == ["B-PER", "O", "B-LOC"] and written[0]["words_cut"] == written[0]["words_no_token"] == 0
    # 12 sub-tokens: [CLS] + 10 + [SEP] -> "london" is 2, so 9 words keep a sub-token; the rest are null
    assert written[1]["words_cut"] == 3 and written[1]["tags"][9:] == [None, None, None]
    assert None not in written[1]["tags"][:9] and len(written[1]["tags"]) == 12
    assert written[2]["tags"] == written[3]["tags"] == [] and written[3]["tokens"] is None and written[2]["words_cut"] == 0
    with pytest.raises(
        ConfigError, match=r"output='.*preds.csv': task=token_classification writes a .jsonl file; fix: output=.*preds.jsonl"
    ):
        predict(make_ner_cfg(f"ckpt_path={ner_ckpt[0]}", f"input={source}", f"output={tmp_path / 'preds.csv'}", config_name="predict"))


@pytest.fixture(scope="module")
def pretrained_bert_dir(ner_tokenizer_dir, tmp_path_factory) -> Path:
    """A "pretrained" 2-layer BERT folder (random weights, saved with save_pretrained), for LoRA."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path_factory.mktemp("pretrained_bert")
    tokenizer = AutoTokenizer.from_pretrained(ner_tokenizer_dir)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_lora_trains_the_adapters_and_the_head_and_eval_reproduces_its_test_scores(make_ner_cfg, pretrained_bert_dir, tmp_path):
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.train import train

    lora = [f"model.name_or_path={pretrained_bert_dir}", f"model.tokenizer={pretrained_bert_dir}", "model.config=null", "peft=lora"]
    metrics = train(make_ner_cfg(*lora, "trainer.max_epochs=3", "optimizer.lr=5e-3", "callbacks.progress_bar=null"))
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    trained = set(ckpt["state_dict"])
    assert any("lora_A" in key for key in trained) and any("classifier" in key for key in trained)
    assert not any("encoder.layer.0.attention.self.query.base_layer.weight" in key for key in trained)  # the frozen base is not stored
    assert ckpt["model_inputs"]["task_facts"] == {"scheme": "IOB2", "strict": False}
    evaluated = evaluate(
        make_ner_cfg(
            *lora,
            f"ckpt_path={metrics['best_checkpoint']}",  # the weights train's test scored (last.ckpt may be a later epoch)
            f"paths.output_dir={tmp_path / 'eval'}",
            config_name="eval",
        )
    )
    assert evaluated["test/f1"] == metrics["test/f1"] and evaluated["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-6)


def test_words_without_a_sub_token_change_no_score_and_no_other_words_tag(ner_ckpt, make_ner_cfg, tmp_path):
    """The acceptance case: 200 sentences, 10 % of them with an inserted zero-width/soft-hyphen/... word tagged O, score the
    clean file's entity F1; predict tags every other word as on the clean file and the inserted ones null."""
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.predict import predict

    clean = ner_rows(200, seed=5)
    noisy = with_no_token_words(clean, every=10)
    files = {name: write_conll(tmp_path / f"{name}.conll", rows) for name, rows in (("clean", clean), ("noisy", noisy))}
    scores, tagged = {}, {}
    for name, path in files.items():
        run = [f"ckpt_path={ner_ckpt[0]}", f"data.splits.test={path}"]
        scores[name] = evaluate(make_ner_cfg(*run, f"paths.output_dir={tmp_path / name}", config_name="eval"))
        out = predict(make_ner_cfg(*run, f"input={path}", f"output={tmp_path / name}.jsonl", config_name="predict"))
        tagged[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert scores["noisy"]["test/f1"] == scores["clean"]["test/f1"] and scores["noisy"]["test/words_no_token"] == 20
    assert scores["noisy"]["test/words_cut"] == scores["clean"]["test/words_cut"] == 0
    for index, (plain, extra) in enumerate(zip(tagged["clean"], tagged["noisy"], strict=True)):
        if index % 10:
            assert extra["tags"] == plain["tags"] and extra["words_no_token"] == 0
        else:
            assert extra["tags"] == [plain["tags"][0], None, *plain["tags"][1:]] and extra["words_no_token"] == 1


def test_a_checkpoint_is_scored_by_its_stored_tag_scheme(ner_ckpt, make_ner_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.core.checkpoints.io import load_trained_module
    from {{ cookiecutter.package_name }}.core.task import module_class

    checkpoint = torch.load(ner_ckpt[0], weights_only=True)
    checkpoint["model_inputs"]["task_facts"] = {"scheme": "IOB2", "strict": True}
    torch.save(checkpoint, tmp_path / "strict.ckpt")
    cfg = make_ner_cfg(f"ckpt_path={tmp_path / 'strict.ckpt'}", config_name="eval")
    module = load_trained_module(module_class(cfg), cfg, tmp_path / "strict.ckpt")
    assert module.test_metrics.entities.strict and module.datamodule_kwargs()["trained_facts"]["strict"] is True
    from {{ cookiecutter.package_name }}.eval import evaluate

    with pytest.raises(
        ConfigError, match=r"trained, and is scored, with data.strict=true; the config says data.strict=false; fix: data.strict=true"
    ):
        evaluate(cfg)


def test_the_default_learning_rate_is_the_models_finetune_lr_unless_a_recipe_or_the_command_line_gives_one(tmp_path):
    """At BERT-base's 5e-5, the default model (MiniLM-L6) underfit a 200-step token classifier (docs/tasks/classification.md)."""
    run = [f"paths.output_dir={tmp_path}"]
    assert compose_config("train", [*run, "task=token_classification", "model=minilm_l6"]).optimizer.lr == 2.0e-4
    assert compose_config("train", [*run, "model=bert_base_uncased"]).optimizer.lr == 5.0e-5
    assert compose_config("train", [*run, "model=minilm_l6", "optimizer.lr=3e-5"]).optimizer.lr == 3.0e-5
    assert compose_config("train", [*run, "model=minilm_l6", "optimizer=adamw_8bit"]).optimizer.lr == 2.0e-4
    assert compose_config("train", [*run, "experiment=demo_classification"]).optimizer.lr == 1.0e-4  # the recipe's own


def test_the_planner_traces_the_tasks_batch(make_ner_cfg):
    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory

    plan = plan_memory(*with_task(make_ner_cfg(config_name="plan")))
    assert plan.total > 0 and plan.activations > 0
