"""LightningModule for causal language models: pretrain, full fine-tune, LoRA and QLoRA."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ...core.models.base import HFModule
from .generation import TextGeneration
from .loss import (
    causal_body,
    causal_lm_of,
    check_causal_config,
    chunked_token_loss_sum,
    liger_token_loss_sum,
    model_arguments,
    token_loss_sum,
)

CHAT_FILE = "chat.json"


class CausalLMModule(TextGeneration, HFModule):
    """Train an ``AutoModelForCausalLM`` from scratch (``model.config``) or pretrained (``model.name_or_path``), fully or with
    LoRA/QLoRA (``peft``); the arguments are the config groups of ``task.module_args``, as dicts.

    Batches: ``input_ids``, ``attention_mask``, ``labels`` ``(B, T)``; ``forward`` returns logits ``(B, T, V)``.  The loss is per
    target token over the whole accumulated batch (:class:`...core.models.base.HFModule`); ``loss``: plain, chunked
    (:func:`.loss.chunked_token_loss_sum`) or liger (CUDA).  Logs ``train/loss``, ``train/tokens`` (no padding),
    ``train/padding_fraction``, ``val/loss``, ``val/ppl`` (exp of the token-weighted loss) and ``test/*`` alike.
    """

    AUTO_CLASS = AutoModelForCausalLM

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        peft: dict,
        attention: dict | None = None,
        activation_checkpointing: dict | None = None,
        compile: dict | None = None,
        loss: dict | None = None,
        qat: dict | None = None,
        hf_config: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.setup_optimization()
        self.tokens_seen = 0
        self._window_tokens = torch.zeros((), dtype=torch.long)

    @property
    def loss_implementation(self) -> str:
        """``loss.implementation``: plain | chunked | liger."""
        return self.hparams.loss["implementation"] if self.hparams.get("loss") else "plain"

    def check_spec(self, config: PretrainedConfig, precision: str, max_length: int | None) -> list[str] | str:
        """The shared checks and :func:`.loss.check_causal_config`.

        Raises:
            ConfigError: an encoder, a chunked/Liger loss on logits transformed after the lm_head, or see the base's.
        """
        check_causal_config(config, self.hparams.model, self.loss_implementation)
        return super().check_spec(config, precision, max_length)

    def compile_target(self) -> torch.nn.Module | None:
        # The chunked loss calls the transformer body and the lm_head itself: compile the body.
        return causal_body(self.model) if self.loss_implementation != "plain" else None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**model_arguments(batch)).logits  # (B, T, V)

    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss and target count: plain on the logits, chunked / Liger on the hidden states (``loss`` group)."""
        if self.loss_implementation == "plain":
            return token_loss_sum(self(batch), batch["labels"])
        body = causal_body(self.model)
        hidden = body(**model_arguments(batch)).last_hidden_state  # (B, T, D)
        lm_head = causal_lm_of(self.model).get_output_embeddings()
        if self.loss_implementation == "liger":
            return liger_token_loss_sum(hidden, lm_head, batch["labels"])
        return chunked_token_loss_sum(hidden, lm_head, batch["labels"], self.hparams.loss["chunk_size"])

    def loss_divisor(self) -> float:
        # The most tokens a micro-batch can hold keeps the loss at per-token scale (1 on a bare DataLoader).
        return self.inputs.micro_batch_size * self.inputs.max_length if self.inputs is not None else 1

    def on_train_start(self) -> None:
        super().on_train_start()
        self._window_tokens = torch.zeros((), dtype=torch.long, device=self.device)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss_sum, n_targets = self.model_step(batch)
        mask = batch.get("token_mask", batch.get("attention_mask"))  # (B, T) 1 = a real token
        self._window_tokens += mask.sum()  # a tensor: no host sync per micro-batch
        self.log_step_metric("train/padding_fraction", 1.0 - mask.float().mean())
        return self.add_to_window(loss_sum, n_targets)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # rescales the gradients, logs train/loss
        self.tokens_seen += int(self._window_tokens)  # one host sync per optimizer step
        self.log_step_metric("train/tokens", float(self.tokens_seen))
        self._window_tokens.zero_()

    def configure_metrics(self) -> None:
        """The validation and test metrics (built with the model: their state follows its device)."""
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    def eval_step(self, batch: dict[str, torch.Tensor], split: str) -> None:
        """Update ``split``'s (val | test) metrics with one batch."""
        loss_sum, n_targets = self.model_step(batch)
        getattr(self, f"{split}_loss").update(loss_sum / n_targets, weight=n_targets)  # token-weighted mean over the split

    def reset_metrics(self, split: str) -> None:
        """Reset at the pass's start, not its end: tensors re-created under trainer.validate's inference mode break fit's updates."""
        getattr(self, f"{split}_loss").reset()

    def log_metrics(self, split: str) -> None:
        """Log ``split``'s metrics over the whole pass (all devices): loss and perplexity."""
        loss = getattr(self, f"{split}_loss").compute()  # token-weighted mean over the split (all devices)
        self.log_dict({f"{split}/loss": loss, f"{split}/ppl": torch.exp(loss)}, prog_bar=split == "val")

    def on_validation_epoch_start(self) -> None:
        self.reset_metrics("val")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.log_metrics("val")

    def on_test_epoch_start(self) -> None:
        self.reset_metrics("test")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log_metrics("test")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)  # the tokenizer's files
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))

    def merged_model(self) -> PreTrainedModel:
        """A plain HF model, LoRA merged (``merge_and_unload``), ``use_cache`` on; for QLoRA, from a module rebuilt unquantized."""
        model = super().merged_model()
        model.config.use_cache = True
        return model
