"""Smoke tests of the template's own ``bench/`` scripts (they stay in the template repository, not in a
bake): tests/test_bake.py copies them and these tests into the default bake (``bench/``,
``tests/slow/``) before its suite runs.  Each script runs end to end at tiny sizes and prints its last
line in the documented form; a benchmark that nothing runs stops running unnoticed."""

from __future__ import annotations

import json
import os
import re

from .test_bench_scripts import BENCH, run_bench  # (the bake's own, beside this file once copied)


def load_bench(name: str):
    """``bench/<name>.py`` imported as a module (its classes tested without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_to_accuracy_bench_prints_both_times_and_the_ratio(tokenizer_dir, toy_data, tmp_path):
    from ..conftest import tiny_overrides

    # The bench puts its runs in a folder of its own; target 0: the first validation reaches it.
    overrides = [o for o in tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run") if not o.startswith("paths.output_dir")]
    lines = run_bench(
        "time_to_accuracy.py", "--target", "0", "--every", "2", "--seeds", "1", "2", "--overrides", *overrides, "trainer.max_epochs=2"
    )
    assert re.fullmatch(r"project_s=\d+\.\d hf_trainer_s=\d+\.\d ratio=\d+\.\d{3}", lines[-1]), lines[-1]
    for seed in (1, 2):  # each side once per seed, the median of each over the seeds last
        for side in ("project", "hf_trainer"):
            assert any(re.match(rf"seed {seed} +{side}: .*\(val acc", line) for line in lines), lines
    assert re.fullmatch(r"ratio per seed: \d+\.\d{3} \d+\.\d{3}; medians over 2 seeds:", lines[-2]), lines[-2]


def test_time_to_accuracy_hands_the_hf_trainer_the_projects_epoch_orders():
    # The HF side's rows, pass after pass, are the project's sampler's epochs 0, 1, ... (a
    # different order each epoch), so both sides train on the same micro-batches in sequence.
    from my_4090_project.core.data.sampling import ResumableSampler

    bench = load_bench("time_to_accuracy")
    lengths = [(7 * i) % 23 + 1 for i in range(100)]
    hf_rows = bench.ProjectOrder([{"row": i} for i in range(100)], ResumableSampler(100, seed=3, lengths=lengths, batch_size=8))
    passes = [[row["row"] for row in hf_rows] for _ in range(2)]
    project = ResumableSampler(100, seed=3, lengths=lengths, batch_size=8)
    for epoch, seen in enumerate(passes):
        project.set_epoch(epoch)
        assert seen == list(project), epoch
    assert passes[0] != passes[1] and sorted(passes[0]) == list(range(100))


def test_time_to_accuracy_counts_the_hf_trainers_evaluations_at_the_projects_steps_only():
    # The HF Trainer also evaluates at the run's last step (265 of an epoch); the project does not
    # validate there, so a crossing at that step would be a chance only one side had.
    from types import SimpleNamespace

    timer = load_bench("time_to_accuracy").HFUntilAccuracy(target=0.82, every=50)
    timer.on_train_begin(None, None, None)
    control = SimpleNamespace(should_training_stop=False)
    timer.on_evaluate(None, SimpleNamespace(global_step=265), control, metrics={"eval_accuracy": 0.9})
    assert timer.accuracy is None and not control.should_training_stop
    timer.on_evaluate(None, SimpleNamespace(global_step=250), control, metrics={"eval_accuracy": 0.9})
    assert (timer.accuracy, timer.step, control.should_training_stop) == (0.9, 250, True)


def test_time_to_accuracy_shared_dropout_gives_both_sides_the_same_masks():
    # Two copies of a model, each side drawing from the global generator in between as it likes
    # (loaders, evaluation): with SharedDropout both draw the same masks forward after forward;
    # the masks still differ from one forward to the next, and evaluation forwards do not count.
    import torch

    bench = load_bench("time_to_accuracy")
    x = torch.ones(4, 64)

    def side(disturb: int) -> list[torch.Tensor]:
        model = torch.nn.Dropout(0.5)
        bench.SharedDropout(seed=42).attach(model)
        outputs = []
        for _ in range(3):
            torch.rand(disturb)  # (whatever else this side draws between two steps)
            model.eval()
            model(x)
            model.train()
            outputs.append(model(x))
        return outputs

    first, second = side(disturb=1), side(disturb=1000)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


def test_identity_cost_bench_prints_first_and_cached_hash_times(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (tmp_path / "train.csv").write_text("text,label\n" + "a good film,positive\n" * 100)
    lines = run_bench("identity_cost.py", "--files", str(tmp_path / "model"), str(tmp_path / "train.csv"))
    assert re.fullmatch(r"first_s=\d+\.\d{3} cached_s=\d+\.\d{4} launch_check_s=\d+\.\d{4} gb_per_s=\d+\.\d{2}", lines[-1]), lines[-1]
    assert lines[0].split()[0] == "path" and len(lines) == 4, lines


def test_answers_bench_prints_the_three_ways_and_their_ratios(tmp_path):
    from ..conftest import byte_level_bpe, lm_documents
    from ..test_chat_data import CHATML, END, EOS, START, chat_overrides, chat_rows, tiny_llama, write_jsonl

    tokenizer = byte_level_bpe(
        lm_documents(200, seed=0) + ["user assistant system"] * 20, [EOS, START, END], eos_token=END, bos_token=START
    )
    tokenizer.chat_template = CHATML
    pretrained = tmp_path / "pretrained"
    tiny_llama(tokenizer, "sdpa").save_pretrained(pretrained)
    tokenizer.save_pretrained(pretrained)
    data = {
        split: write_jsonl(tmp_path / f"{split}.jsonl", chat_rows(8, seed=seed))
        for seed, split in enumerate(("train", "validation", "test"))
    }
    overrides = [o for o in chat_overrides(pretrained, data, pretrained, tmp_path / "run") if not o.startswith("peft")]
    lines = run_bench("answers.py", "--experiment", "none", "--rows", "8", "--batch-size", "3", "--repeats", "1", "--overrides", *overrides)
    number = r"\d+\.\d{3}"
    last = rf"answers_per_s={number} vs_one_at_a_time={number} vs_unsorted={number} exact_match_delta=[0-9.]+ same_answers=[0-9.]+"
    assert re.fullmatch(last, lines[-1]), lines[-1]
    assert lines[-1].endswith("exact_match_delta=0.0000 same_answers=1.0000")  # fp32, padding masked: the same answers
    assert lines[0].startswith("8 prompts of ")


def test_step_time_bench_prints_its_error(tmp_path):
    lines = run_bench(
        "step_time.py", "--cases", "tiny_llama_2l", "--steps", "1", "--overrides", "data.max_length=32", f"paths.cache_dir={tmp_path}"
    )
    assert re.fullmatch(r"max_abs_error_pct=\d+\.\d", lines[-1]), lines[-1]
    assert lines[0].startswith("peaks of this CPU") and "hardware.memory_gbps=" in lines[0]
    assert re.match(r"tiny_llama_2l +predicted +\d+\.\d ms +measured +\d+\.\d ms +error", lines[1]), lines[1]


def test_planner_accuracy_bench_prints_its_error(tmp_path):
    case, shape = "llama_fp32", ["data.max_length=64", "batch.micro_batch_size=2", "batch.global_batch_size=2"]
    lines = run_bench("planner_accuracy.py", "--cases", case, "--overrides", *shape, f"paths.cache_dir={tmp_path}")
    assert re.fullmatch(r"max_abs_error_pct=\d+\.\d", lines[-1]), lines[-1]
    assert lines[0].startswith(case) and "predicted" in lines[0]


def test_text_pipeline_bench_prints_padding_and_the_tokenisation_ratio(lm_tokenizer_dir, tmp_path):
    from ..conftest import lm_documents

    files = {}
    for split, seed in (("train", 1), ("validation", 2)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": doc}) + "\n" for doc in lm_documents(12, seed=seed)))
    lines = run_bench(
        "text_pipeline.py",
        "--max-length=32",
        "--repeats=1",
        f"--train={files['train']}",
        f"--validation={files['validation']}",
        f"--tokenizer={lm_tokenizer_dir}",
    )
    assert re.fullmatch(r"pipeline_vs_loop=\d+\.\d\d", lines[-1]), lines[-1]
    assert lines[0].startswith("padding fraction") and "pad_paragraphs=" in lines[0]
