"""Reward models: the Bradley–Terry loss by hand, a short run on pairs (metrics, eval, predict agreeing with test), the
rewards independent of padding, the planner, and predict's refusals."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from {{ cookiecutter.package_name }}.core.errors import DataError
from {{ cookiecutter.package_name }}.tasks.reward.module import bradley_terry

from .conftest import NEGATIVE, NEUTRAL, POSITIVE, compose_config
from .test_chat_data import chat_tokenizer_dir  # noqa: F401  (a fixture)
from .test_preference import pair_files, pair_rows, preference_overrides, pretrained_folder, tokenizer, write_jsonl  # noqa: F401


def test_bradley_terry_loss_and_metrics_match_a_hand_computation():
    loss, values = bradley_terry(torch.tensor([1.0, -0.5]), torch.tensor([0.0, 1.5]))
    # margins 1 and -2: -log sigmoid(m) = log(1 + e^-m)
    torch.testing.assert_close(loss, torch.tensor([math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(2.0))]))
    torch.testing.assert_close(values, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, -2.0, -0.5, 1.5]]))  # accuracy, margin, chosen, rejected


def reward_overrides(folder, files, run_dir, *more: str) -> list[str]:
    overrides = preference_overrides(folder, files, run_dir, "data=reward", *more)
    return ["task=reward", *(o for o in overrides if o != "task=preference")]


@pytest.fixture(scope="module")
def encoder_folder(tokenizer_dir, tmp_path_factory):
    """A tiny BERT and its WordPiece tokenizer (no chat template: prompt and answer are read as its text pair)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path_factory.mktemp("reward_encoder")
    wordpiece = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(vocab_size=len(wordpiece), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    wordpiece.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def encoder_pairs(tmp_path_factory):
    rng, folder = random.Random(0), tmp_path_factory.mktemp("encoder_pairs")

    def rows(n):
        return [
            {"prompt": " ".join(rng.sample(NEUTRAL, 3)), "chosen": rng.choice(POSITIVE), "rejected": rng.choice(NEGATIVE)} for _ in range(n)
        ]

    return {split: write_jsonl(folder / f"{split}.jsonl", rows(n)) for split, n in (("train", 24), ("validation", 6), ("test", 6))}


@pytest.mark.parametrize(("base", "peft"), [("decoder", "none"), ("decoder", "lora"), ("encoder", "none")])
def test_a_short_reward_model_run_learns_the_pairs_and_predict_scores_as_test_does(
    pretrained_folder,  # noqa: F811
    pair_files,  # noqa: F811
    encoder_folder,
    encoder_pairs,
    tmp_path,
    base,
    peft,
):
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.predict import predict
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path / "run"
    folder, pair_files = (pretrained_folder, pair_files) if base == "decoder" else (encoder_folder, encoder_pairs)
    overrides = reward_overrides(folder, pair_files, run_dir, f"peft={peft}", "trainer.max_steps=12", "trainer.val_check_interval=12")
    metrics = train(compose_config("train", overrides))
    for split in ("val", "test"):
        for name in ("loss", "pair_accuracy", "margin", "reward_chosen", "reward_rejected"):
            assert math.isfinite(metrics[f"{split}/{name}"]), (split, name)
    assert metrics["val/loss"] < metrics["val/loss_start"] and metrics["test/margin"] > 0
    assert metrics["test/margin"] == pytest.approx(metrics["test/reward_chosen"] - metrics["test/reward_rejected"], abs=1e-5)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["task"] == "reward"
    stored = checkpoint["hyper_parameters"]["hf_config"]
    assert len(stored["id2label"]) == 1  # (one output: HF configs store num_labels as the label map)
    assert stored["model_type"] == ("llama" if base == "decoder" else "bert")
    header = next(run_dir.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "train/pair_accuracy" in header and "train/margin" in header
    ckpt = [f"ckpt_path={metrics['best_checkpoint']}"]
    again = evaluate(compose_config("eval", overrides + ckpt + [f"paths.output_dir={tmp_path / 'eval'}"]))
    for name in ("loss", "pair_accuracy", "margin"):
        assert again[f"test/{name}"] == pytest.approx(metrics[f"test/{name}"], abs=1e-6), name
    # predict: each test answer alone, in other batches (other padding): the same rewards as the test pass saw
    rows = [json.loads(line) for line in pair_files["test"].read_text().splitlines()]
    answers = [{"prompt": r["prompt"], "completion": r[side], "side": side} for r in rows for side in ("chosen", "rejected")]
    answers[0] = {"completion": answers[0]["completion"], "note": "007", **answers[0]}  # a field of one row only, another order
    scored = tmp_path / "scored.jsonl"
    predict(
        compose_config(
            "predict",
            overrides
            + ckpt
            + [
                f"input={write_jsonl(tmp_path / 'answers.jsonl', answers)}",
                f"output={scored}",
                "batch.global_batch_size=3",
                "batch.micro_batch_size=3",
            ],
        )
    )
    out = [json.loads(line) for line in scored.read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "reward"} for row in out] == answers  # the input's fields as read, in order
    assert [list(row) for row in out] == [[*answer, "reward"] for answer in answers]  # (no other row's fields, the file's order)
    chosen, rejected = torch.tensor([r["reward"] for r in out[0::2]]), torch.tensor([r["reward"] for r in out[1::2]])
    assert float((chosen > rejected).float().mean()) == pytest.approx(metrics["test/pair_accuracy"], abs=1e-6)
    assert float((chosen - rejected).mean()) == pytest.approx(metrics["test/margin"], abs=1e-4)
    if (base, peft) != ("decoder", "none"):
        return
    from {{ cookiecutter.package_name }}.quantize import quantize

    fast = ["variants=[fp32,int8_weight_only]", "latency.warmup=1", "latency.repeats=2", f"output_dir={tmp_path / 'q'}"]
    report = quantize(compose_config("quantize", overrides + ckpt + fast + [f"paths.output_dir={tmp_path / 'quantize'}"]))
    fp32, int8 = report["variants"]
    assert fp32["metrics"]["pair_accuracy"] == pytest.approx(metrics["test/pair_accuracy"], abs=1e-6)
    assert fp32["metrics"]["margin"] == pytest.approx(metrics["test/margin"], abs=1e-4) and math.isfinite(int8["metrics"]["margin"])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "the film", "text": "good"}], "input row 0 has no completion"),
        (
            [{"prompt": "a", "completion": "good"}, {"prompt": "the " * 80, "completion": "fine"}],
            r"input row 1 \(rows counted from 0\) is \d+ tokens, longer than data.max_length=64",
        ),
        ([{"prompt": "a", "completion": "good", "reward": 1}], "input has a field 'reward'"),
    ],
)
def test_predict_refuses_a_row_it_cannot_score_naming_it(pretrained_folder, pair_files, tmp_path, rows, message):  # noqa: F811
    from {{ cookiecutter.package_name }}.predict import predict
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path / "run"
    overrides = reward_overrides(pretrained_folder, pair_files, run_dir, "peft=none", "trainer.max_steps=1", "trainer.val_check_interval=2")
    ckpt = train(compose_config("train", overrides))["best_checkpoint"]
    output = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match=message):
        predict(
            compose_config(
                "predict", overrides + [f"ckpt_path={ckpt}", f"input={write_jsonl(tmp_path / 'in.jsonl', rows)}", f"output={output}"]
            )
        )
    assert not output.exists()


def test_a_reward_model_is_planned_as_two_sequences_a_pair(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    totals = {}
    for pairs in (1, 2):
        overrides = reward_overrides(pretrained_folder, pair_files, tmp_path / "run", "peft=lora", f"batch.micro_batch_size={pairs}")
        cfg = compose_config("plan", overrides)
        totals[pairs] = plan_memory(cfg, task_of(cfg), search=False)
    assert totals[2].total > totals[1].total


def test_an_encoder_reads_the_prompt_and_the_answer_as_its_text_pair_and_counts_what_is_cut(tokenizer_dir):
    from transformers import AutoTokenizer

    from {{ cookiecutter.package_name }}.tasks.preference.data import label_answer

    wordpiece = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt, answer = " ".join(NEUTRAL[:3]), " ".join(POSITIVE[:2])
    messages = [{"role": "system", "content": NEUTRAL[3]}, {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    ids, labels, _, _, cut = label_answer(wordpiece, None, messages, None, 64, "row 0")
    assert ids == wordpiece(f"{NEUTRAL[3]}\n{prompt}", answer)["input_ids"] == labels and cut == 0  # [CLS] turns [SEP] answer [SEP]
    short, _, _, _, cut = label_answer(wordpiece, None, messages, None, 6, "row 0")
    assert len(short) == 6 and cut == len(ids) - 6 and short[-1] == wordpiece.sep_token_id


def test_task_reward_with_another_data_module_is_refused_naming_data_reward(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.core.errors import ConfigError
    from {{ cookiecutter.package_name }}.tasks import check_config

    overrides = [o if o != "data=reward" else "data=preference" for o in reward_overrides(pretrained_folder, pair_files, tmp_path / "run")]
    with pytest.raises(
        ConfigError, match=r"PreferenceDataModule' is not a data module of task=reward .* fix: data=reward, or an experiment"
    ):
        check_config(compose_config("train", overrides))
