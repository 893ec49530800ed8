"""Token classification as a user runs it, each verb in its own process: train (killed mid-run
and resumed: the same losses as the run never killed), eval, predict, plan, quantize, and an
Optuna sweep on ``val/f1``."""

from __future__ import annotations

import json
import signal

from omegaconf import OmegaConf

from ..processes import WITHOUT_FAULT, checkpoint_step, ok, run_module, run_train, step_losses, without_output_dir
from ..test_token_classification import make_ner_data, make_ner_tokenizer, ner_overrides, ner_rows, write_conll


def test_train_killed_and_resumed_then_eval_predict_plan_quantize_and_a_sweep(tmp_path):
    tokenizer, data = make_ner_tokenizer(tmp_path / "tokenizer"), make_ner_data(tmp_path / "data")
    base = without_output_dir(ner_overrides(tokenizer, data, tmp_path / "run")) + [
        "batch.global_batch_size=16",
        "batch.micro_batch_size=8",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        "callbacks.step_checkpoint.every_n_train_steps=3",
        "optimizer.lr=3e-3",
    ]
    # 120 training sentences / 16 per step: 8 optimizer steps an epoch, 16 in all.
    reference = tmp_path / "reference"
    ok(run_train(reference, base))
    losses = step_losses(reference)
    assert sorted(losses) == list(range(16))
    metrics = json.loads((reference / "metrics.json").read_text())
    assert {"val/f1", "val/acc", "test/f1", "test/f1_PER", "test/words_cut"} <= set(metrics)

    killed = tmp_path / "killed"
    fault = ["+callbacks.fault._target_=faults.KillAt", "+callbacks.fault.step=10", "+callbacks.fault.micro_batch=1"]
    assert run_train(killed, base + fault).returncode == -signal.SIGKILL
    assert checkpoint_step(killed / "checkpoints" / "last.ckpt") == 9
    ok(run_train(killed, base + ["ckpt_path=last", WITHOUT_FAULT]))
    assert step_losses(killed) == losses  # bit-identical, step by step

    ckpt = f"ckpt_path={metrics['best_checkpoint']}"  # the weights train's test scored
    ok(run_module("eval", [*base, ckpt, f"hydra.run.dir={tmp_path / 'eval'}"]))
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["test/f1"] == metrics["test/f1"] and evaluated["test/acc"] == metrics["test/acc"]

    sentences = write_conll(tmp_path / "new.conll", ner_rows(5, seed=9), docstart=False)
    ok(run_module("predict", [*base, ckpt, f"input={sentences}", f"hydra.run.dir={tmp_path / 'predict'}"]))
    written = [json.loads(line) for line in (tmp_path / "predict" / "predictions.jsonl").read_text().splitlines()]
    assert [row["tokens"] for row in written] == [row["tokens"] for row in ner_rows(5, seed=9)]
    assert all(len(row["tags"]) == len(row["tokens"]) and row["words_cut"] == 0 for row in written)

    # The checkpoint's data.max_length (16) unless the command line gives another: a 20-word sentence is cut at 16 tokens.
    unlengthed = [o for o in base if not o.startswith("data.max_length=")]
    long_input = write_conll(tmp_path / "long.conll", [{"tokens": ["alice", "met", "bob"] * 6 + ["in", "rome"], "tags": ["O"] * 20}])
    for given, cut in ((None, True), ("data.max_length=64", False)):
        out = tmp_path / f"long_{bool(given)}.jsonl"
        shown = ok(run_module("predict", [*unlengthed, *([given] if given else []), ckpt, f"input={long_input}", f"output={out}"]))
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert (row["words_cut"] > 0) is cut and len(row["tags"]) == 20
        said = "as given; the checkpoint was trained with data.max_length=16" if given else "=16, as the checkpoint was trained"
        assert said in shown.stdout + shown.stderr, shown.stdout[-2000:]

    plan = ok(run_module("plan", [*base, "hardware=rtx4090_24gb"]))
    assert "Verdict:" in plan.stdout and "fits" in plan.stdout

    quantized = tmp_path / "quantized"
    fast = ["latency.batch_size=4", "latency.sequence_length=16", "latency.warmup=1", "latency.repeats=3"]
    ok(run_module("quantize", [*base, ckpt, "variants=[fp32,int8_weight_only]", f"output_dir={quantized}", *fast]))
    report = json.loads((quantized / "compress_report.json").read_text())
    fp32 = next(row for row in report["variants"] if row["name"] == "fp32")
    assert fp32["metrics"]["f1"] == metrics["test/f1"]  # the same scorer as eval's, on the same split

    sweep = [*base, f"paths.log_dir={tmp_path / 'logs'}", "hparams_search=token_classification_optuna", "hydra.sweeper.n_trials=2"]
    swept = ok(run_module("train", [*sweep, "trainer.max_epochs=1"], cwd=tmp_path))
    evaluate = [line for line in (swept.stdout + swept.stderr).splitlines() if ".eval " in line]
    assert evaluate and not any("hparams_search" in line for line in evaluate)  # a trial's own command, not the sweep's
    (sweep_dir,) = (tmp_path / "logs" / "train" / "sweeps").iterdir()
    best = OmegaConf.load(sweep_dir / "best.yaml")
    assert best.optimized_metric == "val/f1"
    assert best.best_value == json.loads((sweep_dir / str(best.best_trial) / "metrics.json").read_text())["val/f1"]
