"""LightningModule for token classification (NER, POS, chunking) with any ``AutoModelForTokenClassification``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import SumMetric
from torchmetrics.classification import MulticlassAccuracy
from transformers import AutoModelForTokenClassification

from ...core.data.tokenization import IGNORE_INDEX
from ..classification.module import SequenceClassificationModule
from .data import NOT_INPUTS
from .spans import EntityScores, per_word

# What the data module tells the module of its tags when none was stored (core/models/inputs.ModelInputs.task_facts).
DEFAULT_FACTS = {"scheme": "IOB2", "strict": False}


class TagMetrics:
    """One split's metrics: ``{split}/acc`` (token accuracy over the labelled positions), ``/words_cut`` (words ``max_length``
    cut off) and ``/words_no_token`` (words with no sub-token): both scored as ``O``, and, with ``entities``, ``/precision``, ``/recall``, ``/f1`` (micro), ``/f1_<type>``, ``/invalid_tags``
    (:class:`.spans.EntityScores`: tags read on the host, so not in training).  ``module``: where the metrics are registered."""

    def __init__(
        self, split: str, id2label: dict[int, str], facts: dict, entities: bool = True, module: torch.nn.Module | None = None
    ) -> None:
        self.split = split
        self.metrics = {
            "accuracy": MulticlassAccuracy(num_classes=len(id2label), average="micro", ignore_index=IGNORE_INDEX),
            "words_cut": SumMetric(),
            "words_no_token": SumMetric(),
            **({"entities": EntityScores(id2label, facts["scheme"], bool(facts["strict"]))} if entities else {}),
        }
        for name, metric in self.metrics.items():
            if module is not None:
                module.add_module(f"{split}_{name}", metric)

    def update(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        predicted = logits.argmax(dim=-1)  # (B, T)
        self.metrics["accuracy"].update(predicted, batch["labels"])
        if "entities" in self.metrics:
            self.metrics["entities"].update(predicted, batch["labels"], batch["word_tags"], batch["word_kept"])
        for count in ("words_cut", "words_no_token"):
            self.metrics[count].update(batch[count].sum())

    def compute(self) -> dict[str, torch.Tensor]:
        values = {name: self.metrics[name].compute() for name in ("words_cut", "words_no_token")}
        values["acc"] = self.metrics["accuracy"].compute()
        if "entities" in self.metrics:
            values.update(self.metrics["entities"].compute())
        return {f"{self.split}/{name}": value for name, value in values.items()}

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def values(self):
        """The metric objects (their update counts tell whether anything was seen)."""
        return self.metrics.values()

    @property
    def entities(self) -> EntityScores | None:
        return self.metrics.get("entities")


class TokenClassificationModule(SequenceClassificationModule):
    """Fine-tune (or train from scratch) a token classifier: as :class:`..classification.module.SequenceClassificationModule`,
    with another head (peft ``TOKEN_CLS``), loss and metrics.

    Batches: ``input_ids``/``attention_mask``/``token_type_ids`` ``(B, T)``, ``labels`` ``(B, T)`` (a tag id on each word's first
    sub-token, -100 elsewhere), ``word_tags``/``word_kept`` ``(B, W)``, ``words_cut``/``words_no_token`` ``(B,)`` (:class:`.data.WordTagsCollator`); ``forward`` returns logits ``(B, T, num_tags)``.  The loss is summed over
    the labelled positions, normalised per word.  The metrics parse tags by the data's ``scheme``/``strict`` (checkpointed).
    """

    AUTO_CLASS = AutoModelForTokenClassification
    PEFT_TASK_TYPE = "TOKEN_CLS"
    BEST_OF = "val/f1"

    @property
    def tag_facts(self) -> dict:
        """``{"scheme": ..., "strict": ...}`` of the data's tags (:data:`DEFAULT_FACTS` before any data)."""
        return {**DEFAULT_FACTS, **((self.inputs.task_facts if self.inputs is not None else None) or {})}

    def datamodule_kwargs(self) -> dict:
        """The base's, and the checkpoint's tag scheme (``trained_facts``: a config that says otherwise is refused)."""
        return {**super().datamodule_kwargs(), "trained_facts": self.tag_facts}

    def metrics(self, split: str) -> TagMetrics:
        id2label = {int(index): name for index, name in self.model.config.id2label.items()}  # (JSON keys are strings)
        return TagMetrics(split, id2label, self.tag_facts, entities=split != "train", module=self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Read the stored facts, then rebuild the metrics: eval builds the model first, and scores by the stored tag scheme."""
        super().on_load_checkpoint(checkpoint)
        if self.model is not None:
            self.train_metrics, self.val_metrics, self.test_metrics = (self.metrics(split) for split in ("train", "val", "test"))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in NOT_INPUTS}
        return self.model(**inputs).logits  # (B, T, num_tags)

    @staticmethod
    def loss_sum(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, words)``: cross-entropy of logits ``(B, T, num_tags)`` summed over the labelled positions of ``(B, T)``."""
        labels = batch["labels"]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (labels != IGNORE_INDEX).sum()

    def loss_divisor(self) -> float:
        # The most labelled positions a micro-batch can hold keeps the loss near the per-word scale.
        return self.inputs.micro_batch_size * (self.inputs.max_length or 1) if self.inputs is not None else 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        logits = self(batch)  # (B, T, num_tags)
        self.train_metrics.update(logits.detach(), batch)  # logged at the epoch's end (on_train_epoch_end)
        return self.add_to_window(*self.loss_sum(logits, batch))

    def _eval_step(self, batch: dict[str, torch.Tensor], loss, metrics: TagMetrics) -> None:
        logits = self(batch)  # (B, T, num_tags)
        loss_sum, words = self.loss_sum(logits, batch)
        metrics.update(logits, batch)
        loss.update(loss_sum / words.clamp(min=1), weight=words)  # a per-word mean, exact under DDP

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_loss, self.val_metrics)
        self.log("val/loss", self.val_loss, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        # Entity scores are sums over the split: computed once at its end; the base then tracks the best val/f1 (BEST_OF).
        self.log_dict(self.val_metrics.compute())
        super().on_validation_epoch_end()
        self.val_metrics.reset()

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_loss, self.test_metrics)
        self.log("test/loss", self.test_loss, on_epoch=True)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> list[list[int | None]]:
        """Each row's tag id per word, ``None`` for a word without a sub-token in the input (:func:`.spans.per_word`)."""
        predicted = self(batch).argmax(dim=-1)  # (B, T)
        return per_word(predicted, batch["labels"], batch["word_tags"], batch["word_kept"])
