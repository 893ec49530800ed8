"""GRPO: advantages and the loss by hand, the reward functions' checked calls, prompt refusals, the config checks, and short
runs on a tiny Llama (rewards rise, eval repeats the test figures, a failing reward function stops the run by name)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from {{ cookiecutter.package_name }}.core.errors import ConfigError, DataError
from {{ cookiecutter.package_name }}.tasks.grpo.data import tokenize_prompts
from {{ cookiecutter.package_name }}.tasks.grpo.objective import GRPOSettings, group_advantages, grpo_loss, step_seed
from {{ cookiecutter.package_name }}.tasks.grpo.rewards import exact_answer, format_reward, score_completions

from .conftest import POSITIVE, compose_config
from .test_chat_data import CHATML, chat_tokenizer_dir  # noqa: F401  (a fixture)
from .test_preference import pair_files, preference_overrides, pretrained_folder, tokenizer  # noqa: F401  (fixtures)


def positive_share(prompts, completions, **columns):
    """A reward: the share of a completion's words that are positive ones."""
    return [sum(word in POSITIVE for word in text.split()) / max(1, len(text.split())) for text in completions]


def e_share(prompts, completions, **columns):
    """The test runs' reward (the tiny model writes bytes): the share of a completion's characters that are "e"."""
    return [text.count("e") / max(1, len(text)) for text in completions]


def fails_on_awful(prompts, completions, **columns):
    if any("awful" in text or "e" in text for text in completions):  # (the tiny model's samples hold an "e")
        raise ValueError("no awful reviews")
    return [0.0] * len(completions)


# ------------------------------------------------------------------ the objective
def test_group_advantages_centre_each_group_and_scale_by_its_std():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])  # two groups of 2: (1, 3) and a tie
    std = math.sqrt(2.0)  # unbiased std of (1, 3)
    torch.testing.assert_close(group_advantages(rewards, 2, scale=True), torch.tensor([-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(rewards, 2, scale=False), torch.tensor([-1.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_the_loss_and_its_kl_term_match_a_hand_computation(aggregation):
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, 0.0]], requires_grad=True)
    reference = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    settings = GRPOSettings(beta=0.1, loss_aggregation=aggregation)
    terms = grpo_loss(logps, logps.detach(), reference, advantages, mask, settings, max_completion_length=4)
    delta = reference - logps.detach()
    kl = torch.exp(delta) - delta - 1  # k3, >= 0
    per_token = -advantages[:, None] + 0.1 * kl  # the ratio is 1: the surrogate is -A
    masked = per_token * mask
    expected = {
        "sequence": (masked.sum(1) / mask.sum(1)).sum(),
        "token": masked.sum(),
        "constant": masked.sum() / 4,
    }[aggregation]
    torch.testing.assert_close(terms.loss_sum, expected)
    assert int(terms.items) == {"sequence": 2, "token": 5, "constant": 2}[aggregation]
    torch.testing.assert_close(terms.kl, (kl * mask).sum() / 5)
    assert float(terms.clipped) == 0.0
    terms.loss_sum.backward()  # the surrogate's gradient is -A per scored token (plus the KL's); none on the masked one
    assert logps.grad[1, 2] == 0 and logps.grad[0, 0] < 0 < logps.grad[1, 0]


def test_sampling_seeds_differ_by_stage_rank_step_and_micro_batch():
    seeds = {step_seed(0, stage, rank, step, micro) for stage in range(3) for rank in range(2) for step in range(50) for micro in range(4)}
    assert len(seeds) == 3 * 2 * 50 * 4 and all(0 <= seed < 2**63 for seed in seeds)
    assert step_seed(2**40, 2, 7, 10**6, 99) < 2**63


# ------------------------------------------------------------------ reward functions
def test_shipped_rewards_score_format_and_exact_answers():
    assert format_reward(pattern="<think>.*</think>.*")([], ["<think>a\nb</think> 42", "42"]) == [1.0, 0.0]
    texts = ["so #### 42", "#### 41 then #### 7", "no answer"]
    assert exact_answer(extract="#### (\\S+)")([], texts, answer=[42, "7", "x"]) == [1.0, 1.0, 0.0]
    assert exact_answer()([], [" 42 "], answer=["42"]) == [1.0]
    with pytest.raises(DataError, match="needs an 'answer' field"):
        exact_answer()([], ["42"], label=["x"])
    with pytest.raises(ConfigError, match="pattern='<think\\(' is not a regular expression"):
        format_reward(pattern="<think(")
    with pytest.raises(ConfigError, match="has 0 groups"):
        exact_answer(extract="####")


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (fails_on_awful, "data.rewards.bad raised ValueError: no awful reviews on data.splits.train row 11"),
        (lambda prompts, completions, **c: [1.0], "returned 1 values for 3 completions"),
        (lambda prompts, completions, **c: [1.0, float("nan"), 0.0], "returned nan for data.splits.train row 10"),
        (lambda prompts, completions, **c: [1.0, 0.0, True], "returned True for data.splits.train row 11"),
        (lambda prompts, completions, **c: ["1", 0.0, 0.0], "returned '1' for data.splits.train row 10"),
        (lambda prompts, completions, **c: 1.0, "returned float for 3 completions"),
    ],
)
def test_a_bad_reward_function_is_named_with_the_row(function, message):
    rewards = {"good": {"weight": 1.0, "function": positive_share}, "bad": {"weight": 0.5, "function": function}}
    rows = [{"prompt": "p", "answer": 1}] * 3
    with pytest.raises(DataError, match=message.replace("(", "\\(")):
        score_completions(rewards, ["p"] * 3, ["good", "okay", "awful"], rows, [10, 10, 11], "train")


def test_rewards_are_weighted_and_the_other_fields_reach_the_functions():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns, prompts=prompts)
        return [2.0] * len(completions)

    rewards = {"good": {"weight": 1.0, "function": positive_share}, "spy": {"weight": 0.5, "function": spy}}
    rows = [{"prompt": "p1", "answer": 1, "tag": "x"}, {"prompt": "p2", "answer": 2, "tag": "y"}]
    total, each = score_completions(rewards, ["p1", "p2"], ["good good", "bad"], rows, [0, 1], "train")
    torch.testing.assert_close(total, torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(each["good"], torch.tensor([1.0, 0.0]))
    assert seen == {"prompts": ["p1", "p2"], "answer": [1, 2], "tag": ["x", "y"]}


# ------------------------------------------------------------------ prompts
def test_a_prompt_without_room_for_the_completion_is_refused_by_its_row(tokenizer):  # noqa: F811
    batch = {"prompt": ["the plot", " ".join(["movie"] * 40)], "answer": [1, 2]}
    kwargs = {"tokenizer": tokenizer, "template": CHATML, "system_prompt": None, "split": "train"}
    out = tokenize_prompts({key: value[:1] for key, value in batch.items()}, [0], room=30, **kwargs)
    assert out["input_ids"][0] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "the plot"}], chat_template=CHATML, add_generation_prompt=True, return_dict=False
    )
    assert out["fields"] == ['{"prompt": "the plot", "answer": 1}']
    with pytest.raises(DataError, match=r"data.splits.train row 1: its prompt is \d+ tokens, .* leaves 30"):
        tokenize_prompts(batch, [0, 1], room=30, **kwargs)
    with pytest.raises(DataError, match="row 3 has no prompt"):
        tokenize_prompts({"question": ["x"]}, [3], room=30, **kwargs)


def test_inspect_data_shows_each_rendered_prompt_untrained(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from .test_chat_data import run_inspect_data

    overrides = [o for o in grpo_overrides(pretrained_folder, pair_files, tmp_path / "run") if not o.startswith(("+", "~"))]
    dropped, out = run_inspect_data([*overrides, "rows=1", "color=never"])
    assert dropped == [] and "row 0: " in out and "0 trained" in out and "[[" not in out.split("\n\n")[1]
    assert "<|im_start|>assistant\n" in out and "every one of the 24 rows is kept" in out


# ------------------------------------------------------------------ runs
def grpo_overrides(folder, files, run_dir, *more: str) -> list[str]:
    """A short run's overrides: a tiny Llama with LoRA, 4 prompts a step (2 a micro-batch) x 4 completions of 8 tokens,
    rewarded by :func:`e_share`; ``more`` replaces any of them by key."""
    base = [o for o in preference_overrides(folder, files, run_dir, "data=prompts") if o != "task=preference"]
    base += [
        "task=grpo",
        "peft=lora",
        "optimizer.lr=2e-2",
        "grpo.num_generations=4",
        "grpo.beta=0.04",
        "data.max_length=56",
        "data.max_completion_length=8",
        "~data.rewards.format",
        "+data.rewards.e={weight: 1.0, function: {_target_: tests.test_grpo.e_share, _partial_: true} }",
    ]
    keys = {o.split("=")[0] for o in more}
    return [o for o in base if o.split("=")[0] not in keys] + list(more)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("grpo.num_generations=1", "grpo.num_generations=1: GRPO compares"),
        ("peft=none", "grpo.beta=0.04: the KL reference is the model with its LoRA adapters off, and peft=none has no such model"),
        ("peft.init_lora_weights=pissa", "adapters off, and peft.init_lora_weights=pissa has no such model; fix: peft=lora"),
        ("grpo.epsilon_high=0.1", "grpo.epsilon_high=0.1 must be null or >= grpo.epsilon"),
        ("grpo.loss_aggregation=mean", "grpo.loss_aggregation='mean' is not one of"),
        ("data.max_completion_length=56", "data.max_completion_length=56 must be"),
        ("data.rewards={}", "data.rewards={} must name at least one"),
    ],
)
def test_bad_grpo_settings_are_refused_before_anything_loads(pretrained_folder, pair_files, tmp_path, change, message):  # noqa: F811
    from {{ cookiecutter.package_name }}.train import train

    cfg = compose_config("train", grpo_overrides(pretrained_folder, pair_files, tmp_path / "run", change))
    if change == "data.rewards={}":
        cfg.data.rewards = {}  # (a dict override merges into the composed one)
    with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_short_grpo_run_raises_its_reward_and_eval_repeats_the_test_figures(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.eval import evaluate
    from {{ cookiecutter.package_name }}.train import train

    run_dir = tmp_path / "run"
    # A full fine-tune without the KL term learns fastest on a tiny model (LoRA's adapters start at zero); LoRA and the KL
    # term run in tests/e2e/test_grpo_resume.py.
    fast = ("peft=none", "grpo.beta=0.0", "trainer.max_steps=24", "trainer.val_check_interval=12")
    overrides = grpo_overrides(pretrained_folder, pair_files, run_dir, *fast)
    metrics = train(compose_config("train", overrides))
    for name in ("reward", "reward_e", "reward_std", "zero_std_share", "completion_length"):
        assert math.isfinite(metrics[f"val/{name}"]) and math.isfinite(metrics[f"test/{name}"]), name
    assert metrics["val/reward"] > metrics["val/reward_start"] + 0.2, metrics  # (0.05 -> 0.5 here)
    rows = [row for row in (run_dir / "csv").rglob("metrics.csv")][0].read_text().splitlines()
    assert all(name in rows[0] for name in ("train/reward_e", "train/kl", "train/clipped", "train/zero_std_share"))
    again = evaluate(
        compose_config("eval", [*overrides, f"ckpt_path={metrics['best_checkpoint']}", f"paths.output_dir={tmp_path / 'eval'}"])
    )
    assert again["test/reward"] == pytest.approx(metrics["test/reward"], abs=1e-6)  # the same seeded samples


def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_row(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.train import train

    failing = "+data.rewards.strict={weight: 1.0, function: {_target_: tests.test_grpo.fails_on_awful, _partial_: true} }"
    cfg = compose_config("train", grpo_overrides(pretrained_folder, pair_files, tmp_path / "run", failing, "trainer.max_steps=4"))
    with pytest.raises(DataError, match=r"data.rewards.strict raised ValueError: no awful reviews on data.splits.\w+ row \d+"):
        train(cfg)


# ------------------------------------------------------------------ the planner
def plan_overrides(folder, files, run_dir, *more: str) -> list[str]:
    return grpo_overrides(folder, files, run_dir, "batch.micro_batch_size=1", "batch.global_batch_size=1", *more)


def test_the_plan_is_the_larger_of_sampling_and_forward_backward(pretrained_folder, pair_files, tmp_path, monkeypatch):  # noqa: F811
    from {{ cookiecutter.package_name }}.core.memory.planner import GIB, plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    cfg = compose_config("plan", plan_overrides(pretrained_folder, pair_files, tmp_path / "run"))
    task = task_of(cfg)
    traced = plan_memory(cfg, task, search=False)
    assert any(note.startswith("sampling phase: ") for note in traced.corrections)
    assert any(note.endswith("the table is the largest (forward/backward)") for note in traced.corrections)
    config = AutoConfig.from_pretrained(pretrained_folder)
    cache = task.memory_phases(cfg, config, 1, 4)["sampling"]["activations"]
    per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * config.num_hidden_layers * 4
    assert cache == 4 * 56 * per_token  # G=4 sequences of data.max_length=56 tokens, fp32
    huge = {"sampling": {"activations": 1 * GIB, "temporaries": GIB // 2, "grads": False}}
    monkeypatch.setattr(type(task), "memory_phases", lambda self, *args: huge)
    sampling = plan_memory(cfg, task, search=False)
    assert sampling.grads == 0 and sampling.activations == GIB and sampling.temporaries == GIB // 2
    assert sampling.peak_allocated == sampling.params + sampling.buffers + sampling.optimizer + GIB + GIB // 2
    assert any(note.endswith("the table is the largest (sampling)") for note in sampling.corrections)


def test_the_largest_g_that_fits_equals_a_brute_force_scan(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.core.memory import modes
    from {{ cookiecutter.package_name }}.core.memory.planner import GIB, architecture, plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    base = plan_overrides(pretrained_folder, pair_files, tmp_path / "run")
    totals = {}
    for g in range(1, 13):
        cfg = compose_config("plan", [*base, f"grpo.num_generations={g}"])
        totals[g] = plan_memory(cfg, task_of(cfg), search=False).total
    assert all(totals[g] < totals[g + 1] for g in range(1, 12))
    for budget, expected in (((totals[5] + totals[6]) / 2, 5), (totals[12] + 1, 12)):
        cfg = compose_config(
            "plan",
            [*base, "plan.mode=largest", "plan.key=grpo.num_generations", "plan.max_value=12", f"hardware.budget_gib={budget / GIB}"],
        )
        found = modes.largest_value(cfg, task_of(cfg), architecture(cfg))
        assert found.value == expected and found.plan.total == totals[expected] and found.traces < 12
        assert ("over the budget" if expected < 12 else "search bound") in found.text("cpu")
    cfg = compose_config("plan", [*base, "plan.mode=longest", "plan.length_step=8", "plan.max_length=128"])
    longest = modes.longest_context(cfg, task_of(cfg), architecture(cfg))
    assert longest.changes == {
        "data.max_length": longest.length,
        "data.max_completion_length": longest.length - 48,
    }  # the prompt's room kept
    with pytest.raises(ConfigError, match="plan.key='grpo' names"):
        modes.check_mode(compose_config("plan", [*base, "plan.mode=largest", "plan.key=grpo"]))


def test_quantize_refuses_a_task_without_a_quality_metric(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    from {{ cookiecutter.package_name }}.quantize import quantize

    (tmp_path / "x.ckpt").write_bytes(b"")  # (refused before it is read)
    cfg = compose_config("quantize", [*grpo_overrides(pretrained_folder, pair_files, tmp_path / "run"), f"ckpt_path={tmp_path / 'x.ckpt'}"])
    with pytest.raises(ConfigError, match="task=grpo has no quality metric"):
        quantize(cfg)


def test_a_trained_reward_model_scores_completions_as_predict_does(pretrained_folder, pair_files, tmp_path):  # noqa: F811
    import json

    from {{ cookiecutter.package_name }}.predict import predict
    from {{ cookiecutter.package_name }}.tasks.grpo.rewards import RewardModelScore
    from {{ cookiecutter.package_name }}.train import train

    from .test_preference import write_jsonl
    from .test_reward import reward_overrides

    run_dir = tmp_path / "reward"
    overrides = reward_overrides(pretrained_folder, pair_files, run_dir, "peft=none", "trainer.max_steps=2", "trainer.val_check_interval=2")
    train(compose_config("train", overrides))
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    answers = [{"prompt": "the plot", "completion": "great fun"}, {"prompt": "the acting", "completion": "dull and bad"}]
    command = [*overrides, f"ckpt_path={checkpoint}", f"input={write_jsonl(tmp_path / 'answers.jsonl', answers)}"]
    written = predict(compose_config("predict", [*command, f"output={tmp_path / 'rewards.jsonl'}", f"paths.output_dir={tmp_path / 'p'}"]))
    expected = [json.loads(line)["reward"] for line in written.read_text().splitlines()]
    score = RewardModelScore(str(checkpoint), batch_size=1)  # (other batches: other padding)
    assert score([a["prompt"] for a in answers], [a["completion"] for a in answers]) == pytest.approx(expected, abs=1e-5)
    assert expected[0] != expected[1]
    # The plan of a GRPO run scoring with it counts the reward model's weights as they load, in every phase.
    from omegaconf import open_dict

    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    cfg = compose_config("plan", plan_overrides(pretrained_folder, pair_files, tmp_path / "plan"))
    without = plan_memory(cfg, task_of(cfg), search=False)
    with open_dict(cfg):
        cfg.data.rewards = {
            "rm": {"weight": 1.0, "function": {"_target_": f"{RewardModelScore.__module__}.RewardModelScore", "ckpt_path": str(checkpoint)}}
        }
    planned = plan_memory(cfg, task_of(cfg), search=False)
    loaded = sum(parameter.numel() * parameter.element_size() for parameter in score.module.model.parameters())
    assert planned.buffers - without.buffers == loaded and planned.peak_allocated - without.peak_allocated == loaded
    assert any(note.startswith("data.rewards.rm (a reward model): ") for note in planned.corrections)
    from {{ cookiecutter.package_name }}.generate import generate  # a reward model writes no text: the verb is named, not the task

    with pytest.raises(ConfigError, match=r"holds a model of task=reward, and this command loads task=causal_lm models only"):
        generate(
            compose_config("generate", [*overrides, f"ckpt_path={checkpoint}", "prompts=[the plot]", f"paths.output_dir={tmp_path / 'g'}"])
        )
