"""LoRA variants through peft's own options (``peft`` group): DoRA, rsLoRA, LoRA+, each alone and
DoRA on a 4-bit (QLoRA) base.  Each trains two steps, its checkpoint reloads to the same weights,
and the exported merged model scores as the reloaded checkpoint does."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.models.adapters import wrap_with_lora
from {{ cookiecutter.package_name }}.export import export
from {{ cookiecutter.package_name }}.tasks import check_config
from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config

VARIANTS = {
    "dora": ["peft=lora", "peft.use_dora=true"],
    "rslora": ["peft=lora", "peft.use_rslora=true"],
    "loraplus": ["peft=lora", "peft.loraplus_lr_ratio=16"],
    "qlora_dora": ["peft=qlora", "peft.use_dora=true"],
    "qlora": ["peft=qlora"],
    "pissa": ["peft=lora", "peft.init_lora_weights=pissa"],
    "olora": ["peft=lora", "peft.init_lora_weights=olora"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_trains_two_steps_and_round_trips_through_the_checkpoint_and_export(variant, make_lm_cfg, pretrained_lm_dir, tmp_path):
    cfg = make_lm_cfg(
        f"model.name_or_path={pretrained_lm_dir}",
        "model.config=null",
        "peft.r=4",
        "peft.alpha=8",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "optimizer.lr=1e-2",
        "callbacks.sample_generation=null",
        *VARIANTS[variant],
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] != metrics["val/loss_start"], metrics
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)
    module = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu").eval()
    loaded = module.state_dict()
    for key, value in stored["state_dict"].items():  # the reload holds what was trained
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    layer = module.model.base_model.model.model.layers[0].self_attn.q_proj
    if "dora" in variant:
        assert any("lora_magnitude_vector" in key for key in stored["state_dict"])
    if variant in ("pissa", "olora"):  # the initial adapter rebuilds the residual base: not the base's own weight
        assert set(stored["initial_adapter"]) == {key.removeprefix("model.") for key in stored["state_dict"] if ".lora_" in key}
        original = AutoModelForCausalLM.from_pretrained(pretrained_lm_dir, dtype=torch.float32).model.layers[0].self_attn.q_proj.weight
        assert not torch.allclose(layer.base_layer.weight, original)
    scale = 8 / math.sqrt(4) if variant == "rslora" else 8 / 4
    assert layer.scaling["default"] == pytest.approx(scale)
    groups = stored["optimizer_states"][0]["param_groups"]
    if variant == "loraplus":  # A and the 1-D parameters at lr; the B matrices at 16 x lr
        assert [group["peak_lr"] for group in groups] == pytest.approx([1e-2, 1e-2, 0.16])
        b_group = [name for name, p in module.model.named_parameters() if p.requires_grad and ".lora_B." in name]
        assert len(groups[2]["params"]) == len(b_group) > 0
    else:
        assert len(groups) == 2

    out = tmp_path / "exported"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"]))
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in plain.named_parameters())
    ids = module.tokenizer("the king speaks to a fool.", return_tensors="pt")["input_ids"]
    reference = module.model
    if variant.startswith("qlora"):  # export merges into the unquantized base: the adapter on that base
        reference = wrap_with_lora(
            AutoModelForCausalLM.from_pretrained(pretrained_lm_dir, dtype=torch.float32), module.hparams.peft, "all-linear"
        )
        missing = reference.load_state_dict(
            {key.removeprefix("model."): value for key, value in stored["state_dict"].items()}, strict=False
        )
        assert not missing.unexpected_keys and not [key for key in missing.missing_keys if "lora_" in key]
    base = AutoModelForCausalLM.from_pretrained(pretrained_lm_dir, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, out / "adapter").eval()  # the adapter folder, onto the unquantized base
    with torch.no_grad():
        expected = reference.eval()(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(adapter(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    assert plain.config.dtype == torch.float32  # a 32-true run: float32 by default
    if variant in ("pissa", "olora"):  # converted by peft for the original base: rank 2r
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("peft.use_dora=yes", r"peft.use_dora='yes' must be true or false"),
        ("peft.use_rslora=1", r"peft.use_rslora=1 must be true or false"),
        ("peft.loraplus_lr_ratio=0.5", r"peft.loraplus_lr_ratio=0.5 must be null or a number >= 1 .*fix: e.g. peft.loraplus_lr_ratio=16"),
        ("peft.target_modules=q_proj", r"peft.target_modules='q_proj' must be all-linear .*fix: peft.target_modules=all-linear"),
        ("peft.target_modules=[]", r"peft.target_modules=\[\] must be all-linear"),
        ("peft.init_lora_weights=svd", r"peft.init_lora_weights='svd' must be true, pissa, pissa_niter_<n> .* or olora"),
        ("peft.init_lora_weights=pissa_niter_0", r"peft.init_lora_weights='pissa_niter_0' must be true, pissa"),
    ],
)
def test_a_peft_option_of_the_wrong_kind_is_refused_with_the_field_and_the_fix(override, message, make_lm_cfg, pretrained_lm_dir):
    cfg = make_lm_cfg(f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "peft=lora", override)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def run_data_overrides(make_lm_cfg) -> dict[str, str]:
    """The tiny runs' task and data group, with their validation file as the test split (last)."""
    cfg = make_lm_cfg()
    return {
        "task": "causal_lm",
        "data": "text_files",
        "data.splits.train": cfg.data.splits.train,
        "data.splits.validation": cfg.data.splits.validation,
        "data.max_length": cfg.data.max_length,
        "model.tokenizer": cfg.model.tokenizer,
        "data.splits.test": cfg.data.splits.validation,
    }


def test_export_writes_the_runs_compute_dtype_by_default_and_refuses_other_dtypes(make_lm_cfg, pretrained_lm_dir, tmp_path, monkeypatch):
    train(
        make_lm_cfg(
            f"model.name_or_path={pretrained_lm_dir}",
            "model.config=null",
            "peft=lora",
            "precision=bf16-mixed",
            "trainer.max_steps=1",
            "trainer.val_check_interval=1",
            "callbacks.sample_generation=null",
        )
    )
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    # The run's own config (task and data group), its validation file as the test split: the report measures.
    measured = [f"{key}={value}" for key, value in run_data_overrides(make_lm_cfg).items()]
    for dtype, expected in (("null", torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"exported_{dtype}"
        export(
            compose_config(
                "export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}", f"dtype={dtype}", *measured]
            )
        )
        with safe_open(out / "model.safetensors", "pt") as weights:
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {expected}, dtype
        with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as weights:  # the trained adapter, as trained
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}
        report = json.loads((out / "export_report.json").read_text())
        rows = {v["name"]: v for v in report["variants"]}
        assert list(rows) == ["checkpoint", "adapter", "merged"] and report["split"] == "test" and report["rows"] > 0
        ppl = {name: row["metrics"]["perplexity"] for name, row in rows.items()}
        assert ppl["adapter"] == pytest.approx(ppl["checkpoint"], rel=1e-5)  # the same fp32 weights, reloaded by peft
        assert ppl["merged"] == pytest.approx(ppl["checkpoint"], rel=1e-4 if expected == torch.float32 else 1e-2)
        assert rows["merged"]["metric_ratio"]["perplexity"] == pytest.approx(ppl["merged"] / ppl["checkpoint"])
        assert rows["checkpoint"]["size_bytes"] == ckpt.stat().st_size
        assert rows["adapter"]["size_bytes"] == (out / "adapter" / "adapter_model.safetensors").stat().st_size
        assert rows["merged"]["size_bytes"] == (out / "model.safetensors").stat().st_size
        assert "| `adapter` |" in (out / "export_report.md").read_text()
    # Without the run's data group (the config's default task is another's) or without a test split: said, not failed.
    out = tmp_path / "unmeasured"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}", *measured[:-1]]))
    report = json.loads((out / "export_report.json").read_text())
    assert report["split"] is None and all(v["metrics"] == {} for v in report["variants"])
    assert all(
        v["note"] == "not measured (no test split: data.splits.test is null; set it to measure the folders)" for v in report["variants"]
    )
    assert "- metric: not measured (no test split" in (out / "export_report.md").read_text()
    # The config left at the bake's default task (classification where the bake has it): said, not measured on its data.
    out = tmp_path / "default_task"
    cfg = compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}"])
    export(cfg)
    expected = (
        f"not measured (the config's task is {cfg.task.name}, the checkpoint's causal_lm; pass the run's experiment= "
        "(or task=causal_lm and its data group) with data.splits.test)"
        if cfg.task.name != "causal_lm"
        else "not measured (no test split: data.splits.test is null; set it to measure the folders)"
    )
    assert {v["note"] for v in json.loads((out / "export_report.json").read_text())["variants"]} == {expected}
    # A model that does not fit the GPU to be scored (an 8B in fp32 on 24 GB): said per row; the folder is written.
    from {{ cookiecutter.package_name }}.export import Scorer

    def out_of_memory(self, model):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 GiB")

    monkeypatch.setattr(Scorer, "score", out_of_memory)
    out = tmp_path / "oom"
    export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}", *measured]))
    rows = json.loads((out / "export_report.json").read_text())["variants"]
    assert all(v["metrics"] == {} and v["note"].startswith("not measured (out of memory on the ") for v in rows), rows
    assert (out / "model.safetensors").is_file()
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"dtype='int8' is not one of \('float32', 'bfloat16', 'float16'\).*quantize"):
        export(
            compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'int8'}", f"paths.output_dir={tmp_path}", "dtype=int8"])
        )
    assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize("init", ["pissa"])  # (OLoRA reloads in-process in the round-trip test above)
def test_a_base_rewriting_init_reloads_in_a_fresh_process_with_another_seed_to_the_trained_scores(
    init, lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path
):
    """PiSSA/OLoRA leave a residual base that no file but the checkpoint describes: ``eval`` in a new
    process (another seed, so nothing drawn at random could match by chance) scores what the fit's
    last validation scored on the same rows."""
    from .conftest import lm_overrides

    run = [*lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "run"), f"model.name_or_path={pretrained_lm_dir}", "model.config=null"]
    run += ["peft=lora", "peft.r=4", f"peft.init_lora_weights={init}", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    run += ["optimizer.lr=1e-2", "callbacks.sample_generation=null", "test_after_fit=false"]
    metrics = train(compose_config("train", run))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    evaluation = [*run, f"ckpt_path={ckpt}", f"data.splits.test={lm_text['validation']}", "seed=7", f"paths.output_dir={tmp_path / 'eval'}"]
    done = subprocess.run([sys.executable, "-m", "{{ cookiecutter.package_name }}.eval", *evaluation], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    scored = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert scored["test/ppl"] == pytest.approx(metrics["val/ppl"], rel=1e-5)
    assert scored["test/ppl"] != pytest.approx(metrics["val/ppl_start"], rel=1e-3)  # (the adapters trained: not the start)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_base_rewriting_fit_with_a_test_split_tests_its_best_checkpoint(init, make_lm_cfg, pretrained_lm_dir, lm_text, tmp_path):
    """The fit's own test of its best checkpoint loads it into the model the fit initialised (its base already the residual):
    it exited 1 with no metrics.json.  Best = last here (one validation), so test/ppl is val/ppl on the same rows."""
    common = (f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "peft=lora", "peft.r=4", f"peft.init_lora_weights={init}")
    common += ("trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.sample_generation=null", "optimizer.lr=1e-2")
    metrics = train(make_lm_cfg(*common, f"data.splits.test={lm_text['validation']}"))
    assert metrics["best_checkpoint"] and metrics["test/ppl"] == pytest.approx(metrics["val/ppl"], rel=1e-5)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test/ppl"] == metrics["test/ppl"]


def test_a_pissa_run_resumed_continues_bit_identically(make_lm_cfg, pretrained_lm_dir, tmp_path):
    common = (f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "peft=lora", "peft.r=4", "peft.init_lora_weights=pissa")
    common += ("lr_schedule=constant", "trainer.val_check_interval=2", "callbacks.sample_generation=null", "optimizer.lr=1e-2")
    train(make_lm_cfg(*common, "trainer.max_steps=4"))
    whole = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    resumed = tmp_path / "resumed"
    train(make_lm_cfg(*common, "trainer.max_steps=3", f"paths.output_dir={resumed}"))
    train(make_lm_cfg(*common, "trainer.max_steps=4", f"paths.output_dir={resumed}", "ckpt_path=last"))
    again = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert again["global_step"] == whole["global_step"] == 4
    assert set(again["state_dict"]) == set(whole["state_dict"])
    for name, value in whole["state_dict"].items():
        assert torch.equal(again["state_dict"][name], value), name
    for name, value in whole["initial_adapter"].items():  # the same starting point, kept by the resumed run's checkpoints
        assert torch.equal(again["initial_adapter"][name], value), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("peft=qlora", "peft.init_lora_weights=pissa"), r"peft.init_lora_weights=pissa with peft=qlora: .*fix: peft=lora"),
        (("peft=lora", "peft.init_lora_weights=olora", "peft.use_dora=true"), r"peft.init_lora_weights=olora with peft.use_dora=true"),
        (
            ("task=preference", "data=preference", "objective=dpo", "peft=lora", "peft.init_lora_weights=pissa_niter_4"),
            r"objective=dpo with peft.init_lora_weights=pissa_niter_4: the reference is the model with its adapters off.*objective=orpo",
        ),
    ],
)
def test_a_base_rewriting_init_is_refused_where_a_load_or_the_reference_could_not_be_right(overrides, message, tmp_path):
    cfg = compose_config("train", [f"paths.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, runs_here=False)
