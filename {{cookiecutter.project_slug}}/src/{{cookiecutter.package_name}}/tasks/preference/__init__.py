"""Preference tuning of a causal LM on chosen/rejected pairs (DPO, and the reference-free ORPO and SimPO) or on unpaired
answers (KTO).  Module :class:`.module.PreferenceModule`, data :class:`.data.PreferenceDataModule` and
:class:`.data.UnpairedDataModule` (configs/task/preference.yaml, configs/objective/)."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.errors import DataError
from ...core.models.adapters import rewrites_base
from ..causal_lm import CausalLM
from .objectives import NEEDS_REFERENCE, OBJECTIVES, UNPAIRED, Objective


class Preference(CausalLM):
    """A causal LM tuned on pairs; built, exported, generated from and quantized as a causal LM."""

    loss_implementations = ("plain",)
    config_groups = {"objective": Objective}
    # An exported folder lacks DPO's reference (adapters off, or the checkpoint's tables): eval and quantize read the checkpoint.
    reads_exported_folders = False
    export_formats = ("hf", "gguf")  # (the policy, adapters merged, as a causal LM's)
    identity_keys = {
        "model": ("data.chat_template", "data.end_of_turn", "data.system_prompt", "objective.*"),
        "data": ("data.val_fraction", "data.val_split_seed"),
    }

    def data_problems(self, data: DictConfig) -> list[str]:
        return []  # the pair columns are fixed; the rows are checked when read

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        """The ``objective`` group's values (field, value, fix), and the causal LM's callbacks."""
        objective = cfg.get("objective") or {}
        problems = super().config_problems(cfg, runs_here)
        name = objective.get("name")
        if name not in OBJECTIVES:
            return [*problems, f"objective.name={name!r} is not one of {OBJECTIVES}; fix: objective=dpo (or orpo, simpo, kto)"]
        beta = objective.get("beta")
        if isinstance(beta, bool) or not isinstance(beta, int | float) or beta <= 0:
            problems.append(
                f"objective.beta={beta!r} must be a number > 0; fix: objective.beta=0.1 (DPO; see configs/objective/{name}.yaml)"
            )
        smoothing = objective.get("label_smoothing", 0.0)
        if name == "dpo" and (not isinstance(smoothing, int | float) or not 0 <= smoothing < 0.5):
            problems.append(f"objective.label_smoothing={smoothing!r} must be in [0, 0.5); fix: objective.label_smoothing=0.0")
        gamma = objective.get("gamma")
        if name == "simpo" and (isinstance(gamma, bool) or not isinstance(gamma, int | float) or gamma < 0):
            problems.append(f"objective.gamma={gamma!r} must be a number >= 0 (the target reward margin); fix: objective.gamma=1.0")
        for field in ("desirable_weight", "undesirable_weight"):
            weight = objective.get(field, 1.0)
            if name == "kto" and (isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0):
                problems.append(f"objective.{field}={weight!r} must be a number > 0; fix: objective.{field}=1.0")
        unpaired = str((cfg.get("data") or {}).get("_target_", "")).endswith(".UnpairedDataModule")
        if unpaired != (name in UNPAIRED):
            problems.append(
                f"objective={name} trains on {'unpaired answers' if name in UNPAIRED else 'pairs'}, and data._target_ is the "
                f"{'unpaired' if unpaired else 'pair'} data module; fix: "
                + ("data=unpaired (it reads pairs too, unpaired on load)" if name in UNPAIRED else "objective=kto, or data=preference")
            )
        if name in NEEDS_REFERENCE and rewrites_base(cfg.get("peft")):
            problems.append(
                f"objective={name} with peft.init_lora_weights={cfg.peft.init_lora_weights}: the reference is the model with its "
                "adapters off, and PiSSA/OLoRA leave a residual base there, not the model you started from; fix: "
                "peft.init_lora_weights=true, or a reference-free objective (objective=orpo, simpo)"
            )
        prompts = (cfg.get("data") or {}).get("sample_prompts")
        fetched = cfg.data.get("fetch") is not None and not Path(prompts or "").exists()  # (read once fetched)
        if runs_here and prompts and cfg.data.get("judge") is not None and not fetched:  # read now, not after the fit
            from ...core.data.loading import read_prompt_file

            try:
                read_prompt_file("data.sample_prompts", prompts)
            except DataError as error:
                problems.append(str(error))
        if (cfg.get("callbacks") or {}).get("neftune") is not None:
            problems.append(
                "callbacks=neftune with task=preference: the noise would reach the adapters-off reference pass too, and "
                "NEFTune is an instruction-tuning (SFT) method; fix: callbacks=default (or callbacks=early_stopping)"
            )
        return problems

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """``micro_batch`` pairs (KTO: answers, and their mismatched answers): ``2 * micro_batch`` sequences of ``data.max_length``
        tokens, scored on their second half; DPO and KTO without adapters read reference log-probs from the batch (no reference
        pass), with adapters the adapters-off pass runs."""
        length = cfg.data.max_length
        input_ids = torch.randint(0, vocab_size, (2 * micro_batch, length))  # (2P, T)
        labels = input_ids.clone()
        labels[:, : length // 2] = -100  # the prompt half is not scored
        batch = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": labels,
            "token_mask": torch.ones_like(input_ids),
        }
        batch["pair"] = torch.arange(micro_batch)
        if cfg.objective.name in UNPAIRED:  # KTO: micro_batch answers, then their mismatched answers
            batch["desirable"] = torch.arange(micro_batch) % 2 == 0
        batch["scored_from"] = length // 2 - 1  # the shifted targets: positions T/2-1 .. T-2 (static shapes for the trace)
        if cfg.objective.name in NEEDS_REFERENCE and cfg.peft.method not in ("lora", "qlora"):
            batch["reference_logps"] = torch.zeros(2 * micro_batch)
        return batch

    def after_test(self, module, datamodule, trainer, predictions: Path, split: str, key: str) -> dict:
        """With ``data.judge`` and ``data.sample_prompts``: :func:`.samples.judged_samples` as ``{split}/<judge metric>``
        (``..._start`` for the untuned model's ``key``), the samples written to ``predictions``."""
        if getattr(datamodule, "judge", None) is None or not datamodule.sample_prompts:
            return {}
        from .samples import judged_samples

        return judged_samples(module, datamodule, trainer, predictions, split, "_start" if key.endswith("_start") else "")


TASK = Preference()
