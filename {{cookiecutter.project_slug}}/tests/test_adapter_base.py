"""The frozen base of an adapter checkpoint (causal LM): found by the run's resolved path from any
folder, refused when its files differ (eval and export), given on the command line; and a resume
with another ``peft.alpha`` refused.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.core.identity import hashes as file_hashes
from {{ cookiecutter.package_name }}.eval import evaluate
from {{ cookiecutter.package_name }}.train import train

from .conftest import compose_config, lm_overrides
from .test_run_identity import own_hash_cache  # noqa: F401 (an autouse fixture)


# ------------------------------------------------------------------ eval / export: the adapter's base
@pytest.fixture(scope="module")
def lora(lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path_factory):
    """A LoRA run whose base was given as a relative path (``base``, from ``folder``)."""
    folder = tmp_path_factory.mktemp("lora_identity")
    shutil.copytree(pretrained_lm_dir, folder / "base")
    run_dir = folder / "run"
    overrides = lm_overrides(lm_tokenizer_dir, lm_text, run_dir) + [
        "model.name_or_path=base",
        "model.config=null",
        "peft=lora",
        "peft.r=4",
        "trainer.max_steps=3",
        "optimizer.lr=1e-2",
        "callbacks.sample_generation=null",
        "callbacks.progress_bar=null",
    ]
    cwd = Path.cwd()
    os.environ[file_hashes.CACHE_ENV] = str(folder / "file_hashes.json")
    os.chdir(folder)
    try:
        metrics = train(compose_config("train", overrides))
    finally:
        os.chdir(cwd)
        del os.environ[file_hashes.CACHE_ENV]
    return SimpleNamespace(
        folder=folder, base=folder / "base", ckpt=run_dir / "checkpoints" / "last.ckpt", metrics=metrics, overrides=overrides
    )


def other_base(pretrained_lm_dir: Path, folder: Path, seed: int) -> Path:
    """A model folder like the base, with other random weights."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(pretrained_lm_dir, folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(folder)
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.05)
    model.save_pretrained(folder)
    return folder


def eval_lora(lora, lm_tokenizer_dir, lm_text, out: Path) -> dict:
    overrides = lm_overrides(lm_tokenizer_dir, lm_text, out) + [f"ckpt_path={lora.ckpt}", f"data.splits.test={lm_text['validation']}"]
    return evaluate(compose_config("eval", overrides))


def test_an_adapter_checkpoint_reads_its_base_from_the_resolved_path_from_any_folder(
    lora, lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path, monkeypatch
):
    """From another folder holding a ``base`` of its own, eval reads the run's base, and gets the
    run's figure (the stored relative path would have read the other one)."""
    elsewhere = tmp_path / "elsewhere"
    other_base(pretrained_lm_dir, elsewhere / "base", seed=1)
    monkeypatch.chdir(elsewhere)
    result = eval_lora(lora, lm_tokenizer_dir, lm_text, tmp_path / "eval")
    assert result["test/loss"] == pytest.approx(lora.metrics["val/loss"], rel=1e-4)


def test_an_adapter_checkpoint_on_a_replaced_base_is_refused_naming_both(
    lora, lm_tokenizer_dir, lm_text, pretrained_lm_dir, tmp_path, monkeypatch
):
    saved = Path(shutil.copytree(lora.base, tmp_path / "saved_base"))
    shutil.rmtree(lora.base)
    other_base(pretrained_lm_dir, lora.base, seed=2)
    import {{ cookiecutter.package_name }}.core.checkpoints.io as checkpoints

    try:
        with pytest.raises(ConfigError) as error:
            eval_lora(lora, lm_tokenizer_dir, lm_text, tmp_path / "eval")
        message = str(error.value)
        assert str(lora.base.resolve()) in message and "model.safetensors" in message and message.count("sha256 ") == 2, message
        from {{ cookiecutter.package_name }}.export import export

        export_cfg = compose_config(
            "export",
            lm_overrides(lm_tokenizer_dir, lm_text, tmp_path / "x") + [f"ckpt_path={lora.ckpt}", f"output_dir={tmp_path / 'exported'}"],
        )
        with pytest.raises(ConfigError, match="holds adapters trained on the base"):
            export(export_cfg)
        assert not (tmp_path / "exported").exists()
        # The base the run was trained on, given on the command line, wins over the stored path.
        monkeypatch.setattr(checkpoints, "command_line_value", lambda key: str(saved) if key == "model.name_or_path" else None)
        result = eval_lora(lora, lm_tokenizer_dir, lm_text, tmp_path / "eval2")
        assert result["test/loss"] == pytest.approx(lora.metrics["val/loss"], rel=1e-4)
    finally:
        shutil.rmtree(lora.base)
        shutil.copytree(saved, lora.base)


def test_a_resume_with_another_peft_alpha_is_refused(lora, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(lora.ckpt.parent.parent, target)
    kept = [o for o in lora.overrides if not o.startswith(("paths.output_dir=", "model.name_or_path="))]
    cfg = compose_config(
        "train", [*kept, f"model.name_or_path={lora.base}", f"paths.output_dir={target}", "ckpt_path=last", "peft.alpha=64"]
    )
    with pytest.raises(ConfigError, match=r"peft.alpha: 32 -> 64"):
        train(cfg)
