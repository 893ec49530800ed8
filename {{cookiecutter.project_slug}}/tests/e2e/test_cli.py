"""The command lines themselves: a bad config stops before anything loads, with its message alone
(no traceback); ``plan`` writes its files and plans GPU-only choices on a CPU machine."""

from __future__ import annotations

{% if cookiecutter.tasks != "classification" %}import json

{% endif %}from ..processes import run_module


def test_cli_rejects_a_bad_batch_and_a_misspelt_key_before_loading_anything(tmp_path):
    overrides = ["batch.global_batch_size=10", "batch.micro_batch_size=4", f"hydra.run.dir={tmp_path}",
                 f"paths.cache_dir={tmp_path}/cache", "logger=none", "+callbacks.model_checkpoint.save_top=2"]  # fmt: skip
    result = run_module("train", overrides)
    assert result.returncode == 1
    assert "batch.global_batch_size=10 is not divisible by batch.micro_batch_size=4" in result.stderr
    # The misspelt key, the node and the valid keys, in the same one message.
    assert "callbacks.model_checkpoint.save_top is not a key of callbacks.model_checkpoint: did you mean" in result.stderr
    assert "save_top_k" in result.stderr
    assert "Traceback" not in result.stderr  # the message alone, not under a stack trace
    assert not (tmp_path / "cache").exists()  # nothing was fetched
    assert not (tmp_path / "checkpoints").exists()
{%- if cookiecutter.tasks != "classification" %}


def test_plan_writes_json_and_text_and_plans_gpu_only_choices_on_a_cpu_machine(tmp_path):
    """plan is for the hardware group, not this machine: 16-mixed is planned, not refused."""
    from ..test_planner import TINY_LM

    run = tmp_path / "run"
    result = run_module("plan", [*TINY_LM[:-1], "precision=16-mixed", "hardware=rtx4090_24gb", f"hydra.run.dir={run}"])
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads((run / "plan.json").read_text())
    for key in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "total_gib", "budget_gib", "fits", "max_micro_batch"):
        assert key in written, key
    assert written["fits"] is True and written["max_micro_batch"] == 16 and written["hardware"] == "rtx4090_24gb"
    assert "Verdict:" in (run / "plan.txt").read_text() and "Verdict:" in result.stdout


def test_plan_mode_from_the_command_line(tmp_path):
    from ..test_planner import TINY_LM

    run, one = tmp_path / "run", ("batch.micro_batch_size=1", "batch.global_batch_size=1")
    result = run_module("plan", [*TINY_LM, "plan.mode=longest", "plan.length_step=256", *one, f"hydra.run.dir={run}"])
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads((run / "plan.json").read_text())
    assert written["mode"] == "longest" and written["longest_max_length"] == 1024 and written["fits"] is True  # the 1,024 positions
    assert "Longest context that fits: data.max_length=1024" in result.stdout


def test_inspect_data_exits_2_naming_a_row_whose_answer_is_truncated_away(lm_tokenizer_dir, tmp_path):
    rows = [{"prompt": "the king", "completion": "speaks"}, {"prompt": " ".join(["the fool"] * 40), "completion": "night"}]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = ["task=causal_lm", "model=tiny_llama", f"model.tokenizer={lm_tokenizer_dir}", "model.fetch=null", "data=chat",
                 "data.chat_template=plain", f"data.splits.train={train}", "data.max_length=64", "color=never",
                 f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]  # fmt: skip
    result = run_module("inspect_data", overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "1 of 2 rows would be dropped by train, eval and test: rows [1], with no trained token" in result.stdout
    assert "[[speaks<|endoftext|>]]" in result.stdout  # the plain template: the answer and EOS trained
{%- endif %}
