"""Preference tuning: the DPO, ORPO, SimPO and KTO losses by hand, the reference log-probs (tables and
adapters off) against a separate reference model, the pair and unpaired data and their refusals, and short runs."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.tasks.causal_lm.text import IGNORE_INDEX
from {{ cookiecutter.package_name }}.tasks.preference.data import (
    PairCollator,
    PreferenceDataModule,
    UnpairedDataModule,
    mismatched_answers,
    pair_fingerprint,
    tokenize_pairs,
)
from {{ cookiecutter.package_name }}.tasks.preference.module import PreferenceModule, disable_dropout
from {{ cookiecutter.package_name }}.tasks.preference.objectives import completion_logps, dpo, kto, orpo, simpo
from {{ cookiecutter.package_name }}.tasks.preference.reference_logps import reference_table

from .conftest import common_overrides, compose_config, tiny_llama_config
from .test_chat_data import CHATML, END, chat_tokenizer_dir  # noqa: F401  (a fixture)

WORDS = ["good", "great", "fine", "bad", "dull", "awful", "the", "film", "was", "plot"]


def sigmoid_nll(x: float) -> float:
    """-log sigmoid(x), by hand."""
    return math.log(1 + math.exp(-x))


# ------------------------------------------------------------------ the objectives, by hand
LOGP_W, LOGP_L = torch.tensor([-5.0, -3.0]), torch.tensor([-6.0, -2.0])
N_W, N_L = torch.tensor([5, 2]), torch.tensor([4, 4])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_dpo_loss_and_rewards_match_a_hand_computation(smoothing):
    ref_w, ref_l, beta = torch.tensor([-5.5, -3.0]), torch.tensor([-5.5, -2.5]), 0.1
    terms = dpo(LOGP_W, LOGP_L, ref_w, ref_l, beta, smoothing)
    # pair 0: r_w = 0.1 * 0.5 = 0.05, r_l = 0.1 * -0.5 = -0.05; pair 1: r_w = 0, r_l = 0.1 * 0.5 = 0.05
    margins = [0.05 - -0.05, 0.0 - 0.05]
    expected = [(1 - smoothing) * sigmoid_nll(m) + smoothing * sigmoid_nll(-m) for m in margins]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(terms.reward_chosen, torch.tensor([0.05, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(terms.reward_rejected, torch.tensor([-0.05, 0.05]), rtol=0, atol=1e-6)


def test_simpo_loss_matches_a_hand_computation():
    terms = simpo(LOGP_W, LOGP_L, N_W, N_L, beta=2.0, gamma=1.0)
    # r_w = 2 * -5/5 = -2, r_l = 2 * -6/4 = -3: margin 1 - gamma = 0; pair 1: -3 - -1 - 1 = -3
    torch.testing.assert_close(terms.loss, torch.tensor([math.log(2), sigmoid_nll(-3.0)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(terms.reward_chosen, torch.tensor([-2.0, -3.0]))


def test_orpo_loss_matches_a_hand_computation():
    terms = orpo(LOGP_W, LOGP_L, N_W, N_L, beta=0.1)
    expected = []
    for logp_w, logp_l, n_w, n_l in [(-5.0, -6.0, 5, 4), (-3.0, -2.0, 2, 4)]:
        mean_w, mean_l = logp_w / n_w, logp_l / n_l
        log_odds = (mean_w - math.log(1 - math.exp(mean_w))) - (mean_l - math.log(1 - math.exp(mean_l)))
        expected.append(-mean_w + 0.1 * sigmoid_nll(log_odds))
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(terms.reward_rejected, torch.tensor([0.1 * -1.5, 0.1 * -0.5]))


@pytest.mark.parametrize(("kl_shift", "z0"), [(0.5, 0.5), (-1.0, 0.0)])  # (a negative KL estimate is clamped to 0)
def test_kto_loss_rewards_and_reference_point_match_a_hand_computation(kl_shift, z0):
    logp = torch.tensor([-5.0, -3.0, -4.0], requires_grad=True)
    ref = torch.tensor([-6.0, -3.0, -5.0])
    ref_kl = torch.tensor([-7.0, -8.0, -9.0])
    logp_kl = (ref_kl + torch.tensor([kl_shift - 0.5, kl_shift, kl_shift + 0.5])).requires_grad_()  # mean log-ratio: kl_shift
    desirable = torch.tensor([True, False, False])
    terms = kto(logp, ref, logp_kl, ref_kl, desirable, beta=0.5, desirable_weight=1.0, undesirable_weight=2.0)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # r = (1, 0, 1); desirable: 1 * (1 - s(0.5 (1 - z0))); undesirable: 2 * (1 - s(0.5 (z0 - r)))
    expected = [1 - sigmoid(0.5 * (1 - z0)), 2 * (1 - sigmoid(0.5 * (z0 - 0))), 2 * (1 - sigmoid(0.5 * (z0 - 1)))]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(terms.reward, torch.tensor([0.5, 0.0, 0.5]), rtol=0, atol=1e-6)
    assert float(terms.kl) == pytest.approx(z0, abs=1e-6)
    terms.loss.sum().backward()
    assert logp.grad.abs().sum() > 0 and logp_kl.grad is None  # the reference point is not differentiated (sec. 4.1)


def test_completion_logps_sum_the_shifted_scored_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 6, 0]])
    logps, counts = completion_logps(logits, labels)
    log_probs = logits.log_softmax(-1)
    # position t predicts token t+1: row 0 scores tokens 3 (from 1) and 4 (from 2)
    expected = [log_probs[0, 1, 3] + log_probs[0, 2, 4], log_probs[1, 0, 1] + log_probs[1, 1, 2] + log_probs[1, 2, 6] + log_probs[1, 3, 0]]
    torch.testing.assert_close(logps, torch.stack(expected))
    assert counts.tolist() == [2, 4]


# ------------------------------------------------------------------ data
@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):  # noqa: F811
    return AutoTokenizer.from_pretrained(chat_tokenizer_dir)


def pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.sample(WORDS, 4))
        good, bad = " ".join(rng.sample(WORDS[:3], 2)), " ".join(rng.sample(WORDS[3:6], 2))
        rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tokenize(tokenizer, rows: list[dict], max_length: int = 64) -> dict[str, list]:
    batch = {key: [row.get(key) for row in rows] for key in {key for row in rows for key in row}}
    eot = tokenizer.convert_tokens_to_ids(END)
    return tokenize_pairs(batch, list(range(len(rows))), tokenizer, CHATML, None, eot, max_length, "train")


def test_each_side_scores_its_answer_and_end_of_turn_only_after_the_same_prompt(tokenizer):
    out = tokenize(tokenizer, [{"prompt": "the film was", "chosen": "good fine", "rejected": "awful"}])
    for side, answer in (("chosen", "good fine"), ("rejected", "awful")):
        ids, labels = out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]
        scored = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
        assert tokenizer.decode(scored) == answer + END
    first = [labels.index(next(x for x in labels if x != IGNORE_INDEX)) for labels in (out["chosen_labels"][0], out["rejected_labels"][0])]
    assert first[0] == first[1] and out["chosen_input_ids"][0][: first[0]] == out["rejected_input_ids"][0][: first[1]]


def test_message_lists_and_the_implicit_prompt_tokenise_as_the_text_columns(tokenizer):
    text = {"prompt": "the plot", "chosen": "great", "rejected": "dull"}
    messages = {
        "prompt": [{"role": "user", "content": "the plot"}],
        "chosen": [{"role": "assistant", "content": "great"}],
        "rejected": [{"role": "assistant", "content": "dull"}],
    }
    implicit = {
        side: [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": text[side]}] for side in ("chosen", "rejected")
    }
    expected = tokenize(tokenizer, [text])
    for row in (messages, implicit):
        out = tokenize(tokenizer, [row])
        assert out["chosen_input_ids"] == expected["chosen_input_ids"] and out["rejected_labels"] == expected["rejected_labels"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "the plot", "chosen": "great", "rejected": "great"}, "row 0: chosen and rejected are the same answer"),
        ({"prompt": "the plot", "chosen": "", "rejected": "dull"}, "row 0: chosen is empty; fix"),
        ({"prompt": "the plot", "chosen": "great", "rejected": "   "}, "row 0: rejected is empty"),
        ({"prompt": "the plot", "chosen": "great"}, r"row 0 has no rejected \(columns: \['chosen', 'prompt'\]\)"),
        ({"chosen": "great", "rejected": "dull"}, "row 0 has no prompt"),
        (
            {
                "chosen": [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "great"}],
                "rejected": [{"role": "user", "content": "the film"}, {"role": "assistant", "content": "dull"}],
            },
            r"row 0: chosen and rejected have different prompts \(they differ at turn 0\)",
        ),
        (
            {"prompt": "the plot", "chosen": [{"role": "user", "content": "great"}], "rejected": "dull"},
            "chosen does not end with an assistant",
        ),
        ({"prompt": "the plot", "chosen": f"great{END}", "rejected": "dull"}, "special token"),
    ],
)
def test_a_bad_pair_is_refused_naming_the_row_and_the_fix(tokenizer, row, message):
    with pytest.raises(DataError, match=message):
        tokenize(tokenizer, [row])


def datamodule_options(tokenizer, splits: dict[str, Path], **changes) -> dict:
    options = dict(
        splits={split: str(path) for split, path in splits.items()},
        hub_name=None,
        hub_config=None,
        tokenizer=tokenizer,
        chat_template=None,
        system_prompt=None,
        end_of_turn=None,
        max_length=64,
        batch_size=4,
        val_fraction=0.1,
        val_split_seed=0,
        num_workers=0,
        pad_to_multiple_of=None,
        group_by_length=False,
        cache_dir=None,
        fetch=None,
        seed=0,
    )
    return {**options, **changes}


def make_datamodule(tokenizer, splits: dict[str, Path], **changes) -> PreferenceDataModule:
    return PreferenceDataModule(**datamodule_options(tokenizer, splits, **changes))


def test_a_pair_whose_prompt_fills_max_length_is_dropped_and_counted(tokenizer, tmp_path, caplog):
    rows = pair_rows(6, seed=1) + [{"prompt": " ".join(["the film was"] * 40), "chosen": "good", "rejected": "bad"}]
    datamodule = make_datamodule(
        tokenizer, {"train": write_jsonl(tmp_path / "t.jsonl", rows), "validation": write_jsonl(tmp_path / "v.jsonl", rows[:3])}
    )
    datamodule.setup("fit")
    assert datamodule.dropped["train"] == [6] and len(datamodule.datasets["train"]) == 6
    assert "dropped 1 of 7 rows" in caplog.text


def test_a_pair_tied_by_truncation_is_dropped_and_counted_in_train_eval_and_inspect_data(tokenizer, tmp_path, caplog):
    """Answers that differ only past data.max_length are one sequence once truncated: the pair always ties.  A pair refused
    as written (chosen == rejected) stays refused; one tied by the setting is dropped, by row, wherever the split is read."""
    tied = {"prompt": "the film was", "chosen": "good fine " * 10 + "good", "rejected": "good fine " * 10 + "awful"}
    rows = pair_rows(6, seed=1) + [tied]
    files = {"train": write_jsonl(tmp_path / "t.jsonl", rows), "validation": write_jsonl(tmp_path / "v.jsonl", [tied, *rows[:3]])}
    files["test"] = files["validation"]
    out = tokenize(tokenizer, [tied], max_length=40)
    assert out["tied"] == [True] and out["n_trained"][0] > 0  # both sides still train tokens: not dropped as untrained
    assert tokenize(tokenizer, [tied], max_length=512)["tied"] == [False]
    datamodule = make_datamodule(tokenizer, files, max_length=40)
    datamodule.setup("fit")
    datamodule.setup("test")
    assert datamodule.dropped == {"train": [6], "validation": [0], "test": [0]} and len(datamodule.datasets["train"]) == 6
    assert "dropped 1 of 7 rows whose chosen and rejected sides are the same once truncated to data.max_length=40" in caplog.text
    rows_read = datamodule.split_rows("train")
    assert [rows_read[i]["row"] for at in datamodule.drops(rows_read).values() for i in at] == [6]


def test_batches_hold_whole_pairs_chosen_first(tokenizer, tmp_path):
    rows = pair_rows(10, seed=2)
    datamodule = make_datamodule(
        tokenizer, {"train": write_jsonl(tmp_path / "t.jsonl", rows), "validation": write_jsonl(tmp_path / "v.jsonl", rows[:4])}
    )
    datamodule.setup("fit")
    batch = next(iter(datamodule.val_dataloader()))
    assert batch["input_ids"].shape[0] == 2 * batch["pair"].shape[0] == 8
    decoded = [
        tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
        for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist())
    ]
    assert decoded[:4] == [rows[i]["chosen"] + END for i in range(4)] and decoded[4:] == [rows[i]["rejected"] + END for i in range(4)]


def test_a_local_datasets_folder_loads_as_a_hub_data_set(tokenizer, tmp_path):
    folder = tmp_path / "hub_like"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", pair_rows(8, seed=3))
    write_jsonl(folder / "test.jsonl", pair_rows(3, seed=4))
    datamodule = make_datamodule(tokenizer, {"train": "train", "test": "test"}, hub_name=str(folder), val_fraction=0.25)
    datamodule.setup("fit")
    assert len(datamodule.datasets["train"]) == 6 and len(datamodule.datasets["test"]) == 3


# ------------------------------------------------------------------ the reference model
def tiny_gpt2(vocab_size: int) -> torch.nn.Module:
    config = GPT2Config(vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=4)  # dropout 0.1 everywhere
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    config = tiny_llama_config(vocab_size, hidden_size=32, intermediate_size=64, attention_dropout=0.1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def preference_module(folder: Path, peft: str, tokenizer) -> PreferenceModule:
    from {{ cookiecutter.package_name }}.core.models.inputs import ModelInputs

    peft_cfg = (
        {"method": "none"}
        if peft == "none"
        else {
            "method": "lora",
            "r": 4,
            "alpha": 8,
            "dropout": 0.1,
            "target_modules": "all-linear",
        }
    )
    module = PreferenceModule(
        model={"name_or_path": str(folder), "tokenizer": str(folder), "config": None, "fetch": None},
        optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "step_in_backward": False},
        peft=peft_cfg,
        objective={"name": "dpo", "beta": 0.1, "label_smoothing": 0.0},
    )
    module.connect(ModelInputs.before_data("32-true", 64, 4))
    module.inputs.tokenizer = tokenizer
    module.prepare_data()
    module.configure_model()
    return module


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_reference_logps_equal_a_separate_reference_model(tokenizer, tmp_path, family, peft):
    """The table of a full fine-tune, and the adapters-off pass of LoRA, give the log-probs of a
    separate copy of the starting model (eval mode); the policy in train mode has no dropout."""
    model = (tiny_gpt2 if family == "gpt2" else tiny_llama)(len(tokenizer))
    folder = tmp_path / family
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    module = preference_module(folder, peft, tokenizer)
    rows = pair_rows(6, seed=5)
    out = tokenize(tokenizer, rows)
    pairs = [{key: out[key][i] for key in out} | {"pair": i} for i in range(len(rows))]
    pairs = [pair | {"pair_fingerprint": pair_fingerprint(pair)} for pair in pairs]
    collator = PairCollator(tokenizer.pad_token_id or 0, None)
    batch = collator(pairs)
    with torch.no_grad():
        expected = completion_logps(
            reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
        )[0]
    if peft == "none":
        from lightning.pytorch.plugins.precision import Precision

        table = reference_table(module, pairs, collator, 4, Precision())  # (pairs, 2)
        torch.testing.assert_close(torch.cat([table[:, 0], table[:, 1]]), expected, atol=1e-5, rtol=1e-5)
    else:
        with torch.no_grad():  # the LoRA B matrices start at 0: perturb them, the reference must not move
            for name, param in module.model.named_parameters():
                if "lora_B" in name:
                    param.normal_()
        torch.testing.assert_close(module.reference_logps(batch, "train"), expected, atol=1e-5, rtol=1e-5)
    module.train()
    with torch.no_grad():
        first, second = module.sequence_logps(batch)[0], module.sequence_logps(batch)[0]
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # no dropout in train mode


def test_disable_dropout_zeroes_every_dropout_of_a_gpt2():
    model = tiny_gpt2(50)
    disable_dropout(model)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


# ------------------------------------------------------------------ runs
def preference_overrides(folder: Path, data: dict[str, Path], run_dir: Path, *more: str) -> list[str]:
    """A short run's overrides (``data=preference`` unless ``more`` names another data config)."""
    return [
        "task=preference",
        "model=tiny_llama",
        f"model.name_or_path={folder}",
        "model.config=null",
        f"model.tokenizer={folder}",
        "model.fetch=null",
        *([] if any(o.startswith("data=") for o in more) else ["data=preference"]),
        *(f"data.splits.{split}={path}" for split, path in data.items()),
        "data.max_length=64",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "optimizer.lr=5e-3",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        *common_overrides(run_dir),
        *more,
    ]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pairs")
    return {
        "train": write_jsonl(folder / "train.jsonl", pair_rows(24, seed=6)),
        "validation": write_jsonl(folder / "validation.jsonl", pair_rows(6, seed=7)),
        "test": write_jsonl(folder / "test.jsonl", pair_rows(6, seed=8)),
    }


@pytest.fixture(scope="module")
def pretrained_folder(tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pref_model")
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("peft", "objective"), [("none", "dpo"), ("lora", "dpo"), ("lora", "simpo"), ("none", "orpo")])
def test_a_short_preference_run_reports_its_pair_metrics(pretrained_folder, pair_files, tmp_path, peft, objective):
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path / "run"
    overrides = preference_overrides(pretrained_folder, pair_files, run_dir, f"peft={peft}", f"objective={objective}")
    metrics = train(compose_config("train", overrides))
    for split in ("val", "test"):
        for name in ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected"):
            assert math.isfinite(metrics[f"{split}/{name}"]), (split, name)
    if objective == "dpo":  # the starting policy is the reference: rewards 0, loss log 2
        assert metrics["val/loss_start"] == pytest.approx(math.log(2), abs=1e-5)
        assert metrics["val/reward_margin_start"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["val/loss"] < metrics["val/loss_start"]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["task"] == "preference"
    tables = checkpoint["reference_logps"]
    if peft == "none" and objective == "dpo":
        assert sorted(tables) == ["test", "train", "validation"]
        assert tables["test"]["logps"].shape == (6, 2) and tables["test"]["fingerprints"].shape == (6,)
    else:
        assert tables == {}
    header = next(run_dir.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "train/reward_accuracy" in header and "train/logp_chosen" in header
    # eval on the tested checkpoint gives the same test figures (the reference: adapters off, or
    # the checkpoint's tables)
    from {{ cookiecutter.package_name }}.eval import evaluate

    again = evaluate(
        compose_config("eval", overrides + [f"ckpt_path={metrics['best_checkpoint']}", f"paths.output_dir={tmp_path / 'eval'}"])
    )
    for name in ("loss", "reward_accuracy", "reward_margin"):
        assert again[f"test/{name}"] == pytest.approx(metrics[f"test/{name}"], abs=1e-6), name
    if peft == "none" and objective == "dpo":  # other test pairs: their reference is not in the checkpoint
        from {{ cookiecutter.package_name }}.core.errors import ConfigError

        other = write_jsonl(tmp_path / "other_test.jsonl", pair_rows(6, seed=99))
        with pytest.raises(ConfigError, match="test pairs are not the ones this run's reference log-probs were computed for"):
            evaluate(
                compose_config(
                    "eval",
                    overrides
                    + [f"ckpt_path={metrics['best_checkpoint']}", f"data.splits.test={other}", f"paths.output_dir={tmp_path / 'eval2'}"],
                )
            )
    if peft == "lora":  # the merged policy exports as a plain causal LM
        from {{ cookiecutter.package_name }}.export import export

        export(compose_config("export", overrides + [f"ckpt_path={metrics['best_checkpoint']}", f"output_dir={tmp_path / 'exported'}"]))
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "exported").config.model_type == "llama"


def test_the_reference_table_is_cached_by_content_and_read_back(pretrained_folder, pair_files, tmp_path):
    from {{ cookiecutter.package_name }}.train import train

    first = train(
        compose_config(
            "train",
            preference_overrides(pretrained_folder, pair_files, tmp_path / "a", "trainer.max_steps=2", "trainer.val_check_interval=2"),
        )
    )
    cached = sorted((tmp_path / "cache" / "datasets" / "reference_logps").glob("*.pt"))
    assert len(cached) == 3
    second = train(
        compose_config(
            "train",
            preference_overrides(pretrained_folder, pair_files, tmp_path / "b", "trainer.max_steps=2", "trainer.val_check_interval=2"),
        )
    )
    assert sorted((tmp_path / "cache" / "datasets" / "reference_logps").glob("*.pt")) == cached
    assert second["test/loss"] == first["test/loss"]
    # another model: other keys, never the first model's tables
    other = tmp_path / "other_model"
    model = AutoModelForCausalLM.from_pretrained(pretrained_folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(pretrained_folder).save_pretrained(other)
    train(
        compose_config(
            "train", preference_overrides(other, pair_files, tmp_path / "c", "trainer.max_steps=2", "trainer.val_check_interval=2")
        )
    )
    assert len(list((tmp_path / "cache" / "datasets" / "reference_logps").glob("*.pt"))) == 6


def test_a_copy_is_not_needed_for_the_reference(tokenizer, tmp_path):
    """Guard against a silent second model: the LoRA module holds one copy of the base weights."""
    folder = tmp_path / "m"
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    module = preference_module(folder, "lora", tokenizer)
    base = sum(p.numel() for n, p in module.named_parameters() if "lora_" not in n)
    assert base == sum(p.numel() for p in copy.deepcopy(tiny_llama(len(tokenizer))).parameters())


def test_inspect_data_shows_both_sides_of_a_pair_with_their_answers_marked(pretrained_folder, pair_files, tmp_path):
    import io

    from rich.console import Console

    from {{ cookiecutter.package_name }}.inspect_data import inspect_data

    overrides = preference_overrides(pretrained_folder, pair_files, tmp_path / "inspect", "rows=1", "color=never")
    overrides = [o for o in overrides if not o.startswith(("trainer.", "batch.", "optimizer.", "logger="))]
    out = io.StringIO()
    dropped = inspect_data(compose_config("inspect_data", overrides), Console(file=out, width=200))
    row = pair_rows(24, seed=6)[0]
    assert dropped == []
    text = out.getvalue()
    assert "chosen: " in text and f"[[{row['chosen']}{END}]]" in text and f"[[{row['rejected']}{END}]]" in text
    assert text.index(row["chosen"]) < text.index("rejected: ") < text.index(row["rejected"] + END)
    # KTO reads the same pairs as answers, each with its kind
    overrides = [o for o in overrides if o not in ("data=preference", "rows=1")] + ["objective=kto", "data=unpaired", "rows=2"]
    out = io.StringIO()
    assert inspect_data(compose_config("inspect_data", overrides), Console(file=out, width=200)) == []
    text = out.getvalue()
    assert text.index("row 0: a desirable answer") < text.index(f"[[{row['chosen']}{END}]]") < text.index("row 0: an undesirable answer")
    assert text.index("row 0: an undesirable answer") < text.index(f"[[{row['rejected']}{END}]]")


def test_logps_from_hidden_states_equal_those_of_the_full_logits():
    from {{ cookiecutter.package_name }}.tasks.preference.objectives import completion_logps_from_hidden

    torch.manual_seed(1)
    hidden, head = torch.randn(3, 6, 8), torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([[IGNORE_INDEX] * 3 + [1, 2, 3], [IGNORE_INDEX, 4, 5, 6, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 5 + [7]])
    logps, counts = completion_logps_from_hidden(hidden, head, labels)
    full, full_counts = completion_logps(head(hidden), labels)
    torch.testing.assert_close(logps, full)
    assert counts.tolist() == full_counts.tolist() == [3, 3, 1]  # a label is scored from the position before it


def test_the_planners_static_slice_gives_the_gathered_logps():
    from {{ cookiecutter.package_name }}.tasks.preference.objectives import completion_logps_from_hidden

    torch.manual_seed(2)
    hidden, head = torch.randn(4, 8, 6), torch.nn.Linear(6, 9, bias=False)
    labels = torch.randint(0, 9, (4, 8))
    labels[:, :4] = IGNORE_INDEX  # as Preference.example_batch: the second half scored
    gathered = completion_logps_from_hidden(hidden, head, labels)
    sliced = completion_logps_from_hidden(hidden, head, labels, scored_from=3)
    torch.testing.assert_close(sliced[0], gathered[0])
    assert sliced[1].tolist() == gathered[1].tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.beta=0"], "objective.beta=0 must be a number > 0"),
        (["objective=simpo", "objective.gamma=-1"], "objective.gamma=-1 must be a number >= 0"),
        (["objective=dpo", "objective.label_smoothing=0.5"], r"objective.label_smoothing=0.5 must be in \[0, 0.5\)"),
        (["objective.name=ipo"], "objective.name='ipo' is not one of"),
        (["objective=kto"], "objective=kto trains on unpaired answers, and data._target_ is the pair data module; fix: data=unpaired"),
        (["data=unpaired"], "objective=dpo trains on pairs, and data._target_ is the unpaired data module; fix: objective=kto"),
        (["objective=kto", "data=unpaired", "objective.undesirable_weight=0"], "objective.undesirable_weight=0 must be a number > 0"),
        # the task declares the group (Preference.config_groups): its keys are the Objective dataclass's fields
        (
            ["+objective.betta=0.2"],
            r"objective.betta is not a key of objective.*did you mean objective.beta\?.*beta, desirable_weight, gamma, label_smoothing, name",
        ),
    ],
)
def test_a_bad_objective_is_refused_before_anything_loads(pretrained_folder, pair_files, tmp_path, overrides, message):
    from {{ cookiecutter.package_name }}.core.errors import ConfigError
    from {{ cookiecutter.package_name }}.tasks import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(compose_config("train", preference_overrides(pretrained_folder, pair_files, tmp_path / "run", *overrides)))


def test_sample_prompts_without_a_prompt_are_refused(tokenizer, tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("\n")
    datamodule = make_datamodule(tokenizer, {"train": tmp_path / "t.jsonl"}, sample_prompts=str(empty))
    with pytest.raises(DataError, match="has no prompt"):
        datamodule.sample_prompt_texts()
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    datamodule = make_datamodule(tokenizer, {"train": tmp_path / "t.jsonl"}, sample_prompts=str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="line 1 has no prompt text"):
        datamodule.sample_prompt_texts()


def test_one_prompt_file_reader_takes_plain_text_and_jsonl_and_refuses_before_anything_loads(pretrained_folder, pair_files, tmp_path):
    """data.sample_prompts read a .txt file as JSON (a bare JSONDecodeError, after the fit); generate's prompts_file read a
    .jsonl file as text (each JSON line a prompt).  One reader, by suffix, checked with the config."""
    from {{ cookiecutter.package_name }}.core.data.loading import read_prompt_file
    from {{ cookiecutter.package_name }}.generate import read_prompts

    text = tmp_path / "prompts.txt"
    text.write_text("Write a review\\nof a film\n\nWrite a poem\n")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "Write a review\\nof a film"}\n\n{"prompt": "Write a poem"}\n')
    assert (
        read_prompt_file("data.sample_prompts", str(text))
        == read_prompt_file("x", str(rows))
        == ["Write a review\nof a film", "Write a poem"]
    )
    assert read_prompts(OmegaConf.create({"prompts": [], "prompts_file": str(rows)})) == ["Write a review\nof a film", "Write a poem"]
    (tmp_path / "plain.jsonl").write_text('{"prompt": "fine"}\nWrite a poem\n')
    with pytest.raises(DataError, match=r"data.sample_prompts='.*plain.jsonl' line 2 is not a JSON object .*; fix: one \{\"prompt\""):
        read_prompt_file("data.sample_prompts", str(tmp_path / "plain.jsonl"))
    from {{ cookiecutter.package_name }}.tasks import check_config

    judge = "data.judge={_target_:{{ cookiecutter.package_name }}.core.assets.vader.sentiment_scores,_partial_:true}"
    for bad, message in ((tmp_path / "plain.jsonl", "line 2 is not a JSON object"), (tmp_path / "none.txt", "is not a file")):
        overrides = preference_overrides(pretrained_folder, pair_files, tmp_path / "run", f"data.sample_prompts={bad}", judge)
        with pytest.raises(ConfigError, match=message):
            check_config(compose_config("train", overrides))


# ------------------------------------------------------------------ KTO: unpaired answers
def answer_text(tokenizer, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])


def test_unpaired_rows_and_pairs_read_as_labelled_answers_each_with_another_prompts_answer(tokenizer, tmp_path):
    pairs = pair_rows(4, seed=3)
    answers = [
        {"prompt": "the plot was", "completion": "dull awful", "label": False},
        {"prompt": "the film", "completion": "great", "label": True},
    ]
    files = {"train": write_jsonl(tmp_path / "t.jsonl", pairs + answers), "validation": write_jsonl(tmp_path / "v.jsonl", answers)}
    datamodule = UnpairedDataModule(**datamodule_options(tokenizer, files))
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    assert train["desirable"] == [True, False] * 4 + [False, True]  # a pair unpaired: its chosen answer, then its rejected one
    texts = [answer_text(tokenizer, row["input_ids"], row["labels"]) for row in train]
    assert texts == [side + END for pair in pairs for side in (pair["chosen"], pair["rejected"])] + ["dull awful" + END, "great" + END]
    for i, row in enumerate(train):  # the mismatched answer: this prompt, then the next answer to another prompt
        prompt = row["input_ids"][: next(t for t, label in enumerate(row["labels"]) if label != IGNORE_INDEX)]
        assert row["kl_input_ids"][: len(prompt)] == prompt
        partner = answer_text(tokenizer, row["kl_input_ids"], row["kl_labels"])
        j = i + 2 if i < 8 and i % 2 == 0 else (i + 1) % 10  # (a chosen answer's next row is its pair's: the same prompt)
        assert partner == texts[j], i
    batch = next(iter(datamodule.val_dataloader()))
    assert batch["input_ids"].shape[0] == 2 * batch["desirable"].shape[0] == 4 and batch["desirable"].tolist() == [False, True]
    assert [answer_text(tokenizer, ids, labels) for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist())] == [
        "dull awful" + END,
        "great" + END,
        "great" + END,
        "dull awful" + END,
    ]


def test_mismatched_answers_fall_back_to_the_next_row_when_every_prompt_is_the_same():
    ids = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 6, 7]]
    labels = [[IGNORE_INDEX, IGNORE_INDEX, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 5], [IGNORE_INDEX, IGNORE_INDEX, 6, 7]]
    kl_ids, kl_labels = mismatched_answers(ids, labels, max_length=3)
    assert kl_ids == [[1, 2, 5], [1, 2, 6], [1, 2, 3]] and kl_labels == [
        [IGNORE_INDEX, IGNORE_INDEX, 5],
        [IGNORE_INDEX, IGNORE_INDEX, 6],
        [IGNORE_INDEX, IGNORE_INDEX, 3],
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "the film", "completion": "good", "label": "yes"}, r"row 0: label='yes' must be true .* or false"),
        ({"prompt": "the film", "completion": "good"}, r"row 0: label=None must be true"),
        ({"prompt": "the film", "answer": "good", "label": True}, r"row 0 has no completion \(columns: \['answer', 'label', 'prompt'\]\)"),
        ({"prompt": "the film", "completion": "", "label": True}, "row 0: completion is empty"),
        (
            {"prompt": "the film", "completion": "good", "label": True, "chosen": "good"},
            "row 0 has a completion and chosen, so it is neither one answer nor a pair",
        ),
    ],
)
def test_a_bad_unpaired_row_is_refused_naming_the_row_and_the_fix(tokenizer, tmp_path, row, message):
    files = {"train": write_jsonl(tmp_path / "t.jsonl", [row]), "validation": write_jsonl(tmp_path / "v.jsonl", [row])}
    with pytest.raises(DataError, match=message):
        UnpairedDataModule(**datamodule_options(tokenizer, files)).setup("fit")


@pytest.mark.parametrize("bad", [0, 7, 19])
@pytest.mark.parametrize("unpaired", [False, True])
def test_a_bad_row_held_out_for_validation_is_named_by_its_row_in_the_train_file(tokenizer, tmp_path, bad, unpaired):
    rows = pair_rows(20, seed=5)
    rows[bad] = {"prompt": "the film", "completion": "good", "label": "yes"} if unpaired else {**rows[bad], "rejected": rows[bad]["chosen"]}
    module = UnpairedDataModule if unpaired else PreferenceDataModule
    with pytest.raises(DataError, match=rf"^data.splits.train row {bad}: "):
        module(**datamodule_options(tokenizer, {"train": write_jsonl(tmp_path / "t.jsonl", rows)}, val_fraction=0.5)).setup("fit")


def test_held_out_validation_keeps_a_pairs_two_answers_together(tokenizer, tmp_path):
    datamodule = UnpairedDataModule(
        **datamodule_options(tokenizer, {"train": write_jsonl(tmp_path / "t.jsonl", pair_rows(20, 5))}, val_fraction=0.25)
    )
    datamodule.setup("fit")
    train, validation = datamodule.datasets["train"], datamodule.datasets["validation"]
    assert len(train) == 30 and len(validation) == 10 and validation["desirable"] == [True, False] * 5
    answers = {split: {(tuple(ids)) for ids in data["input_ids"]} for split, data in (("train", train), ("validation", validation))}
    assert not answers["train"] & answers["validation"]


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_a_short_kto_run_reports_its_answer_metrics_and_eval_repeats_them(pretrained_folder, pair_files, tmp_path, peft):
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path / "run"
    overrides = preference_overrides(pretrained_folder, pair_files, run_dir, f"peft={peft}", "objective=kto", "data=unpaired")
    metrics = train(compose_config("train", overrides))
    names = ("loss", "reward_desirable", "reward_undesirable", "reward_margin", "kl", "logp_desirable", "logp_undesirable")
    for split in ("val", "test"):
        for name in names:
            assert math.isfinite(metrics[f"{split}/{name}"]), (split, name)
    # The starting policy is the reference: every reward and the KL estimate 0, each answer's loss 1 - sigmoid(0).
    assert metrics["val/loss_start"] == pytest.approx(0.5, abs=1e-5) and metrics["val/kl_start"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["val/loss"] < metrics["val/loss_start"] and metrics["val/reward_margin"] > 0
    assert "test/reward_accuracy" not in metrics
    tables = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["reference_logps"]
    if peft == "none":  # each answer's and its mismatched answer's reference log-probs, from the starting weights
        assert tables["test"]["logps"].shape == (12, 2)
    else:
        assert tables == {}
    header = next(run_dir.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "train/reward_desirable" in header and "train/kl" in header
    again = evaluate(
        compose_config("eval", overrides + [f"ckpt_path={metrics['best_checkpoint']}", f"paths.output_dir={tmp_path / 'eval'}"])
    )
    for name in names:
        assert again[f"test/{name}"] == pytest.approx(metrics[f"test/{name}"], abs=1e-6), name
    if peft == "none":  # (a full fine-tune's reference for other test answers is gone: refused, as for DPO)
        return
    # A split of one kind of answer: that kind's metrics, no margin (nothing to subtract), no number made up.
    good = write_jsonl(
        tmp_path / "good.jsonl", [{"prompt": row["prompt"], "completion": row["chosen"], "label": True} for row in pair_rows(4, 9)]
    )
    only = evaluate(
        compose_config(
            "eval",
            overrides + [f"ckpt_path={metrics['best_checkpoint']}", f"data.splits.test={good}", f"paths.output_dir={tmp_path / 'eval2'}"],
        )
    )
    assert math.isfinite(only["test/reward_desirable"]) and "test/reward_undesirable" not in only and "test/reward_margin" not in only


def test_kto_is_planned_as_dpo_is_two_sequences_an_item_and_the_reference_pass(pretrained_folder, pair_files, tmp_path):
    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    plans = {}
    for objective in (("objective=dpo",), ("objective=kto", "data=unpaired"), ("objective=simpo",)):
        cfg = compose_config("plan", preference_overrides(pretrained_folder, pair_files, tmp_path / "run", "peft=lora", *objective))
        plans[objective[0]] = plan_memory(cfg, task_of(cfg), search=False).total
    assert plans["objective=kto"] == plans["objective=dpo"] != plans["objective=simpo"]  # (SimPO: no reference pass)
