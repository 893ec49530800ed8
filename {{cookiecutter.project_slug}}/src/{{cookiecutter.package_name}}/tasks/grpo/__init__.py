"""GRPO: online RL of a causal LM with reward functions (Shao et al. 2024). Module :class:`.module.GRPOModule`, data
:class:`.data.PromptDataModule` (configs/task/grpo.yaml, configs/grpo/, configs/data/prompts.yaml)."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from ...core.models.adapters import rewrites_base
from ..causal_lm import CausalLM
from .objective import AGGREGATIONS, GRPOSettings


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class GRPO(CausalLM):
    """A causal LM tuned on its own samples; built, exported and generated from as a causal LM. ``eval`` samples and scores
    the test prompts; ``quantize`` has no quality to re-measure (no reference answers), so it is refused."""

    loss_implementations = ("plain",)
    config_groups = {"grpo": GRPOSettings}
    reads_exported_folders = False
    quantize_variants = ("fp32",)
    quality = {}
    identity_keys = {
        "model": ("data.chat_template", "data.end_of_turn", "data.system_prompt", "grpo.*"),
        "data": ("data.val_fraction", "data.val_split_seed", "data.max_completion_length"),
    }

    def data_problems(self, data: DictConfig) -> list[str]:
        return []

    def config_problems(self, cfg: DictConfig, runs_here: bool = True) -> list[str]:
        """The ``grpo`` group's values, ``data.max_completion_length`` and ``data.rewards`` (field, value, fix)."""
        problems = super().config_problems(cfg, runs_here)
        grpo, data = cfg.get("grpo") or {}, cfg.get("data") or {}
        group = grpo.get("num_generations")
        if not isinstance(group, int) or isinstance(group, bool) or group < 2:
            problems.append(
                f"grpo.num_generations={group!r}: GRPO compares a prompt's completions with each other, so it needs at least 2; "
                "fix: grpo.num_generations=8"
            )
        for field, fix in (("temperature", "1.0"), ("epsilon", "0.2")):
            if not _number(grpo.get(field)) or grpo.get(field) <= 0:
                problems.append(f"grpo.{field}={grpo.get(field)!r} must be a number > 0; fix: grpo.{field}={fix}")
        high = grpo.get("epsilon_high")
        if high is not None and (not _number(high) or not _number(grpo.get("epsilon")) or high < grpo.get("epsilon")):
            problems.append(f"grpo.epsilon_high={high!r} must be null or >= grpo.epsilon; fix: grpo.epsilon_high=null (or 0.28, DAPO)")
        beta = grpo.get("beta")
        if not _number(beta) or beta < 0:
            problems.append(f"grpo.beta={beta!r} must be a number >= 0 (0: no KL term); fix: grpo.beta=0.04")
        elif beta > 0 and ((cfg.get("peft") or {}).get("method") not in ("lora", "qlora") or rewrites_base(cfg.get("peft"))):
            why = (
                f"peft={cfg.peft.method}"
                if cfg.peft.method not in ("lora", "qlora")
                else f"peft.init_lora_weights={cfg.peft.init_lora_weights}"
            )
            problems.append(
                f"grpo.beta={beta}: the KL reference is the model with its LoRA adapters off, and {why} has no such model; fix: "
                "peft=lora (standard init), or grpo.beta=0 (no KL term, no reference)"
            )
        if grpo.get("loss_aggregation") not in AGGREGATIONS:
            problems.append(
                f"grpo.loss_aggregation={grpo.get('loss_aggregation')!r} is not one of {AGGREGATIONS}; fix: grpo.loss_aggregation=sequence"
            )
        if not isinstance(grpo.get("scale_rewards"), bool):
            problems.append(f"grpo.scale_rewards={grpo.get('scale_rewards')!r} must be true or false; fix: grpo.scale_rewards=true")
        completion, length = data.get("max_completion_length"), data.get("max_length")
        if (
            not isinstance(completion, int)
            or isinstance(completion, bool)
            or completion < 1
            or (isinstance(length, int) and completion >= length)
        ):
            problems.append(
                f"data.max_completion_length={completion!r} must be a whole number of tokens from 1 to below data.max_length={length} "
                "(the rest is the prompt's room); fix: e.g. data.max_completion_length=256"
            )
        rewards = data.get("rewards")
        if not hasattr(rewards, "items") or not rewards:
            problems.append(
                f"data.rewards={rewards!r} must name at least one reward function as name: {{weight, function}}; fix: see "
                "configs/data/prompts.yaml"
            )
        else:
            for name, spec in rewards.items():
                if not hasattr(spec, "get") or spec.get("function") is None or not _number(spec.get("weight", 1.0)):
                    problems.append(
                        f"data.rewards.{name}={spec!r} must be {{weight: <number>, function: {{_target_: <callable>, _partial_: true}}}}; "
                        "fix: see configs/data/prompts.yaml"
                    )
        return problems

    def example_batch(self, cfg: DictConfig, vocab_size: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """``micro_batch`` prompts sampled into ``micro_batch x G`` sequences of ``data.max_length`` tokens, the last
        ``data.max_completion_length`` of them the completion; advantages 0 (the memory does not depend on them)."""
        rows, completion = micro_batch * cfg.grpo.num_generations, cfg.data.max_completion_length
        sequences = torch.randint(0, vocab_size, (rows, cfg.data.max_length))
        return {
            "sequences": sequences,
            "attention_mask": torch.ones_like(sequences),
            "completion_mask": torch.ones(rows, completion, dtype=torch.long),
            "advantages": torch.zeros(rows),
        }

    def example_loss(self, module, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        completion = batch["completion_mask"].shape[1]
        prompt_length = batch["sequences"].shape[1] - completion
        masks = batch["attention_mask"], batch["completion_mask"]
        terms = module.policy_terms(batch["sequences"], *masks, prompt_length, batch["advantages"], completion)
        return terms.loss_sum / terms.items

    def length_changes(self, cfg: DictConfig, length: int) -> dict[str, int]:
        """A longer sequence is a longer completion: the prompt's room (``max_length - max_completion_length``) is kept."""
        room = cfg.data.max_length - cfg.data.max_completion_length
        return {"data.max_length": length, "data.max_completion_length": max(1, length - room)}

    def memory_phases(self, cfg: DictConfig, config, micro_batch: int, value_bytes: int) -> dict[str, dict]:
        """``generate``'s peak for ``micro_batch x G`` sequences of ``data.max_length`` tokens: the KV cache (layers x 2 x
        kv_heads x head_dim values a token), and as temporaries one layer's cache grown by a copy (``torch.cat``), the last
        position's logits with the sampler's two fp32 copies (3 x V x 4 bytes a sequence), and the prefill's MLP activations of
        one layer (3 x intermediate values a prompt token); no gradients (set to None before the step)."""
        rows, length = micro_batch * cfg.grpo.num_generations, cfg.data.max_length
        heads = config.num_attention_heads
        per_token = (
            2 * (getattr(config, "num_key_value_heads", None) or heads) * (getattr(config, "head_dim", None) or config.hidden_size // heads)
        )
        cache = rows * length * config.num_hidden_layers * per_token * value_bytes
        prompt = length - cfg.data.max_completion_length
        prefill = 3 * rows * prompt * getattr(config, "intermediate_size", 4 * config.hidden_size) * value_bytes
        sampling = {"activations": cache, "temporaries": cache // config.num_hidden_layers + 3 * rows * config.vocab_size * 4 + prefill}
        return {**super().memory_phases(cfg, config, micro_batch, value_bytes), "sampling": {**sampling, "grads": False}}

    def resident_bytes(self, cfg: DictConfig) -> dict[str, int]:
        """Each ``RewardModelScore`` reward's model: its parameters in fp32 (as it loads), counted from the architecture its
        checkpoint stores (:func:`.rewards.reward_model_bytes`)."""
        from .rewards import reward_model_bytes

        found = {}
        for name, reward in (cfg.data.get("rewards") or {}).items():
            target = str((reward.get("function") or {}).get("_target_", ""))
            if target.endswith(".RewardModelScore"):
                found[f"data.rewards.{name} (a reward model)"] = reward_model_bytes(reward.function.ckpt_path)
        return found

    def memory_advice(self, cfg: DictConfig, weights_dominate: bool) -> tuple[dict[str, dict], list[str]]:
        told = ["a smaller grpo.num_generations or data.max_completion_length (the step holds micro_batch x G sequences)"]
        if cfg.peft.method != "qlora" and weights_dominate:
            told.append("peft=qlora (the weights, not the activations, dominate; plan it to see)")
        return {}, told

    def after_test(self, module, datamodule, trainer, predictions: Path, split: str, key: str) -> dict:
        """With ``data.judge`` and ``data.sample_prompts``: judged samples as the preference demos judge them."""
        if getattr(datamodule, "judge", None) is None or not datamodule.sample_prompts:
            return {}
        from ..preference.samples import judged_samples

        return judged_samples(module, datamodule, trainer, predictions, split, "_start" if key.endswith("_start") else "")


TASK = GRPO()
