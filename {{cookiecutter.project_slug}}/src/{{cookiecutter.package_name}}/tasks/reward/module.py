"""LightningModule for reward models: a sequence classifier with one output, trained on preference pairs (Bradley–Terry)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from transformers import AutoModelForSequenceClassification

from ...core.data.tokenization import pad_token_id
from ...core.models.base import HFModule

METRICS = ("pair_accuracy", "margin", "reward_chosen", "reward_rejected")  # per pair, averaged over a step's or a split's pairs


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair ``-log sigmoid(r_chosen - r_rejected)`` ``(P,)`` (the Bradley–Terry likelihood of the preference, as in
    Ouyang et al. 2022, eq. 1) and the ``(P, len(METRICS))`` metric values, from rewards ``(P,)`` each."""
    margin = chosen.float() - rejected.float()
    values = torch.stack([(margin > 0).float(), margin, chosen.float(), rejected.float()], dim=1).detach()
    return -F.logsigmoid(margin), values


class RewardModule(HFModule):
    """Train a reward model: ``AutoModelForSequenceClassification`` with ``num_labels=1`` (a decoder reads its score at the last
    token that is not padding; an encoder at its first), fully or with LoRA/QLoRA (the new head trains in full).

    Batches: :class:`..preference.data.PairCollator`'s ``2P`` sequences, chosen first (``labels`` unused); ``forward`` returns
    rewards ``(B,)`` (float, unitless: only differences mean something).  The loss is :func:`bradley_terry` per pair, divided
    by the accumulated batch's pairs.  Logged per step and per val/test pass (means over pairs): ``loss``, ``pair_accuracy``
    (share with the chosen reward higher), ``margin`` (chosen minus rejected reward), ``reward_chosen``, ``reward_rejected``.
    """

    AUTO_CLASS = AutoModelForSequenceClassification
    PEFT_TASK_TYPE = "SEQ_CLS"  # peft keeps the new head trainable (modules_to_save)

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        peft: dict | None = None,
        attention: dict | None = None,
        activation_checkpointing: dict | None = None,
        compile: dict | None = None,
        qat: dict | None = None,
        hf_config: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.setup_optimization()
        self._window_pairs = torch.zeros(len(METRICS))  # the step's summed metric values (pairs: the base's item count)

    def config_fields(self) -> dict:
        """One output, and the pad id a decoder finds its last token by: the checkpoint's, else the tokenizer's."""
        stored = self.hparams.hf_config
        if stored is not None:
            return {"num_labels": 1, "pad_token_id": stored["pad_token_id"]}
        return {"num_labels": 1, "pad_token_id": pad_token_id(self.tokenizer)} if self.tokenizer is not None else {"num_labels": 1}

    def configure_metrics(self) -> None:
        for split in ("val", "test"):
            setattr(self, f"{split}_metrics", torch.nn.ModuleDict({name: MeanMetric() for name in ("loss", *METRICS)}))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids") if key in batch}
        return self.model(**inputs).logits[:, 0]  # (B,)

    def pair_terms(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair loss ``(P,)`` and metric values ``(P, len(METRICS))`` (:func:`bradley_terry`)."""
        rewards = self(batch)  # (2P,)
        chosen, rejected = rewards.chunk(2)
        return bradley_terry(chosen, rejected)

    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        loss, _ = self.pair_terms(batch)
        return loss.sum(), loss.shape[0]

    def loss_divisor(self) -> float:
        return self.inputs.micro_batch_size if self.inputs is not None else 1

    def on_train_start(self) -> None:
        super().on_train_start()
        self._window_pairs = torch.zeros(len(METRICS), device=self.device)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss, values = self.pair_terms(batch)
        self._window_pairs += values.sum(dim=0)
        return self.add_to_window(loss.sum(), loss.shape[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # train/loss, over the step's pairs (self._step_items, all devices)
        sums = self.trainer.strategy.reduce(self._window_pairs, reduce_op="sum")
        for name, total in zip(METRICS, sums, strict=True):
            self.log_step_metric(f"train/{name}", total / self._step_items)
        self._window_pairs.zero_()

    def eval_step(self, batch: dict[str, torch.Tensor], split: str) -> None:
        loss, values = self.pair_terms(batch)
        metrics = getattr(self, f"{split}_metrics")
        metrics["loss"].update(loss.mean(), weight=loss.shape[0])
        for name, column in zip(METRICS, values.unbind(1), strict=True):
            metrics[name].update(column.mean(), weight=loss.shape[0])

    def log_metrics(self, split: str) -> None:
        values = {f"{split}/{name}": metric.compute() for name, metric in getattr(self, f"{split}_metrics").items()}
        shown = {key: values.pop(key) for key in (f"{split}/loss", f"{split}/pair_accuracy")}
        self.log_dict(shown, prog_bar=split == "val")
        self.log_dict(values)

    def on_validation_epoch_start(self) -> None:
        for metric in self.val_metrics.values():  # (reset at the start: see CausalLMModule.reset_metrics)
            metric.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.log_metrics("val")

    def on_test_epoch_start(self) -> None:
        for metric in self.test_metrics.values():
            metric.reset()

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log_metrics("test")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Rewards ``(B,)`` of the input's texts, fp32."""
        return self(batch).float()
