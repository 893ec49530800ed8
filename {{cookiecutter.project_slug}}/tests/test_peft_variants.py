"""LoRA variants through peft's own options (``peft`` group): DoRA, rsLoRA, LoRA+, each alone and
DoRA on a 4-bit (QLoRA) base.  Each trains two steps, its checkpoint reloads to the same weights,
and the exported merged model scores as the reloaded checkpoint does."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.checks import validate_config
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.export import export
from {{ cookiecutter.package_name }}.models.adapters import wrap_with_lora
from {{ cookiecutter.package_name }}.tasks.causal_lm.module import CausalLMModule
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config

VARIANTS = {
    "dora": ["peft=lora", "peft.use_dora=true"],
    "rslora": ["peft=lora", "peft.use_rslora=true"],
    "loraplus": ["peft=lora", "peft.loraplus_lr_ratio=16"],
    "qlora_dora": ["peft=qlora", "peft.use_dora=true"],
    "qlora": ["peft=qlora"],
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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("peft.use_dora=yes", r"peft.use_dora='yes' must be true or false"),
        ("peft.use_rslora=1", r"peft.use_rslora=1 must be true or false"),
        ("peft.loraplus_lr_ratio=0.5", r"peft.loraplus_lr_ratio=0.5 must be null or a number >= 1 .*fix: e.g. peft.loraplus_lr_ratio=16"),
        ("peft.target_modules=q_proj", r"peft.target_modules='q_proj' must be all-linear .*fix: peft.target_modules=all-linear"),
        ("peft.target_modules=[]", r"peft.target_modules=\[\] must be all-linear"),
    ],
)
def test_a_peft_option_of_the_wrong_kind_is_refused_with_the_field_and_the_fix(override, message, make_lm_cfg, pretrained_lm_dir):
    cfg = make_lm_cfg(f"model.name_or_path={pretrained_lm_dir}", "model.config=null", "peft=lora", override)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_export_writes_the_runs_compute_dtype_by_default_and_refuses_other_dtypes(make_lm_cfg, pretrained_lm_dir, tmp_path):
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
    for dtype, expected in (("null", torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"exported_{dtype}"
        export(compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={out}", f"paths.output_dir={tmp_path}", f"dtype={dtype}"]))
        with safe_open(out / "model.safetensors", "pt") as weights:
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {expected}, dtype
        with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as weights:  # the trained adapter, as trained
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}
    with pytest.raises(ConfigError, match=r"dtype='int8' is not one of \('float32', 'bfloat16', 'float16'\).*quantize"):
        export(
            compose_config("export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'int8'}", f"paths.output_dir={tmp_path}", "dtype=int8"])
        )
    assert not (tmp_path / "int8").exists()
