"""LightningModule for sequence classification with any ``AutoModelForSequenceClassification``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from transformers import AutoModelForSequenceClassification

from ...core.data.tokenization import use_eos_as_pad
from ...core.models.base import HFModule
from ...core.models.metrics import PendingUpdates


def classification_metrics(num_classes: int, split: str) -> MetricCollection:
    """Accuracy (micro: the share of rows right) and F1 (macro: the unweighted mean over classes, so a rare class counts as
    much), logged as ``{split}/acc`` and ``{split}/f1_macro``."""
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(num_classes=num_classes, average="micro"),
            "f1_macro": MulticlassF1Score(num_classes=num_classes, average="macro"),
        },
        prefix=f"{split}/",
    )


class SequenceClassificationModule(HFModule):
    """Fine-tune (or train from scratch) a sequence classifier, built (:meth:`...core.models.base.HFModule.build_model`) once
    the data has set the labels, so bad data fails before any weights load.

    The arguments are the config groups of ``task.module_args``; ``hf_config`` is stored by the first fit (eval/predict rebuild
    the model from it).  Batches: ``input_ids``/``attention_mask``/``token_type_ids`` ``(B, T)``, ``labels`` ``(B,)``; ``forward``
    returns logits ``(B, num_labels)``.  A decoder classifies from each row's last token (right padding; EOS as pad if none).
    LoRA/QLoRA: the base is frozen, the new head trains in full, checkpoints hold the trained weights only.
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

    def config_fields(self) -> dict:
        """The head's labels and the pad id a decoder's classifier reads by: the checkpoint's, else the data's; ``{}`` before any."""
        stored = self.hparams.hf_config
        if stored is not None:
            return {key: stored[key] for key in ("id2label", "label2id", "pad_token_id")}
        if self.inputs is None or self.inputs.id2label is None:
            return {}
        use_eos_as_pad(self.tokenizer)
        id2label = dict(self.inputs.id2label)
        label2id = {name: index for index, name in id2label.items()}
        return {"num_labels": len(id2label), "id2label": id2label, "label2id": label2id, "pad_token_id": self.tokenizer.pad_token_id}

    def configure_metrics(self) -> None:
        self.train_metrics, self.val_metrics, self.test_metrics = (self.metrics(split) for split in ("train", "val", "test"))
        self.train_updates = PendingUpdates(self.train_metrics)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()  # (of BEST_OF; the name is the one checkpoints store)
        self.val_acc_best.persistent(True)  # in the checkpoint's state_dict: a resumed run keeps the best so far

    def metrics(self, split: str) -> MetricCollection:
        """The metrics of ``split``, logged as ``{split}/<name>`` (:func:`classification_metrics`); needs the built model's labels."""
        return classification_metrics(self.model.config.num_labels, split)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.model(**inputs).logits  # (B, num_labels)

    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The loss contract of every task, ``(loss_sum, items)``: the rows' summed cross-entropy (fp32) and their count (an int)."""
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
        """The summed cross-entropy, normalised over the accumulated batch (:class:`...core.models.base.HFModule`)."""
        logits = self(batch)  # (B, num_labels)
        self.train_updates.add(logits.detach().argmax(dim=-1), batch["labels"])  # logged at the epoch's end (on_train_epoch_end)
        return self.add_to_window(*self.loss_sum(logits, batch))

    def on_train_epoch_end(self) -> None:
        """``train/acc`` and ``train/f1_macro`` over the epoch's rows, logged once (a per-step ``self.log`` costs Lightning overhead)."""
        self.train_updates.flush()
        if any(metric.update_count for metric in self.train_metrics.values()):  # (none after a resume at the epoch's end)
            self.log_dict(self.train_metrics.compute())
        self.train_metrics.reset()

    def _eval_step(self, batch: dict[str, torch.Tensor], loss: MeanMetric, metrics: MetricCollection) -> None:
        logits = self(batch)  # (B, num_labels)
        loss_sum, rows = self.loss_sum(logits, batch)
        metrics.update(logits, batch["labels"])
        # Row-weighted: exact under DDP with uneven ranks (Lightning's sync_dist mean of an int batch size would round).
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
