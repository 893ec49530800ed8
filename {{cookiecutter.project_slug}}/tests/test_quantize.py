"""``quantize`` on the tiny models: the report's arithmetic, each variant loading with its one-liner
close to fp32, a folder that is complete or absent, refusals before anything is written, the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.core.compress.report import Measurement, build_report, latency_summary, markdown_report, ratio, weight_bytes
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.quantize import quantize
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config

# Small timed batches: the arithmetic is what is tested here, not the speed.
FAST = ["latency.batch_size=4", "latency.sequence_length=16", "latency.warmup=1", "latency.repeats=3"]


def measurement(name: str, size: int, acc: float, samples: list[float], runtime: str = "pytorch-eager-cpu", baseline: str = "fp32"):
    return Measurement(name, runtime, baseline, size, {"accuracy": acc}, samples, f"load({name})", "stored", f"/out/{name}")


def test_report_arithmetic_ratios_deltas_and_percentiles():
    measurements = [
        measurement("fp32", 4_000_000, 0.90, [10.0, 20.0, 30.0, 40.0, 50.0]),
        measurement("int8_dynamic", 1_000_000, 0.85, [5.0, 10.0, 15.0, 20.0, 25.0]),
        measurement("onnx_fp32", 4_200_000, 0.90, [8.0, 8.0, 8.0, 8.0, 8.0], "onnxruntime-cpu", "onnx_fp32"),
        measurement("onnx_int8", 1_100_000, 0.88, [4.0, 4.0, 4.0, 4.0, 6.0], "onnxruntime-cpu", "onnx_fp32"),
    ]
    refusals = [{"variant": "int4_weight_only", "reason": "no CUDA", "fix": "run on a GPU"}]
    context = {"source": "x.ckpt", "task": "classification", "split": "test", "rows": 5, "metric_names": ["accuracy"]}
    context["latency"] = {
        "batch_size": 4,
        "sequence_length": 16,
        "warmup": 1,
        "repeats": 5,
        "threads": 2,
        "device": "cpu",
        "load_average": 0.5,
    }
    report = build_report(measurements, refusals, context)
    rows = {v["name"]: v for v in report["variants"]}
    assert rows["int8_dynamic"]["size_mb"] == pytest.approx(1.0)
    assert rows["int8_dynamic"]["size_ratio"] == pytest.approx(0.25)
    assert rows["int8_dynamic"]["delta"]["accuracy"] == pytest.approx(-0.05)
    assert rows["fp32"]["latency_ms"]["p50"] == pytest.approx(30.0) and rows["fp32"]["latency_ms"]["p90"] == pytest.approx(46.0)
    assert rows["int8_dynamic"]["latency_ratio"]["p50"] == pytest.approx(0.5)
    # ONNX int8 against ONNX fp32 (same runtime), not against PyTorch fp32
    assert rows["onnx_int8"]["latency_ratio"]["p50"] == pytest.approx(4.0 / 8.0)
    assert rows["onnx_int8"]["latency_ratio"]["p90"] == pytest.approx(np.percentile([4, 4, 4, 4, 6], 90) / 8.0)
    assert rows["onnx_int8"]["size_ratio"] == pytest.approx(1.1 / 4.0)
    text = markdown_report(report)
    assert "| `int8_dynamic` | pytorch-eager-cpu | 1.00 | 0.250 | 0.8500 | -0.0500 |" in text
    assert "- `int4_weight_only`: no CUDA; fix: run on a GPU" in text


def test_percentiles_ratios_and_their_edge_cases():
    assert latency_summary([7.0]) == {"p50": 7.0, "p90": 7.0, "mean": 7.0, "n": 1}
    samples = [float(v) for v in range(1, 11)]
    summary = latency_summary(samples)
    assert summary["p50"] == pytest.approx(5.5) and summary["p90"] == pytest.approx(9.1)
    with pytest.raises(ValueError):
        latency_summary([])
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(math.nan, 2.0) is None
    with pytest.raises(ValueError, match="baseline 'fp32' was not measured"):
        build_report([measurement("int8_dynamic", 1, 0.5, [1.0])], [], {})


def test_weight_bytes_counts_weight_files_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model.onnx").write_bytes(b"x" * 10)
    (tmp_path / "model.onnx.data").write_bytes(b"x" * 5)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert weight_bytes(tmp_path) == 115
{%- if cookiecutter.tasks != "causal_lm" %}


# ----------------------------------------------------------------------------- classifier
@pytest.fixture(scope="module")
def classifier_report(classifier_ckpt, tmp_path_factory) -> dict:
    ckpt, base = classifier_ckpt
    out = tmp_path_factory.mktemp("quantized") / "compressed"
    run = tmp_path_factory.mktemp("quantize_run")
    return quantize(compose_config("quantize", base + FAST + [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={run}"]))


def test_the_classifier_folder_is_complete_and_each_variant_measured(classifier_report):
    out = Path(classifier_report["variants"][0]["path"]).parent
    names = [v["name"] for v in classifier_report["variants"]]
    assert names == ["fp32", "int8_weight_only", "int8_dynamic", "intx4_weight_only", "ptq_int8a_int4w", "onnx_fp32", "onnx_int8"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names + ["compress_report.json", "compress_report.md"])
    assert [p.name for p in out.parent.iterdir()] == ["compressed"]  # the staging folder is gone
    assert json.loads((out / "compress_report.json").read_text())["variants"][1]["name"] == "int8_weight_only"
    for v in classifier_report["variants"]:
        assert v["size_bytes"] == weight_bytes(Path(v["path"])) > 0
        assert 0.0 <= v["metrics"]["accuracy"] <= 1.0 and 0.0 <= v["metrics"]["f1_macro"] <= 1.0
        assert v["latency_ms"]["n"] == 3 and 0 < v["latency_ms"]["p50"] <= v["latency_ms"]["p90"]
    rows = {v["name"]: v for v in classifier_report["variants"]}
    assert rows["int8_weight_only"]["size_ratio"] < 0.6  # embeddings and Linear weights int8
    assert rows["onnx_int8"]["size_bytes"] < rows["onnx_fp32"]["size_bytes"]
    assert rows["onnx_int8"]["latency_baseline"] == "onnx_fp32" and rows["int8_dynamic"]["latency_baseline"] == "fp32"
    refused = {r["variant"]: r for r in classifier_report["refusals"]}
    assert set(refused) == {"int4_weight_only", "qat"} or torch.cuda.is_available()
    assert "CUDA" in refused["int4_weight_only"]["reason"] and "intx4_weight_only" in refused["int4_weight_only"]["fix"]
    assert "qat=int8a_int4w" in refused["qat"]["fix"]
    assert "## Refusals" in (out / "compress_report.md").read_text()


def test_each_classifier_variant_loads_with_its_one_liner_close_to_fp32(classifier_report, tokenizer_dir):
    import onnxruntime
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    batch = tokenizer(["the movie was great fun", "a dull and boring plot"], padding=True, return_tensors="pt")
    names = {"AutoModelForSequenceClassification": AutoModelForSequenceClassification, "onnxruntime": onnxruntime}
    logits = {}
    for v in classifier_report["variants"]:
        loaded = eval(v["load"], names)  # the report's own line
        if isinstance(loaded, onnxruntime.InferenceSession):
            logits[v["name"]] = torch.from_numpy(loaded.run(["logits"], {k: t.numpy() for k, t in batch.items()})[0])
        else:
            with torch.inference_mode():
                logits[v["name"]] = loaded(**batch).logits
    reference = logits.pop("fp32")
    scale = reference.abs().max()
    for name, value in logits.items():
        error = (value - reference).abs().max() / scale
        assert error < (0.2 if "4" in name else 0.05), (name, float(error))
    assert torch.equal(logits["onnx_fp32"].argmax(-1), reference.argmax(-1))


def test_refusals_name_field_value_and_fix_before_anything_is_written(classifier_ckpt, tmp_path, monkeypatch):
    import {{ cookiecutter.package_name }}.quantize as entry

    ckpt, base = classifier_ckpt
    monkeypatch.setattr(entry, "load_trained_module", lambda *args, **kwargs: pytest.fail("weights loaded before the config was checked"))
    out = tmp_path / "out" / "compressed"
    cases = {
        "variants=[fp32,int3]": r"variants: 'int3' is not a variant; fix: one of \[",
        "variants=[fp32,nf4]": r"variants: 'nf4' does not apply to task=classification .*fix: drop it",
        "variants=[int8_dynamic]": r"variants=\['int8_dynamic'\] has no fp32.*fix: add fp32",
        "latency.repeats=0": r"latency.repeats=0 must be an integer >= 1; fix: latency.repeats=8",
        "latency.sequence_length=9999": r"latency.sequence_length=9999 is more than the model's 512 positions; fix: latency.sequence_length=512",
        "variants=fp32": r"variants='fp32' must be a list; fix: variants=\[fp32\]",
        "group_size=48": r"group_size=48 does not divide the hidden size \(64\).*fix: group_size=32",
        "group_size=128": r"group_size=128 does not divide the hidden size \(64\)",
    }
    if not torch.cuda.is_available():
        cases["unavailable=error"] = r"variants: int4_weight_only cannot be made here: .*CUDA.*fix: variants=\[...,intx4_weight_only\]"
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            quantize(
                compose_config(
                    "quantize", base + [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path / 'run'}", override]
                )
            )
        assert not out.parent.exists() and not (tmp_path / "run").exists(), override
    out.mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"output_dir='{out}' exists; fix: output_dir=<a new path>, or overwrite=true to replace it"):
        quantize(compose_config("quantize", base + [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path / 'run'}"]))
    assert list(out.iterdir()) == []
    # overwrite=true replaces only a folder quantize wrote: an empty folder is not one
    with pytest.raises(ConfigError, match="is not a folder this command wrote"):
        quantize(
            compose_config(
                "quantize",
                base
                + FAST
                + ["variants=[fp32]", f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path / 'run2'}", "overwrite=true"],
            )
        )
    assert list(out.iterdir()) == []


def test_a_failure_midway_leaves_no_output_folder(classifier_ckpt, tmp_path, monkeypatch):
    import {{ cookiecutter.package_name }}.quantize as entry

    ckpt, base = classifier_ckpt

    def broken(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(entry, "export_onnx", broken)
    out = tmp_path / "out" / "compressed"
    with pytest.raises(RuntimeError, match="export failed"):
        quantize(
            compose_config(
                "quantize",
                base
                + FAST
                + [f"ckpt_path={ckpt}", f"output_dir={out}", "variants=[fp32,onnx_fp32]", f"paths.output_dir={tmp_path / 'run'}"],
            )
        )
    assert list(out.parent.iterdir()) == []


def test_a_structured_pruned_checkpoint_is_quantized_without_its_dead_neurons(tokenizer_dir, toy_data, classifier_report, tmp_path):
    from .conftest import tiny_overrides

    base = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run")
    pruned = ["pruning=structured", "pruning.final_sparsity=0.25", "pruning.end_step=4", "pruning.frequency=2"]
    train(compose_config("train", base + ["trainer.max_epochs=2", "test_after_fit=false", *pruned]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    report = quantize(
        compose_config(
            "quantize",
            base + FAST + ["variants=[fp32]", f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'out'}", f"paths.output_dir={tmp_path / 'q'}"],
        )
    )
    assert report["shrunk"] == "pruning=structured: shrink_ffn removed 32 of 128 FFN neurons per block"
    assert json.loads((tmp_path / "out" / "fp32" / "config.json").read_text())["intermediate_size"] == 96
    dense = next(v for v in classifier_report["variants"] if v["name"] == "fp32")
    assert report["variants"][0]["size_bytes"] < dense["size_bytes"]


def test_plot_draws_the_metric_against_size_and_latency(classifier_report, tmp_path):
    from {{ cookiecutter.package_name }}.core.errors import NothingToPlot
    from {{ cookiecutter.package_name }}.plot import plot

    out = Path(classifier_report["variants"][0]["path"]).parent
    written = plot(out / "compress_report.json", tmp_path / "plots")
    assert [p.name for p in written] == ["compression.png"]
    assert written[0].stat().st_size > 10_000
    assert [p.name for p in plot(out / "compress_report.md", tmp_path / "from_md")] == ["compression.png"]  # its table's JSON
    (tmp_path / "empty").mkdir()
    with pytest.raises(NothingToPlot, match=r"no compress_report.json \(quantize\); fix: pass"):
        plot(tmp_path / "empty")


def test_a_qat_checkpoint_converts_to_the_integer_model_it_was_trained_as(tokenizer_dir, toy_data, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from {{ cookiecutter.package_name }}.tasks.classification.module import SequenceClassificationModule

    from .conftest import tiny_overrides

    base = tiny_overrides(tokenizer_dir, toy_data, tmp_path / "run")
    train(compose_config("train", base + ["qat=int8a_int4w", "trainer.max_epochs=1", "test_after_fit=false"]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    out = tmp_path / "compressed"
    report = quantize(
        compose_config(
            "quantize",
            base
            + FAST
            + [f"ckpt_path={ckpt}", f"output_dir={out}", "variants=[fp32,qat,ptq_int8a_int4w]", f"paths.output_dir={tmp_path / 'q'}"],
        )
    )
    assert [v["name"] for v in report["variants"]] == ["fp32", "qat"]
    assert report["refusals"][0]["variant"] == "ptq_int8a_int4w" and "the qat variant itself" in report["refusals"][0]["reason"]
    batch = {"input_ids": torch.tensor([[2, 7, 12, 20, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    with torch.inference_mode():
        fake_quantised = SequenceClassificationModule.load_from_checkpoint(ckpt, map_location="cpu").eval()(batch)
        converted = AutoModelForSequenceClassification.from_pretrained(out / "qat")(**batch).logits
        plain = AutoModelForSequenceClassification.from_pretrained(out / "fp32")(**batch).logits
    # the integer model computes what training's fake quantisation did (up to the int8 embedding table)
    assert (converted - fake_quantised).abs().max() < (plain - fake_quantised).abs().max() or torch.allclose(
        plain, fake_quantised, atol=1e-6
    )
    assert (converted - fake_quantised).abs().max() < 0.05 * fake_quantised.abs().max()
{%- endif %}
{%- if cookiecutter.tasks != "classification" %}


# ------------------------------------------------------------------------------ causal LM
@pytest.fixture(scope="module")
def lm_ckpt(lm_tokenizer_dir, lm_text, tmp_path_factory) -> tuple[Path, list[str]]:
    from .conftest import lm_overrides

    run_dir = tmp_path_factory.mktemp("lm") / "run"
    base = lm_overrides(lm_tokenizer_dir, lm_text, run_dir) + ["callbacks.sample_generation=null"]
    train(compose_config("train", base + ["trainer.max_epochs=1"]))
    return run_dir / "checkpoints" / "last.ckpt", base


def test_causal_lm_variants_report_perplexity_and_load_close_to_fp32(lm_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, base = lm_ckpt
    out = tmp_path / "compressed"
    variants = "variants=[fp32,int8_weight_only,int8_dynamic,intx4_weight_only,nf4]"
    report = quantize(
        compose_config("quantize", base + FAST + [f"ckpt_path={ckpt}", f"output_dir={out}", variants, f"paths.output_dir={tmp_path / 'q'}"])
    )
    assert report["split"] == "validation"  # the toy text has no test split: said in the report
    assert report["metric_names"] == ["perplexity"]
    rows = {v["name"]: v for v in report["variants"]}
    assert set(rows) == {"fp32", "int8_weight_only", "int8_dynamic", "intx4_weight_only", "nf4"}
    input_ids = torch.tensor([[5, 17, 33, 8, 90, 4]])
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(out / "fp32")(input_ids=input_ids).logits
        for name, v in rows.items():
            assert v["metrics"]["perplexity"] > 1.0
            assert v["delta"]["perplexity"] == pytest.approx(v["metrics"]["perplexity"] - rows["fp32"]["metrics"]["perplexity"])
            logits = eval(v["load"], {"AutoModelForCausalLM": AutoModelForCausalLM})(input_ids=input_ids).logits
            error = (logits - reference).abs().max() / reference.abs().max()
            assert error < (0.25 if "4" in name else 0.05), (name, float(error))
    # the tiny Llama ties its head to the embedding: untied, both int8, no fp32 copy of the table left
    config = json.loads((out / "int8_weight_only" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and rows["int8_weight_only"]["size_ratio"] < 1.0


def test_onnx_for_a_causal_lm_is_refused_before_anything_is_written(lm_ckpt, tmp_path):
    ckpt, base = lm_ckpt
    out = tmp_path / "compressed"
    with pytest.raises(
        ConfigError, match=r"variants: 'onnx_int8' does not apply to task=causal_lm \(it offers \['fp32', .*'nf4'\]\); fix: drop it"
    ):
        quantize(
            compose_config(
                "quantize",
                base + [f"ckpt_path={ckpt}", f"output_dir={out}", "variants=[fp32,onnx_int8]", f"paths.output_dir={tmp_path / 'q'}"],
            )
        )
    assert not out.exists()
{%- endif %}
