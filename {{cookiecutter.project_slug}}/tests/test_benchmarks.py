"""lm-evaluation-harness tasks: during a LoRA run (start and each validation, one row a step across a resume), on its
checkpoint and its export (the same scores), the planner's lm-eval pass, and the refusals before anything loads."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.loggers.metrics_csv import read_metrics
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.export import export
from {{ cookiecutter.package_name }}.tasks.causal_lm import benchmarks
from {{ cookiecutter.package_name }}.train import train

from .conftest import common_overrides, compose_config, lm_overrides

TASK = "shakespeare_next_line"
KEY = f"lm_eval/{TASK}/acc"


def lora_overrides(lm_tokenizer_dir, lm_text, pretrained_lm_dir, run_dir) -> list[str]:
    return lm_overrides(lm_tokenizer_dir, lm_text, run_dir) + [
        f"model.name_or_path={pretrained_lm_dir}",
        "model.config=null",
        "peft=lora",
        "peft.r=4",
        "optimizer.lr=1e-2",
        "trainer.val_check_interval=2",
        "callbacks.sample_generation=null",
    ]


@pytest.fixture(scope="module")
def benchmarked_run(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path_factory):
    """A LoRA run with callbacks=benchmarks: 2 steps, then resumed to 4; returns (run_dir, overrides, metrics)."""
    run_dir = tmp_path_factory.mktemp("benchmarks") / "run"
    overrides = lora_overrides(lm_tokenizer_dir, lm_text, pretrained_lm_dir, run_dir) + [
        "callbacks=benchmarks",
        f"benchmarks.tasks=[{TASK}]",
        "callbacks.benchmarks.limit=8",
        "callbacks.benchmarks.max_length=128",  # (the tiny tokenizer spells Shakespeare byte by byte)
    ]
    train(compose_config("train", [*overrides, "trainer.max_steps=2"]))
    metrics = train(compose_config("train", [*overrides, "trainer.max_steps=4", "ckpt_path=last"]))
    return run_dir, overrides, metrics


def test_a_run_logs_lm_eval_scores_at_its_start_and_each_validation_one_row_a_step(benchmarked_run):
    run_dir, _, metrics = benchmarked_run
    written = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= written[f"{KEY}_start"] <= 1 and 0 <= written[KEY] <= 1, written
    assert written[KEY] == metrics[KEY]
    assert f"{KEY}_stderr" not in written  # (no stderr during training: lm-eval computes none with bootstrap_iters=0)
    rows = read_metrics(run_dir / "csv")
    steps = [row["step"] for row in rows if row.get(KEY, "") != ""]
    # the start, the validations of both launches (in val/loss's rows), one row a step: the resume repeated none
    assert len(steps) == 3 == len(set(steps)) and steps == [row["step"] for row in rows if row.get("val/loss", "") != ""]
    assert not any(key.endswith("sample_len") for key in written)  # (lm-eval's counts are not scores)
    # 8 documents: every score is a count of eighths
    assert all(float(row[KEY]) * 8 == round(float(row[KEY]) * 8) for row in read_metrics(run_dir / "csv") if row.get(KEY, "") != "")


def test_eval_on_the_checkpoint_and_its_export_give_the_same_scores(benchmarked_run, tmp_path):
    run_dir, overrides, _ = benchmarked_run
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    bench = [f"benchmarks.tasks=[{TASK}]", "benchmarks.limit=24", "benchmarks.batch_size=8"]
    on_ckpt = evaluate(compose_config("eval", [*overrides, f"ckpt_path={ckpt}", *bench, f"paths.output_dir={tmp_path / 'e1'}"]))
    report = json.loads((tmp_path / "e1" / "benchmarks.json").read_text())
    assert report["results"][TASK]["acc,none"] == on_ckpt[KEY] and report["versions"][TASK] == 1.0
    assert report["settings"]["apply_chat_template"] is False  # (null resolved: the run trained on plain text)
    assert report["lm_eval_version"] and len(report["config_hash"]) == 64 and report["n-samples"][TASK]["effective"] == 24
    assert json.loads((tmp_path / "e1" / "metrics.json").read_text())[KEY] == on_ckpt[KEY]
    out = tmp_path / "exported"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path / 'x'}"]))
    on_export = evaluate(compose_config("eval", [*overrides, f"model_dir={out}", *bench, f"paths.output_dir={tmp_path / 'e2'}"]))
    # Adapters unmerged vs merged: the log-likelihoods differ by float rounding only, so at most a near-tie flips
    # (tolerance: one document of 24); on this model none does.
    for metric in ("acc", "acc_norm"):
        key = f"lm_eval/{TASK}/{metric}"
        assert abs(on_ckpt[key] - on_export[key]) <= 1 / 24 and on_ckpt[key] == on_export[key], (on_ckpt, on_export)


def test_the_plan_counts_one_batch_of_lm_eval_requests(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path, monkeypatch):
    from {{ cookiecutter.package_name }}.core.memory.planner import plan_memory
    from {{ cookiecutter.package_name }}.tasks import task_of

    overrides = lora_overrides(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path / "run")
    plain = compose_config("plan", overrides)
    cfg = compose_config("plan", [*overrides, "callbacks=benchmarks", f"benchmarks.tasks=[{TASK}]", "benchmarks.batch_size=64"])
    config = AutoConfig.from_pretrained(pretrained_lm_dir)
    phase = task_of(cfg).memory_phases(cfg, config, 8, 4)["lm-eval"]
    # 64 requests of data.max_length=32 tokens: fp32 logits and their fp32 log-softmax, one layer's MLP, the residual stream
    assert phase["temporaries"] == 64 * 32 * config.vocab_size * 8 + 3 * 64 * 32 * config.intermediate_size * 4
    assert phase["activations"] == 2 * 64 * 32 * config.hidden_size * 4 and phase["grads"]
    without, planned = plan_memory(plain, task_of(plain), search=False), plan_memory(cfg, task_of(cfg), search=False)
    assert any(note.startswith("lm-eval phase: ") for note in planned.corrections)
    assert any(note.endswith("the table is the largest (lm-eval)") for note in planned.corrections)
    assert planned.peak_allocated == planned.params + planned.buffers + planned.grads + planned.optimizer + sum(
        phase[k] for k in ("activations", "temporaries")
    )
    assert planned.peak_allocated > without.peak_allocated


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "benchmarks.tasks=[shakespeare_nextline]",
            r"'shakespeare_nextline' is not an lm-eval task, group or tag .*close: shakespeare_next_line",
        ),
        (
            "benchmarks.tasks=[arc_easy]",
            r"lm-eval task 'arc_easy' \(allenai/ai2_arc\) reads its data set from the Hugging Face Hub, which cannot be reached \(no "
            r"network here\), and it is not in the local cache; fix: on a machine with internet run `hf download allenai/ai2_arc --repo-type dataset`",
        ),
        (  # every task named, in the order given, each data set downloaded once
            "benchmarks.tasks=[arc_easy,hellaswag]",
            r"tasks 'arc_easy' \(allenai/ai2_arc\), 'hellaswag' \(Rowan/hellaswag\) read their data sets .* run `hf download "
            r"allenai/ai2_arc --repo-type dataset && hf download Rowan/hellaswag --repo-type dataset`",
        ),
        (  # a tag: its tasks
            "benchmarks.tasks=[ai2_arc]",
            r"tasks 'arc_(easy|challenge)' \(allenai/ai2_arc\), 'arc_(easy|challenge)' \(allenai/ai2_arc\) read .*run `hf download "
            r"allenai/ai2_arc --repo-type dataset`, copy",
        ),
        ("benchmarks.batch_size=0", r"benchmarks.batch_size=0 must be an integer >= 1"),
        ("benchmarks.limit=-3", r"benchmarks.limit=-3 must be null"),
        ("benchmarks.include_path=/no/such/folder", r"benchmarks.include_path='/no/such/folder' is not a folder"),
    ],
)
def test_bad_benchmarks_are_refused_in_one_line_before_the_model_loads(benchmarked_run, tmp_path, monkeypatch, change, message):
    import {{ cookiecutter.package_name }}.generate as generate

    monkeypatch.setattr(benchmarks, "unreachable_reason", lambda: "no network here")
    monkeypatch.setattr(benchmarks, "cached_dataset", lambda path: False)
    monkeypatch.setattr(generate, "load_generator", lambda cfg: pytest.fail("the model loaded before the check"))
    ckpt = benchmarked_run[0] / "checkpoints" / "last.ckpt"
    # no experiment=: the checkpoint's stored task is the one that benchmarks (the default config's may be another)
    cfg = compose_config("eval", [*common_overrides(tmp_path / "e"), f"ckpt_path={ckpt}", f"benchmarks.tasks=[{TASK}]", change])
    with pytest.raises(ConfigError, match=message) as raised:
        evaluate(cfg)
    assert "\n" not in str(raised.value).strip() or str(raised.value).startswith("Invalid config")
    assert not (tmp_path / "e" / "benchmarks.json").exists()


def test_a_task_that_scores_no_causal_lm_refuses_benchmarks(tmp_path):
    from {{ cookiecutter.package_name }}.tasks import tasks

    reward = tasks().get("reward")
    with pytest.raises(ConfigError, match=r"lm-eval scores causal LMs, and task=reward models are not; fix: benchmarks.tasks=\[\]"):
        reward.benchmark(None, lambda: pytest.fail("loaded"), tmp_path)


def test_the_callback_refuses_no_tasks_before_the_run_starts():
    with pytest.raises(ConfigError, match=r"benchmarks.tasks=\[\] must be a non-empty list of lm-eval task names; fix: benchmarks.tasks="):
        benchmarks.Benchmarks(tasks=[], max_length=64)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "torch.bfloat16"), ("32-true", "None"), ("bf16-true", "None")])
def test_the_callback_runs_lm_eval_under_the_runs_autocast(monkeypatch, precision, dtype):
    from types import SimpleNamespace

    seen = {}
    monkeypatch.setattr(benchmarks, "run_benchmarks", lambda *args, **options: seen.update(options) or {"results": {}})
    callback = benchmarks.Benchmarks(tasks=[TASK], max_length=64)
    trainer = SimpleNamespace(sanity_checking=False, precision=precision)
    module = SimpleNamespace(model=None, tokenizer=None, chat=False, inputs=SimpleNamespace(system_prompt=None))
    callback.on_validation_epoch_end(trainer, module)
    # lm-eval's forward sets its own autocast (enabled only with a dtype), which switches any outer one off
    assert str(seen["mixed_precision_dtype"]) == dtype and seen["max_length"] == 64 and seen["torch_random_seed"] is None
