"""LightningModule for GRPO: each micro-batch of prompts samples ``G`` completions a prompt with the policy, scores them
with the reward functions, and takes the clipped policy-gradient step of :mod:`.objective`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from ...core.data.tokenization import pad_token_id
from ..causal_lm.loss import causal_body, causal_lm_of
from ..causal_lm.module import CausalLMModule
from ..preference.module import disable_dropout
from .objective import GRPOSettings, group_advantages, grpo_loss, step_seed
from .rewards import score_completions

STAGES = {"train": 0, "val": 1, "test": 2}
SPLIT_OF_STAGE = {"train": "train", "val": "validation", "test": "test"}
# Logged per optimizer step (train/<name>; means over the step's completions or groups) and per val/test pass.
STEP_METRICS = ("reward", "reward_std", "zero_std_share", "completion_length", "clipped", "kl")


class GRPOModule(CausalLMModule):
    """Tune a causal LM with GRPO (:mod:`.objective`; the ``grpo`` group: ``num_generations`` G, ``temperature``,
    ``epsilon``/``epsilon_high``, ``beta``, ``loss_aggregation``, ``scale_rewards``, ``seed``). A batch holds ``P`` prompts
    (:class:`.data.PromptDataModule`), sampled into ``N = P x G`` sequences of up to ``data.max_completion_length`` new tokens.

    The reference, when ``beta > 0``, is this model with its LoRA/QLoRA adapters off (no second model). Dropout is off, so the
    sampling policy's log-probs are the trained ones (one update per sample: the clip ratio is 1 and clips nothing). Sampling
    is seeded per micro-batch (:func:`.objective.step_seed`) under ``torch.random.fork_rng``: a resumed run samples what the
    uninterrupted one would have. Logged per step: ``train/loss``, ``train/reward`` (weighted sum of the functions, mean over
    completions), ``train/reward_<name>`` per function, ``train/reward_std`` (mean within-group std), ``train/zero_std_share``
    (groups whose rewards are all equal: no gradient), ``train/completion_length`` (tokens, end token included),
    ``train/clipped``, ``train/kl`` (mean k3 per token); per val/test pass (``G`` seeded samples a prompt, the same seeds
    every pass): ``reward``, ``reward_<name>``, ``reward_std``, ``zero_std_share``, ``completion_length``.
    """

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        peft: dict,
        grpo: dict,
        attention: dict | None = None,
        activation_checkpointing: dict | None = None,
        compile: dict | None = None,
        loss: dict | None = None,
        qat: dict | None = None,
        hf_config: dict | None = None,
    ) -> None:
        super().__init__(model, optimizer, peft, attention, activation_checkpointing, compile, loss, qat, hf_config)
        self.settings = GRPOSettings(**grpo)
        self._window: dict[str, torch.Tensor] = {}  # metric -> (sum, count) over the optimizer step's micro-batches

    def build_model(self, precision: str, config=None) -> torch.nn.Module:
        model = super().build_model(precision, config=config)
        disable_dropout(model)
        return model

    def configure_metrics(self) -> None:
        super().configure_metrics()
        self.val_rewards = torch.nn.ModuleDict()  # metric -> MeanMetric, made at the pass's start (the reward names)
        self.test_rewards = torch.nn.ModuleDict()

    # ------------------------------------------------------------------ sampling and scoring
    @property
    def max_completion_length(self) -> int:
        """``data.max_completion_length``, handed over by the data (``task_objects``)."""
        return self.task_objects["max_completion_length"]

    def stop_id(self) -> int:
        """The token that ends a completion: the end-of-turn token of a chat model, else EOS."""
        if self.chat:
            return self.tokenizer.convert_tokens_to_ids(self.inputs.end_of_turn)
        return self.tokenizer.eos_token_id

    @torch.no_grad()
    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """``G`` completions of each left-padded prompt ``(P, T)``: ``sequences`` and ``attention_mask`` ``(N, T + C)``,
        ``completion_mask`` ``(N, C)`` (1 up to and including the first end token), ``C <= max_completion_length``."""
        group = self.settings.num_generations
        prompt_ids, prompt_mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)  # (N, T)
        stop, pad = self.stop_id(), pad_token_id(self.tokenizer)
        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                output = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    do_sample=True,
                    temperature=self.settings.temperature,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=self.max_completion_length,
                    eos_token_id=stop,
                    pad_token_id=pad,
                    use_cache=True,
                )  # (N, T + C)
        finally:
            self.model.train(was_training)
        completion = output[:, input_ids.shape[1] :]  # (N, C)
        stops = completion == stop
        end = torch.where(stops.any(dim=1), stops.int().argmax(dim=1), completion.shape[1])  # (N,) the first end token
        completion_mask = (torch.arange(completion.shape[1], device=completion.device)[None] <= end[:, None]).long()
        return {
            "sequences": output,
            "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
            "completion_mask": completion_mask,
        }

    def completion_texts(self, sampled: dict[str, torch.Tensor], prompt_length: int) -> list[str]:
        """Each completion's text, without its end token and special tokens."""
        texts, stop = [], self.stop_id()
        for ids, mask in zip(sampled["sequences"][:, prompt_length:].tolist(), sampled["completion_mask"].tolist(), strict=True):
            kept = [token for token, real in zip(ids, mask, strict=True) if real and token != stop]
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=True))
        return texts

    def scored(self, batch: dict, stage: str, batch_idx: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """Sample the batch's completions and score them: ``(sampled, rewards (N,), {name: (N,)})``.

        Raises:
            DataError: a reward function failed (:func:`.rewards.score_completions`).
        """
        step, micro = self.trainer.global_step, batch_idx % max(1, self.trainer.accumulate_grad_batches)
        if stage != "train":
            step, micro = 0, batch_idx  # the same samples every pass
        seed = step_seed(self.settings.seed, STAGES[stage], self.global_rank, step, micro)
        sampled = self.sample(batch["input_ids"], batch["attention_mask"], seed)
        group = self.settings.num_generations
        rows = [row for row in batch["rows"] for _ in range(group)]
        numbers = [int(number) for number in batch["row"].tolist() for _ in range(group)]
        texts = self.completion_texts(sampled, batch["input_ids"].shape[1])
        rewards, each = score_completions(
            self.task_objects["rewards"], [row["prompt"] for row in rows], texts, rows, numbers, SPLIT_OF_STAGE[stage]
        )
        return sampled, rewards.to(self.device), {name: values.to(self.device) for name, values in each.items()}

    # ------------------------------------------------------------------ the loss
    def token_logps(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """``(N, C)`` log-probs (nats) of each completion token under the tempered policy: the lm_head on the completion
        positions only."""
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: each row counts from its first token
        hidden = causal_body(self.model)(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).last_hidden_state
        logits = causal_lm_of(self.model).get_output_embeddings()(hidden[:, prompt_length - 1 : -1]).float()  # (N, C, V)
        targets = sequences[:, prompt_length:]
        nll = F.cross_entropy((logits / self.settings.temperature).flatten(0, 1), targets.flatten(), reduction="none")
        return -nll.view_as(targets)

    def policy_terms(self, sequences, attention_mask, completion_mask, prompt_length: int, advantages, max_completion_length: int):
        """:func:`.objective.grpo_loss` of sampled sequences ``(N, T + C)`` with masks ``(N, T + C)`` and ``(N, C)`` and
        advantages ``(N,)``, with the adapters-off reference when ``beta > 0``."""
        logps = self.token_logps(sequences, attention_mask, prompt_length)
        reference = None
        if self.settings.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                reference = self.token_logps(sequences, attention_mask, prompt_length)
        return grpo_loss(logps, logps.detach(), reference, advantages, completion_mask, self.settings, max_completion_length)

    def loss_divisor(self) -> float:
        if self.inputs is None:
            return 1
        per_prompt = self.settings.num_generations * (self.max_completion_length if self.settings.loss_aggregation == "token" else 1)
        return self.inputs.micro_batch_size * per_prompt

    # ------------------------------------------------------------------ steps
    def group_stats(self, rewards: torch.Tensor, sampled: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        """``{metric: (sum, count)}`` of a micro-batch: reward, reward_std and zero_std_share per group, completion_length."""
        grouped = rewards.view(-1, self.settings.num_generations)
        std = grouped.std(dim=1)
        lengths = sampled["completion_mask"].sum(dim=1).float()
        return {
            "reward": (rewards.sum(), rewards.numel()),
            "reward_std": (std.sum(), std.numel()),
            "zero_std_share": ((std < 1e-6).float().sum(), std.numel()),
            "completion_length": (lengths.sum(), lengths.numel()),
        }

    def add_window(self, name: str, total: torch.Tensor, count: int | torch.Tensor) -> None:
        pair = torch.stack(
            [
                torch.as_tensor(total, dtype=torch.float32, device=self.device).detach(),
                torch.as_tensor(count, dtype=torch.float32, device=self.device),
            ]
        )
        self._window[name] = self._window[name] + pair if name in self._window else pair

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        sampled, rewards, each = self.scored(batch, "train", batch_idx)
        advantages = group_advantages(rewards, self.settings.num_generations, self.settings.scale_rewards)
        prompt_length = batch["input_ids"].shape[1]
        masks = sampled["attention_mask"], sampled["completion_mask"]
        terms = self.policy_terms(sampled["sequences"], *masks, prompt_length, advantages, self.max_completion_length)
        for name, (total, count) in self.group_stats(rewards, sampled).items():
            self.add_window(name, total, count)
        for name, values in each.items():
            self.add_window(f"reward_{name}", values.sum(), values.numel())
        self.add_window("clipped", terms.clipped, 1)
        self.add_window("kl", terms.kl, 1)
        batch["input_ids"], batch["attention_mask"] = sampled["sequences"], sampled["attention_mask"]  # (tokens/s counts these)
        self._window_tokens += sampled["attention_mask"].sum()
        return self.add_to_window(terms.loss_sum, terms.items)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # train/loss, train/tokens
        for name, pair in self._window.items():
            total, count = self.trainer.strategy.reduce(pair, reduce_op="sum")
            self.log_step_metric(f"train/{name}", total / count)
        self._window = {}

    def eval_step(self, batch: dict, split: str) -> None:
        sampled, rewards, each = self.scored(batch, split, self._eval_batch)
        self._eval_batch += 1
        metrics = getattr(self, f"{split}_rewards")
        stats = self.group_stats(rewards, sampled)
        stats.update({f"reward_{name}": (values.sum(), values.numel()) for name, values in each.items()})
        for name, (total, count) in stats.items():
            if name not in metrics:
                metrics[name] = MeanMetric().to(self.device)
            metrics[name].update(total / count, weight=count)

    def reset_metrics(self, split: str) -> None:
        self._eval_batch = 0
        for metric in getattr(self, f"{split}_rewards").values():
            metric.reset()

    def log_metrics(self, split: str) -> None:
        metrics = getattr(self, f"{split}_rewards")
        if "reward" in metrics:
            self.log(f"{split}/reward", metrics["reward"].compute(), prog_bar=split == "val")
            self.log_dict({f"{split}/{name}": metric.compute() for name, metric in metrics.items() if name != "reward"})
