"""Causal LMs end to end on tiny random models (seconds on a CPU): scratch, full, LoRA, QLoRA,
the loss normalisation under accumulation, export, generation, and errors before training."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.models.inputs import ConnectData
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.export import export
from {{ cookiecutter.package_name }}.generate import generate, read_prompts
from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule, token_loss_sum
from {{ cookiecutter.package_name }}.tasks.causal_lm.text import TextDataModule
from {{ cookiecutter.package_name }}.train import train


def test_scratch_fast_dev_run_writes_start_and_final_validation(make_lm_cfg, tmp_path):
    metrics = train(make_lm_cfg("debug=fdr"))
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in ("val/loss", "val/ppl", "val/loss_start", "val/ppl_start", "train/loss"):
        assert math.isfinite(written[key]), key
    assert written["val/ppl"] == pytest.approx(math.exp(written["val/loss"]), rel=1e-5)
    assert written["tokens"]["validation"] > 0 and written["tokens"]["train"] > written["tokens"]["validation"]
    assert written["rows"] == {"train": 24, "validation": 1}  # documents: one per file
    assert metrics["val/loss"] == pytest.approx(written["val/loss"])


def test_a_fit_ending_between_validations_keeps_train_metrics_and_a_resume_keeps_the_start(make_lm_cfg, tmp_path):
    """The final weights are validated again when the fit ended between validations; that pass
    must not wipe the fit's train/* figures, and a resumed run reports the first launch's
    *_start figures (kept in the checkpoint) and validates its own final weights."""
    first = train(make_lm_cfg("trainer.max_steps=4", "trainer.val_check_interval=3", "callbacks.sample_generation=null"))
    for key in ("train/loss", "val/loss", "val/loss_start", "val/ppl_start"):
        assert math.isfinite(first[key]), (key, first)
    assert first["val/loss"] != first["val/loss_start"]
    resumed = train(
        make_lm_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.sample_generation=null", "ckpt_path=last")
    )
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in ("val/loss_start", "val/ppl_start"):  # the first launch's, from the checkpoint
        assert written[key] == pytest.approx(first[key]), key
    assert math.isfinite(written["train/loss"]) and written["val/loss"] == pytest.approx(resumed["val/loss"])
    assert written["val/loss"] != first["val/loss"]  # the resumed run's own final validation, not the first launch's


def test_gpt2_from_scratch_pads_with_eos_and_trains(make_lm_cfg, lm_tokenizer_dir):
    cfg = make_lm_cfg("debug=fdr", model="tiny_gpt2")
    metrics = train(cfg)
    assert math.isfinite(metrics["val/loss"])


def test_overfits_one_batch(make_lm_cfg):
    metrics = train(make_lm_cfg("debug=overfit", "trainer.max_epochs=40", "optimizer.lr=3e-3", "callbacks.sample_generation=null"))
    assert metrics["train/loss"] < 0.5 * metrics["val/loss_start"], metrics


def test_full_fine_tune_from_pretrained_folder(make_lm_cfg, pretrained_lm_dir):
    cfg = make_lm_cfg(f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "debug=fdr")
    assert math.isfinite(train(cfg)["val/loss"])


@pytest.fixture(scope="module")
def lora_run(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path_factory):
    """A short LoRA run on the "pretrained" tiny Llama; returns (run_dir, metrics)."""
    from .conftest import compose_config, lm_overrides

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    overrides = lm_overrides(lm_tokenizer_dir, lm_text, run_dir) + [
        f"model.name_or_path={pretrained_lm_dir}",
        "model.config=null",
        "peft=lora",
        "peft.r=4",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "optimizer.lr=1e-2",
        "callbacks.sample_generation.every_n_steps=3",
    ]
    return run_dir, train(compose_config("train", overrides))


def test_lora_checkpoint_holds_only_the_adapter_and_loads_weights_only(lora_run):
    run_dir, metrics = lora_run
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    keys = list(checkpoint["state_dict"])
    assert keys and all("lora_" in key for key in keys), keys[:5]
    assert checkpoint["hyper_parameters"]["peft"]["method"] == "lora"
    assert checkpoint["model_inputs"]["tokenizer_files"] and checkpoint["tokens_seen"] > 0


def test_lora_trains_only_adapters_and_improves(lora_run):
    _, metrics = lora_run
    assert metrics["val/loss"] < metrics["val/loss_start"], metrics


def test_sample_generation_writes_samples_each_period(lora_run):
    run_dir, _ = lora_run
    text = (run_dir / "samples.txt").read_text()
    assert "=== step 3 |" in text and "=== step 6 |" in text
    assert text.count("prompt:") == 4  # two prompts, at steps 3 and 6 (the end is step 6: not twice)


def test_lora_export_reloads_with_the_same_logits(lora_run, tmp_path):
    run_dir, _ = lora_run
    from .conftest import compose_config

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "exported"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))
    module = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu").eval()
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name, _ in plain.named_parameters())
    ids = module.tokenizer("the king speaks to a fool.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="output_dir=.* exists; fix: output_dir=<a new path>, or overwrite=true"):
        export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))


def test_export_format_gguf_writes_one_file_named_by_its_type_with_its_perplexity_in_the_report(
    lora_run, lm_tokenizer_dir, lm_text, tmp_path
):
    run_dir, _ = lora_run
    from .conftest import compose_config, lm_overrides

    ckpt, out = run_dir / "checkpoints" / "last.ckpt", tmp_path / "gguf"
    data = [*lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "export"), f"data.splits.test={lm_text['validation']}"]
    common = [*data, f"ckpt_path={ckpt}", f"output_dir={out}", "format=gguf"]
    with pytest.raises(ConfigError, match="not dtype"):
        export(compose_config("export", [*common, "dtype=float16"]))
    with pytest.raises(ConfigError, match="outtype='q3_k'"):
        export(compose_config("export", [*common, "outtype=q3_k"]))
    assert not out.exists()
    path = export(compose_config("export", [*common, "outtype=q8_0"]))
    assert path == out / "model.Q8_0.gguf" and sorted(p.name for p in out.iterdir()) == [
        "export_report.json",
        "export_report.md",
        path.name,
    ]
    rows = {row["name"]: row for row in json.loads((out / "export_report.json").read_text())["variants"]}
    checkpoint_ppl, gguf_ppl = rows["checkpoint"]["metrics"]["perplexity"], rows["gguf-q8_0"]["metrics"]["perplexity"]
    assert abs(gguf_ppl - checkpoint_ppl) <= 0.01 * checkpoint_ppl, (gguf_ppl, checkpoint_ppl)
    assert rows["gguf-q8_0"]["size_bytes"] == path.stat().st_size


def test_generate_from_checkpoint_and_exported_folder(lora_run, tmp_path):
    run_dir, _ = lora_run
    from .conftest import compose_config

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    common = [f"paths.output_dir={tmp_path}", "generation.max_new_tokens=5", "prompts=[the king,a fool]"]
    rows = generate(compose_config("generate", [f"ckpt_path={ckpt}", *common]))
    assert [row["prompt"] for row in rows] == ["the king", "a fool"]
    lines = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line)["completion"] for line in lines] == [row["completion"] for row in rows]
    out = tmp_path / "exported"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))
    again = generate(compose_config("generate", [f"model_dir={out}", *common, f"paths.output_dir={tmp_path / 'again'}"]))
    assert again == rows  # greedy decoding of the same weights
    with pytest.raises(ConfigError, match="exactly one"):
        generate(compose_config("generate", [*common]))


def gpt2_generator(tokenizer_dir, positions: int) -> CausalLMModule:
    from transformers import AutoTokenizer, GPT2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=positions)
    options = {"model": {"fetch": None}, "optimizer": {"step_in_backward": False}, "peft": {"method": "none"}}
    module = CausalLMModule(**options, hf_config=config.to_dict())
    module.model, module.tokenizer = AutoModelForCausalLM.from_config(config), tokenizer
    return module


@pytest.mark.parametrize("prompt_words, new_tokens", [(60, 5), (2, 100), (60, 100)])
def test_generation_never_passes_the_models_positions(lm_tokenizer_dir, prompt_words, new_tokens):
    module = gpt2_generator(lm_tokenizer_dir, positions=24)
    generate_ids, lengths = module.model.generate, []

    def measured(**inputs):
        output = generate_ids(**inputs)  # (1, prompt + new tokens)
        lengths.append((inputs["input_ids"].shape[1], output.shape[1], inputs["max_new_tokens"]))
        return output

    module.model.generate = measured
    with pytest.warns(UserWarning, match="positions"):
        [completion] = module.generate_text([" ".join(["king"] * prompt_words)], max_new_tokens=new_tokens, do_sample=False)
    [(prompt, total, capped)] = lengths
    assert total <= 24 and capped == min(new_tokens, 23) and prompt >= 1 and isinstance(completion, str)


def test_batched_generation_sorts_by_length_and_gives_each_prompt_its_own_greedy_completion(lm_tokenizer_dir):
    module = gpt2_generator(lm_tokenizer_dir, positions=64)
    torch.manual_seed(0)
    prompts = [" ".join(["king", "queen", "the"][i % 3] for i in range(words)) for words in (3, 11, 1, 7, 7, 2, 9)]
    ids = module.prompt_ids(prompts)
    calls, generate_ids = [], module.model.generate

    def recorded(**inputs):
        calls.append(inputs["attention_mask"].sum(dim=1).tolist())  # the real lengths in this batch
        return generate_ids(**inputs)

    module.model.generate = recorded
    one_by_one = module.complete(ids, batch_size=1, max_new_tokens=6, do_sample=False)
    calls.clear()
    batched = module.complete(ids, batch_size=3, max_new_tokens=6, do_sample=False)
    assert batched == one_by_one  # in the prompts' order, the same greedy tokens (fp32, padding masked)
    lengths = [len(row) for row in ids]
    assert [len(batch) for batch in calls] == [3, 3, 1]
    assert [n for batch in calls for n in batch] == sorted(lengths, reverse=True)  # longest first
    with pytest.raises(ValueError, match="batch_size=0"):
        module.complete(ids, batch_size=0)


def test_a_failing_sample_generation_is_a_warning_not_the_end_of_the_run(tmp_path):
    from types import SimpleNamespace

    from {{ cookiecutter.package_name }}.tasks.causal_lm.sample_generation import SampleGeneration

    def broken(prompts, **generation):
        raise IndexError("index out of range in self")

    callback = SampleGeneration(prompts=["the king"], output_file=str(tmp_path / "samples.txt"))
    module = SimpleNamespace(device=torch.device("cpu"), generate_text=broken)
    with pytest.warns(UserWarning, match="sample_generation failed at step 7 and is skipped: IndexError"):
        assert callback.generate(SimpleNamespace(global_step=7, loggers=[]), module) == []
    assert not (tmp_path / "samples.txt").exists()


def test_prompts_from_the_command_line_and_a_file_take_escaped_newlines(tmp_path):
    from omegaconf import OmegaConf

    path = tmp_path / "prompts.txt"
    path.write_text("ROMEO.\\nO\n\n  \nEnter\n")
    cfg = OmegaConf.create({"prompts": ["a\\nb"], "prompts_file": str(path)})
    assert read_prompts(cfg) == ["a\nb", "ROMEO.\nO", "Enter"]
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts(OmegaConf.create({"prompts": [], "prompts_file": None}))


def test_eval_on_lm_checkpoint_reports_perplexity(lora_run, lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path):
    run_dir, metrics = lora_run
    from .conftest import compose_config, lm_overrides

    overrides = lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "eval") + [
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        f"data.splits.test={lm_text['validation']}",
    ]
    result = evaluate(compose_config("eval", overrides))
    assert result["test/ppl"] == pytest.approx(math.exp(result["test/loss"]), rel=1e-5)
    # The test split is the validation file: the same loss as the run's last validation.
    assert result["test/loss"] == pytest.approx(metrics["val/loss"], rel=1e-4)


def test_qlora_trains_on_cpu_with_a_4bit_base_and_exports_a_plain_model(make_lm_cfg, pretrained_lm_dir, tmp_path):
    import bitsandbytes as bnb  # a dependency of the project: no skip

    from .conftest import compose_config

    cfg = make_lm_cfg(
        f"model.name_or_path={pretrained_lm_dir}",
        "model.config=null",
        "peft=qlora",
        "peft.r=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "callbacks.sample_generation=null",
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["val/loss"])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    module = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in module.model.modules())  # the base is 4-bit
    out = tmp_path / "exported"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert all(type(m).__module__.startswith(("torch", "transformers")) for m in plain.modules())
    checkpoint_row = json.loads((out / "export_report.json").read_text())["variants"][0]  # the report's baseline, labelled
    assert checkpoint_row["name"] == "checkpoint" and "not the 4-bit model that was trained" in checkpoint_row["storage"]
    assert getattr(plain.config, "quantization_config", None) is None


def _one_step_update(pretrained_dir, tokenizer_dir, text_dir, micro_batch: int, accumulate: int) -> dict[str, torch.Tensor]:
    """Parameter change of one SGD step (lr 1) over the whole 2-document training set."""
    L.seed_everything(0)
    datamodule = TextDataModule(
        splits={"train": str(text_dir), "validation": str(text_dir)},
        hub_name=None,
        hub_config=None,
        text_column="text",
        sample_by="document",
        tokenizer=str(tokenizer_dir),
        mode="pad",
        max_length=64,
        batch_size=micro_batch,
        val_fraction=0.1,
        val_split_seed=0,
        num_workers=0,
        pad_to_multiple_of=None,
        group_by_length=False,
        cache_dir=None,
        fetch=None,
    )
    module = CausalLMModule(
        model={"name_or_path": str(pretrained_dir), "config": None, "fetch": None},
        optimizer={"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "step_in_backward": False},
        peft={"method": "none"},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision="32-true",
        callbacks=[ConnectData()],  # hands the module its data's facts, as train's trainer does
    )
    before = None

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    trainer.callbacks.append(Snapshot())
    trainer.fit(module, datamodule=datamodule)
    return {n: p.detach() - before[n] for n, p in module.named_parameters()}


def test_accumulated_micro_batches_give_the_gradient_of_one_batch(pretrained_lm_dir, lm_tokenizer_dir, tmp_path):
    # Two documents of very different lengths (5 vs ~40 tokens): a mean of per-micro-batch means
    # would weight the short document's tokens 8x more.
    text_dir = tmp_path / "two_docs"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text("the king.")
    (text_dir / "b.txt").write_text("the queen speaks to a fool and the ghost. " * 4)
    one_batch = _one_step_update(pretrained_lm_dir, lm_tokenizer_dir, text_dir, micro_batch=2, accumulate=1)
    accumulated = _one_step_update(pretrained_lm_dir, lm_tokenizer_dir, text_dir, micro_batch=1, accumulate=2)
    for name, delta in one_batch.items():
        difference = (accumulated[name] - delta).norm() / delta.norm().clamp_min(1e-12)
        assert difference < 1e-5, (name, float(difference))


def test_token_loss_sum_counts_only_shifted_unmasked_targets():
    logits = torch.zeros(2, 4, 5)  # uniform: every target costs ln(5)
    labels = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100]])
    loss_sum, n_targets = token_loss_sum(logits, labels)
    assert int(n_targets) == 2  # row 0 predicts 2 and 3; row 1 has no target after its first token
    assert float(loss_sum) == pytest.approx(2 * math.log(5))


# ----------------------------------------------------------------------------- bad input
def test_block_size_above_the_models_positions_fails_before_training(make_lm_cfg):
    with pytest.raises(ConfigError, match=r"data.max_length=256 .* maximum positions \(128"):
        train(make_lm_cfg("data.max_length=256", "debug=fdr"))


def test_architecture_checks_run_before_the_data_is_tokenised(make_lm_cfg, monkeypatch):
    def no_tokenising(*args, **kwargs):
        raise AssertionError("the data was tokenised before the config was checked")

    monkeypatch.setattr(TextDataModule, "_prepare", no_tokenising)
    with pytest.raises(ConfigError, match="data.max_length=256"):
        train(make_lm_cfg("data.max_length=256", "debug=fdr"))


def test_validation_interval_beyond_one_epoch_fails_before_weights_load(make_lm_cfg, monkeypatch):
    from {{ cookiecutter.package_name }}.tasks.causal_lm import module as causal_lm

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were built before the interval was checked")

    monkeypatch.setattr(causal_lm.CausalLMModule, "build_model", no_weights)
    with pytest.raises(
        ConfigError, match=r"trainer.val_check_interval=500 is more than the \d+ training batches .*fix: trainer.val_check_interval=\d+"
    ):
        train(make_lm_cfg("trainer.max_steps=600", "trainer.val_check_interval=500"))


def test_unknown_lora_target_fails_with_the_layer_names(make_lm_cfg, pretrained_lm_dir):
    cfg = make_lm_cfg(
        f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "peft=lora", "peft.target_modules=[q_proj,qkv]", "debug=fdr"
    )
    with pytest.raises(ConfigError, match=r"\['qkv'\] match no linear layer.*q_proj"):
        train(cfg)


def test_lora_without_pretrained_weights_is_refused(make_lm_cfg):
    with pytest.raises(ConfigError, match="model.name_or_path is null"):
        train(make_lm_cfg("peft=lora", "debug=fdr"))


def test_bad_peft_values_are_listed_together(make_lm_cfg):
    with pytest.raises(ConfigError) as error:
        train(make_lm_cfg("peft=lora", "peft.r=0", "peft.dropout=1.5", "data.mode=stream"))
    message = str(error.value)
    assert "peft.r=0" in message and "peft.dropout=1.5" in message and "data.mode='stream'" in message


def test_a_misspelt_generation_option_is_refused_before_loading(tmp_path):
    from {{ cookiecutter.package_name }}.tasks import check_config

    from .conftest import compose_config

    cfg = compose_config("generate", [f"paths.output_dir={tmp_path}", "ckpt_path=null", "+generation.max_new_token=8"])
    with pytest.raises(ConfigError, match=r"generation.max_new_token is not a key of generation: did you mean generation.max_new_tokens\?"):
        check_config(cfg)
