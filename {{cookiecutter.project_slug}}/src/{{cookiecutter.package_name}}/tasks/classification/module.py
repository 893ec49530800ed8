"""LightningModule for sequence classification with any ``AutoModelForSequenceClassification``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig

from ...core.models.adapters import check_adapter_spec, quantized_loading, target_modules
from ...core.models.base import HFModule
from ...core.models.builder import (
    build_sequence_classifier,
    check_max_length,
    config_to_dict,
    linear_layer_names,
    sequence_classifier_from_dict,
    spec_config,
)
from ...core.models.precision import weights_dtype


def classification_metrics(num_classes: int, split: str) -> MetricCollection:
    """Accuracy (``average="micro"``: the fraction of rows right) and F1 (``average="macro"``:
    the unweighted mean of per-class F1, so a rare class counts as much as a common one),
    logged as ``{split}/acc`` and ``{split}/f1_macro``."""
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(num_classes=num_classes, average="micro"),
            "f1_macro": MulticlassF1Score(num_classes=num_classes, average="macro"),
        },
        prefix=f"{split}/",
    )


class PendingUpdates:
    """A metric collection's training updates, gathered and applied ``every`` micro-batches at a
    time (one ``update`` of the concatenated rows) and when :meth:`flush` is called.

    The training metrics are read once, at the epoch's end, and accuracy and F1 are sums over
    rows, so the figures are those of per-micro-batch updates; what changes is the cost: a
    torchmetrics ``update`` of two metrics is about 0.1 ms of Python and a dozen small kernels
    (2-core CPU, ``bench/throughput.py``'s overhead workload), once per ``every`` micro-batches
    here, while :meth:`add` is a list append.  Holds at most ``every`` predictions ``(B,)`` and
    labels ``(B,)`` on their device.
    """

    def __init__(self, metrics: MetricCollection, every: int = 64) -> None:
        self.metrics, self.every = metrics, every
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        """Class ids ``(B,)`` (long) against labels ``(B,)``."""
        self.predictions.append(predictions)
        self.labels.append(labels)
        if len(self.predictions) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.predictions:
            self.metrics.update(torch.cat(self.predictions), torch.cat(self.labels))
            self.predictions, self.labels = [], []


class SequenceClassificationModule(HFModule):
    """Fine-tune (or train from scratch) a sequence classifier.

    The Hugging Face model is built in ``configure_model``, after the data module's ``setup``
    has read the labels and loaded the tokenizer, so bad data fails before any weights load and
    ``num_labels``/``id2label`` come from the data (their one source).

    Args:
        model: the ``model`` config group as a plain dict (see :mod:`...core.models.builder`), including an
            optional ``fetch`` (called once in ``prepare_data`` to install the weights).
        optimizer: the ``optimizer`` config group as a plain dict (``_target_``, ``lr``, ...).
        attention, activation_checkpointing, compile: those config groups as plain dicts (see
            :class:`...core.models.base.HFModule`).
        peft: the ``peft`` config group as a plain dict (``method``: none / lora / qlora, ...);
            ``None`` = none.  With LoRA/QLoRA the pretrained model is frozen, adapters train on
            its linear layers and the new head trains in full; checkpoints hold those weights
            only, and eval/predict re-read the frozen base from ``model.name_or_path``.
        hf_config: filled in on the first fit and stored in checkpoints, from which
            eval/predict rebuild the model without the pretrained files (the labels are in
            :attr:`inputs`, ``checkpoint["model_inputs"]``).

    Batches are dicts of ``input_ids``/``attention_mask``/``token_type_ids`` ``(B, T)`` and
    ``labels`` ``(B,)``; ``forward`` returns logits ``(B, num_labels)``.  A decoder (GPT-2,
    Llama) classifies from the hidden state of each row's last token: ``config.pad_token_id``
    follows the tokenizer (its EOS when it has no pad token) and rows are padded on the right.

    Raises (from ``prepare_data``, before the data is tokenised and any weights load):
        ConfigError: ``data.max_length`` above the model's positions, LoRA/QLoRA without
            pretrained weights, a LoRA target that matches no layer, QLoRA with bf16-true.
    """

    AUTO_CLASS = AutoModelForSequenceClassification  # the transformers class of the model (one label per row)
    PEFT_TASK_TYPE = "SEQ_CLS"  # peft's task type: it keeps the new head trainable (modules_to_save)
    BEST_OF = "val/acc"  # the validation metric whose best so far is logged as <name>_best

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        attention: dict | None = None,
        activation_checkpointing: dict | None = None,
        compile: dict | None = None,
        peft: dict | None = None,
        qat: dict | None = None,
        hf_config: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.setup_optimization()

    @property
    def label2id(self) -> dict[str, int]:
        """Label name -> class index, from :attr:`inputs` (the data, or the checkpoint)."""
        return self.inputs.label2id

    def datamodule_kwargs(self) -> dict:
        """What eval/predict pass to the data module: the checkpoint's tokenizer and labels."""
        return {**super().datamodule_kwargs(), "label2id": self.label2id}

    def prepare_data(self) -> None:
        """Install the model files, then check the spec against the architecture (positions,
        LoRA targets), before the data is tokenised and before any weights load (Lightning calls
        this first)."""
        super().prepare_data()
        if self.inputs is not None:  # (the config's facts: the labels are not read yet, none needed)
            config = self.architecture()
            check_max_length(config, self.inputs.max_length)
            check_adapter_spec(self.hparams.peft, self.hparams.model, self.inputs.precision)
            if self.peft_method != "none":
                self.lora_targets(config)

    def lora_targets(self, config: PretrainedConfig) -> list[str]:
        """The LoRA target modules of this architecture (see :func:`...core.models.adapters.target_modules`).

        Raises:
            ConfigError: no target list for the model family, or a name matching no linear layer.
        """
        return target_modules(self.hparams.peft, config, linear_layer_names(config, self.AUTO_CLASS))

    def architecture(self) -> PretrainedConfig:
        """The HF config of the model (the checkpoint's, or the spec's), read without weights."""
        if self.hparams.hf_config is not None:
            fields = dict(self.hparams.hf_config)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return spec_config(self.hparams.model, None)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Loaded from a checkpoint (eval/predict), the module has no inputs yet: fp32 weights.
        self.model = self.build_model(self.inputs.precision if self.inputs is not None else "32-true")
        if self.hparams.hf_config is None:  # (first fit: the architecture built, stored for eval/predict)
            self.hparams.hf_config = config_to_dict(self.model.config)
        # from_pretrained returns the model in eval mode (dropout off), and Lightning keeps
        # each submodule's mode as it finds it: switch to train mode explicitly.
        self.model.train()
        self.apply_levers()
        self.train_metrics, self.val_metrics, self.test_metrics = (self.metrics(split) for split in ("train", "val", "test"))
        self.train_updates = PendingUpdates(self.train_metrics)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()  # (of BEST_OF; the name is the one checkpoints store)
        self.val_acc_best.persistent(True)  # in the checkpoint's state_dict: a resumed run keeps the best so far

    def metrics(self, split: str) -> MetricCollection:
        """The metrics of ``split`` (``train``/``val``/``test``), logged as ``{split}/<name>``
        (:func:`classification_metrics`); the model is built, so its labels are known."""
        return classification_metrics(self.model.config.num_labels, split)

    def build_model(self, precision: str, max_length: int | None = None, config: PretrainedConfig | None = None) -> torch.nn.Module:
        """The one builder of this task's model (``train``, ``plan``, eval/predict all call it), in
        the dtype of :func:`...core.models.precision.weights_dtype`: ``config`` (the planner's: random weights),
        else the architecture a checkpoint stored (``hf_config``: random weights the checkpoint
        then fills; with LoRA/QLoRA the pretrained base, as the checkpoint holds only the trained
        weights), else the spec with a fresh head of the data's labels (:attr:`inputs`); then the
        LoRA adapters (``peft``).  ``max_length`` is not used (the signature is the causal LM's).

        Raises:
            ValueError: the spec gives neither ``name_or_path`` nor ``config``.
            ConfigError: see the class docstring.
        """
        attention, method = self.attn_implementation, self.peft_method
        dtype = weights_dtype(precision, method)
        trainer = self.attached_trainer()
        device = trainer.strategy.root_device if trainer is not None else None
        loading = quantized_loading(self.hparams.peft, precision, device) if method == "qlora" and config is None else {}
        info: dict = {}  # from_pretrained's loading info: which weights it drew at random
        if config is not None:
            model = self.AUTO_CLASS.from_config(config, attn_implementation=attention, dtype=dtype)
        elif self.hparams.hf_config is not None and method == "none":
            model = sequence_classifier_from_dict(self.hparams.hf_config, attention, dtype=dtype, auto_class=self.AUTO_CLASS)
        elif self.hparams.hf_config is not None:  # an adapter checkpoint: the frozen base is re-read
            super().prepare_data()  # (model.fetch)
            stored = {key: self.hparams.hf_config[key] for key in ("id2label", "label2id", "pad_token_id")}
            model, info = self.AUTO_CLASS.from_pretrained(
                self.hparams.model["name_or_path"],
                attn_implementation=attention,
                dtype=dtype,
                output_loading_info=True,
                **loading,
                **stored,
            )
        else:
            model = build_sequence_classifier(
                self.hparams.model,
                self.inputs.id2label,
                self.inputs.tokenizer,
                attention,
                dtype=dtype,
                loading=loading,
                loading_info=info,
                auto_class=self.AUTO_CLASS,
            )
        if config is None:
            self.remember_fresh(model, info)
        if method != "none":
            targets = self.lora_targets(config or self.architecture())
            model = self.add_adapters(model, targets, task_type=self.PEFT_TASK_TYPE, pretrained=config is None)
        self.prepare_qat(model)
        return model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.model(**inputs).logits  # (B, num_labels)

    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The loss contract of every task: ``(loss_sum, items)``, the cross-entropy summed over
        the micro-batch's rows (fp32 scalar) and their count (an int: the host knows it)."""
        return self.loss_sum(self(batch), batch)

    @staticmethod
    def loss_sum(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(loss_sum, rows)`` of ``logits`` ``(B, num_labels)`` against ``batch["labels"]`` ``(B,)``."""
        labels = batch["labels"]
        return F.cross_entropy(logits.float(), labels, reduction="sum"), len(labels)

    def loss_divisor(self) -> float:
        # The summed loss of a full micro-batch -> its mean (1 when fit on a bare DataLoader).
        return self.inputs.micro_batch_size if self.inputs is not None else 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        """The summed cross-entropy of the rows, normalised over the whole accumulated batch
        (see :class:`...core.models.base.HFModule`): each optimizer step follows the mean over its rows."""
        logits = self(batch)  # (B, num_labels)
        self.train_updates.add(logits.detach().argmax(dim=-1), batch["labels"])  # logged at the epoch's end (on_train_epoch_end)
        return self.add_to_window(*self.loss_sum(logits, batch))

    def on_train_epoch_end(self) -> None:
        """``train/acc`` and ``train/f1_macro`` over the epoch's rows (all processes), once: a
        ``self.log`` of the metric objects in every training step would cost Lightning's
        per-call bookkeeping each step (about 0.5 ms on a small CPU, ``docs/performance.md``)
        for the same figures."""
        self.train_updates.flush()
        if any(metric.update_count for metric in self.train_metrics.values()):  # (none after a resume at the epoch's end)
            self.log_dict(self.train_metrics.compute())
        self.train_metrics.reset()

    def _eval_step(self, batch: dict[str, torch.Tensor], loss: MeanMetric, metrics: MetricCollection) -> None:
        logits = self(batch)  # (B, num_labels)
        loss_sum, rows = self.loss_sum(logits, batch)
        metrics.update(logits, batch["labels"])
        # A torchmetrics mean weighted by rows: under DDP the ranks' sums and row counts add up
        # exactly, also when they hold different numbers of rows (Lightning's sync_dist mean of
        # an integer batch size would round).
        loss.update(loss_sum / rows, weight=rows)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_loss, self.val_metrics)
        self.log("val/loss", self.val_loss, on_epoch=True)
        self.log_dict(self.val_metrics, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.trainer.sanity_checking:  # an untrained model's accuracy is not a "best"
            return
        self.val_acc_best.update(self.val_metrics.compute()[self.BEST_OF])
        self.log(f"{self.BEST_OF}_best", self.val_acc_best.compute(), prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_loss, self.test_metrics)
        self.log("test/loss", self.test_loss, on_epoch=True)
        self.log_dict(self.test_metrics, on_epoch=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Class probabilities ``(B, num_labels)`` in id order."""
        return self(batch).float().softmax(dim=-1)
