"""LightningModule for causal language models: pretrain, full fine-tune, LoRA and QLoRA."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ...core.errors import ConfigError
from ...core.models.adapters import quantized_loading, uses_peft
from ...core.models.base import HFModule
from ...core.models.builder import config_to_dict, spec_config
from ...core.models.precision import weights_dtype
from .generation import TextGeneration
from .loss import (
    causal_body,
    causal_lm_of,
    check_causal_spec,
    chunked_token_loss_sum,
    liger_token_loss_sum,
    model_arguments,
    token_loss_sum,
)

CHAT_FILE = "chat.json"


class CausalLMModule(TextGeneration, HFModule):
    """Train an ``AutoModelForCausalLM``: from scratch (``model.config``) or from pretrained
    weights (``model.name_or_path``), fully or with LoRA/QLoRA adapters (``peft``).

    Batches are dicts of ``input_ids``, ``attention_mask`` and ``labels``, each ``(B, T)``
    (see :class:`.text.CausalLMCollator`); ``forward`` returns logits ``(B, T, V)``.

    **Loss normalisation**: per target token over the whole accumulated batch (see
    :class:`...core.models.base.HFModule`), so micro-batch 1 x accumulation 2 gives the same gradient as
    micro-batch 2, even when the sequences have different lengths (averaging per-micro-batch
    means would weight the tokens of a short sequence more).

    Logged: ``train/loss`` (per optimizer step, the token mean above), ``train/tokens`` (input
    tokens seen, padding excluded), ``train/padding_fraction``, ``val/loss``, ``val/ppl``
    (``exp(val/loss)``, both token-weighted over the whole validation set), ``test/*`` alike.

    Args:
        model: the ``model`` config group as a plain dict (``name_or_path`` or ``config``,
            ``tokenizer``, ``fetch``).
        optimizer: the ``optimizer`` config group as a plain dict.
        peft: the ``peft`` config group as a plain dict (``method``: none / lora / qlora, ...).
        attention, activation_checkpointing, compile: those config groups (see :class:`...core.models.base.HFModule`).
        loss: the ``loss`` group: ``implementation`` plain (cross-entropy over the full logits),
            chunked (:func:`chunked_token_loss_sum`, ``chunk_size`` positions per chunk) or liger
            (:func:`liger_token_loss_sum`, CUDA only); ``None`` = plain.
        hf_config: filled in on the first fit and stored in checkpoints, from which
            export/generate rebuild the model.

    Raises (from ``prepare_data``, before the data is tokenised and any weights load):
        ConfigError: ``data.max_length`` above the model's maximum positions, a LoRA target
            that matches no layer, LoRA/QLoRA without pretrained weights, QLoRA with bf16-true,
            the chunked loss on a model that transforms its logits.
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

    # ----------------------------------------------------------------------------- building
    @property
    def loss_implementation(self) -> str:
        """``loss.implementation``: plain | chunked | liger."""
        return self.hparams.loss["implementation"] if self.hparams.get("loss") else "plain"

    def prepare_data(self) -> None:
        """Install the model files, then check the spec against the architecture, before the
        data is tokenised and before any weights load (Lightning calls this first)."""
        super().prepare_data()
        if self.hparams.hf_config is None and self.inputs is not None:  # (the config's facts: no tokenizer yet, none needed)
            self.architecture_spec(precision=self.inputs.precision, max_length=self.inputs.max_length)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Loaded from a checkpoint (eval/export), the module has no inputs yet: fp32 weights.
        precision = self.inputs.precision if self.inputs is not None else "32-true"
        if self.hparams.hf_config is None:
            self.model = self.build_model(precision, max_length=self.inputs.max_length)
            hf_config = config_to_dict(self.model.config)
            self.hparams.hf_config = hf_config
        else:  # load_from_checkpoint / export: the weights come from the checkpoint
            if uses_peft(self.hparams.peft):
                self.prepare_data()  # the base weights are read from model.name_or_path
            self.model = self.build_model(precision, max_length=None)
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps modes as found
        # The chunked loss calls the transformer body and the lm_head itself: compile the body.
        self.apply_levers(compile_target=causal_body(self.model) if self.loss_implementation != "plain" else None)
        self.configure_metrics()

    def architecture_spec(
        self, precision: str, max_length: int | None, config: PretrainedConfig | None = None
    ) -> tuple[PretrainedConfig, list[str]]:
        """The HF config (``config`` given, the planner's; else the checkpoint's, else the spec's)
        and the LoRA target modules, checked by :func:`.loss.check_causal_spec`."""
        if config is None and self.hparams.hf_config is not None:
            fields = dict(self.hparams.hf_config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif config is None:
            config = spec_config(self.hparams.model, self.tokenizer)
        peft = self.hparams.peft or {"method": "none"}
        return config, check_causal_spec(config, self.hparams.model, peft, precision, max_length, self.loss_implementation)

    def build_model(
        self, precision: str, max_length: int | None, config: PretrainedConfig | None = None, pretrained: bool = True
    ) -> torch.nn.Module:
        """The one builder of this task's model (``train``, ``plan``, eval/export all call it):
        check the spec (:meth:`architecture_spec`), then load the pretrained weights or initialise
        random ones, in the dtype of :func:`...core.models.precision.weights_dtype`, and add the LoRA adapters.

        Args:
            precision: Lightning's precision flag the model will run under.
            max_length: the longest row in tokens (checked against the positions), or ``None``.
            config: the HF config to build (the planner's); default: the spec's.
            pretrained: ``False`` builds random weights even for a pretrained spec (the planner).

        Raises:
            ConfigError: see the class docstring; QLoRA's 4-bit load failing.
        """
        spec, peft_cfg, method = self.hparams.model, self.hparams.peft, self.peft_method
        config, modules = self.architecture_spec(precision, max_length, config=config)
        dtype = weights_dtype(precision, method)
        if pretrained and spec.get("name_or_path") and (method != "none" or self.hparams.hf_config is None):
            options = {"dtype": dtype, "attn_implementation": self.attn_implementation}
            if method == "qlora":
                trainer = self.attached_trainer()
                options.update(quantized_loading(peft_cfg, precision, trainer.strategy.root_device if trainer is not None else None))
            try:
                model, info = self.AUTO_CLASS.from_pretrained(spec["name_or_path"], output_loading_info=True, **options)
                self.remember_fresh(model, info)
            except (ImportError, RuntimeError, ValueError) as error:
                if method != "qlora":
                    raise
                raise ConfigError(
                    f"peft=qlora could not load {spec['name_or_path']!r} in 4-bit: {error}\nfix: bitsandbytes with a "
                    "backend for this device (CUDA, or the CPU from bitsandbytes 0.45: pip install -U bitsandbytes), "
                    "or peft=lora"
                ) from error
        else:
            model = self.AUTO_CLASS.from_config(config, attn_implementation=self.attn_implementation, dtype=dtype)
        if method != "none":
            model = self.add_adapters(model, modules, pretrained=pretrained and bool(spec.get("name_or_path")))
        self.prepare_qat(model)
        return model

    # ------------------------------------------------------------------------------ steps
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**model_arguments(batch)).logits  # (B, T, V)

    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss and target count of a batch (train/val/test): the plain loss on
        the logits, or the chunked / Liger one on the hidden states (``loss`` group)."""
        if self.loss_implementation == "plain":
            return token_loss_sum(self(batch), batch["labels"])
        body = causal_body(self.model)
        hidden = body(**model_arguments(batch)).last_hidden_state  # (B, T, D)
        lm_head = causal_lm_of(self.model).get_output_embeddings()
        if self.loss_implementation == "liger":
            return liger_token_loss_sum(hidden, lm_head, batch["labels"])
        return chunked_token_loss_sum(hidden, lm_head, batch["labels"], self.hparams.loss["chunk_size"])

    def loss_divisor(self) -> float:
        # The largest possible token count of a micro-batch keeps the loss at the per-token scale
        # (1 when fit on a bare DataLoader).
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
        """Reset ``split``'s metrics at the start of its pass, not the end: trainer.validate runs under
        inference mode, and state tensors re-created there could not be updated in place by fit's loop."""
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

    # ------------------------------------------------------------------------ generation
    # ----------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)  # the tokenizer's files
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))

    def merged_model(self) -> PreTrainedModel:
        """A plain HF model with this module's weights: LoRA adapters merged into the base
        (``merge_and_unload``), ``use_cache`` on for generation.  For QLoRA, call this on a
        module rebuilt without quantization (see the ``export`` entry point)."""
        model = super().merged_model()
        model.config.use_cache = True
        return model


def causal_module_class(cfg) -> type[CausalLMModule]:
    """What ``export`` and ``generate`` load a checkpoint into: the config's task module
    (``task.module``) when its task trains a causal LM (causal_lm, preference), else
    :class:`CausalLMModule` (a config left at another default task).  A checkpoint of another task
    than the class's is then refused by ``core.checkpoints.io.load_trained_module``, naming the task
    to give (``task=preference``)."""
    from ...core.task import module_class

    found = module_class(cfg)
    return found if issubclass(found, CausalLMModule) else CausalLMModule
