"""LightningModule for preference tuning (DPO, ORPO, SimPO on pairs, KTO on unpaired answers): the causal-LM module with a
preference loss."""

from __future__ import annotations

import torch
from torchmetrics import SumMetric

from ...core.errors import ConfigError
from ..causal_lm.loss import LOGIT_TRANSFORM_FIELDS, causal_body, causal_lm_of, model_arguments
from ..causal_lm.module import CausalLMModule
from .objectives import NEEDS_REFERENCE, completion_logps, completion_logps_from_hidden, dpo, kto, orpo, simpo

DROPOUT = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
# Per pair (KTO: per answer of its kind), averaged over a step's (or a split's): logged as train/<name>, val/<name>,
# test/<name>, and reward_margin, the first reward's mean minus the second's.
PAIR_METRICS = ("reward_chosen", "reward_rejected", "reward_accuracy", "logp_chosen", "logp_rejected")
KTO_METRICS = ("reward_desirable", "reward_undesirable", "kl", "logp_desirable", "logp_undesirable")
SPLIT_OF_STAGE = {"train": "train", "val": "validation", "test": "test"}


class PreferenceModule(CausalLMModule):
    """Tune a causal LM on preference pairs: ``P`` pairs a batch as ``2P`` sequences (chosen first), the ``objective`` group's
    loss (:mod:`.objectives`; ``name``: dpo | orpo | simpo | kto, ``beta``, DPO's ``label_smoothing``, SimPO's ``gamma``, KTO's
    ``desirable_weight`` and ``undesirable_weight``). KTO's batch: ``P`` answers, then their ``P`` mismatched answers, and
    ``desirable`` ``(P,)`` (:class:`.data.UnpairedDataModule`).

    DPO's reference (ORPO and SimPO need none) is never a second model in memory: with LoRA/QLoRA, the same forward with the
    adapters off (they start at zero); for a full fine-tune, tables of the starting weights' log-probs computed before the first
    step (:class:`.reference_logps.ReferenceLogProbs`) and kept in checkpoints.  Dropout is off (as in TRL), so log-probs are
    deterministic.  The summed pair loss is divided by the accumulated batch's pairs (:class:`...core.models.base.HFModule`).
    Logged per step and per val/test pass (means over pairs): ``loss``, ``reward_chosen``, ``reward_rejected``, ``reward_margin``,
    ``reward_accuracy`` (share with chosen > rejected), ``logp_chosen``, ``logp_rejected`` (summed completion log-probs, nats);
    KTO: ``loss``, ``reward_desirable``, ``reward_undesirable`` (means over the answers of each kind), ``reward_margin``, ``kl``
    (the reference point ``z0``), ``logp_desirable``, ``logp_undesirable``. A kind with no answer in a step or split is not logged.
    """

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        peft: dict,
        objective: dict,
        attention: dict | None = None,
        activation_checkpointing: dict | None = None,
        compile: dict | None = None,
        loss: dict | None = None,
        qat: dict | None = None,
        hf_config: dict | None = None,
    ) -> None:
        super().__init__(model, optimizer, peft, attention, activation_checkpointing, compile, loss, qat, hf_config)
        # split -> (pairs, 2) starting-weights log-probs (chosen, rejected) for a full fine-tune's DPO (ReferenceLogProbs).
        self.reference_tables: dict[str, torch.Tensor] = {}
        self.reference_fingerprints: dict[str, torch.Tensor] = {}  # split -> (pairs,) the checksums of the pairs they are for
        self.at_starting_weights = True  # False once trained or loaded from a checkpoint
        self._window_pairs = torch.zeros(2, len(self.metric_names))  # (value sums, weights)

    def build_model(self, precision: str, config=None) -> torch.nn.Module:
        model = super().build_model(precision, config=config)
        disable_dropout(model)
        return model

    def configure_metrics(self) -> None:
        super().configure_metrics()
        for split in ("val", "test"):  # each metric's weighted sum, then its weight
            sums = {name: SumMetric() for name in self.metric_names} | {f"{name}_weight": SumMetric() for name in self.metric_names}
            setattr(self, f"{split}_pairs", torch.nn.ModuleDict(sums))

    @property
    def objective(self) -> str:
        return self.hparams.objective["name"]

    @property
    def metric_names(self) -> tuple[str, ...]:
        return KTO_METRICS if self.objective == "kto" else PAIR_METRICS

    @property
    def reference_from_adapters_off(self) -> bool:
        """The reference is this model with its adapters off (LoRA/QLoRA: standard init starts equal to the base)."""
        return self.peft_method in ("lora", "qlora")

    @property
    def needs_reference_tables(self) -> bool:
        """DPO without adapters to switch off: the reference log-probs come from tables."""
        return self.objective in NEEDS_REFERENCE and not self.reference_from_adapters_off

    def sequence_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probs and completion tokens, ``(2P,)`` each: the lm_head on the scored positions only
        (:func:`.objectives.completion_logps_from_hidden`), or full logits if transformed after the lm_head (Gemma 2's softcap)."""
        lm = causal_lm_of(self.model)
        if any(getattr(lm.config, field, None) not in (None, 1.0) for field in LOGIT_TRANSFORM_FIELDS):
            return completion_logps(self(batch), batch["labels"])
        hidden = causal_body(self.model)(**model_arguments(batch)).last_hidden_state  # (2P, T, D)
        return completion_logps_from_hidden(hidden, lm.get_output_embeddings(), batch["labels"], batch.get("scored_from"))

    def reference_logps(self, batch: dict[str, torch.Tensor], split: str | None) -> torch.Tensor:
        """``(2P,)`` reference log-probs: the batch's own (the planner's), the adapters-off forward, or the ``split``'s table.

        Raises:
            ConfigError: a full fine-tune's split without a table, or pairs other than the table's.
        """
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if self.reference_from_adapters_off:
            with torch.no_grad(), self.model.disable_adapter():
                return self.sequence_logps(batch)[0]
        table = self.reference_tables.get(split) if split else None
        if table is None:
            raise ConfigError(
                f"objective={self.objective} needs the reference log-probs of the {split} pairs, which are computed from the "
                "starting weights before the first step (tasks/preference/reference_logps.ReferenceLogProbs), and this run has "
                f"none for that split (tables: {sorted(self.reference_tables)}); fix: train with the split in data.splits "
                "(the callback computes it at step 0), or peft=lora (the reference is the model with its adapters off)"
            )
        index, prints = batch["pair"], self.reference_fingerprints.get(split)
        if prints is None or int(index.max()) >= len(prints) or not torch.equal(prints.to(index.device)[index], batch["pair_fingerprint"]):
            raise ConfigError(
                f"the {split} pairs are not the ones this run's reference log-probs were computed for (pair {int(index[0])}: another "
                "file, or other rows or tokens), and the starting weights that would give theirs are gone; fix: the data.splits "
                "the run was trained with (the reference of a full fine-tune's DPO is computed before its first step)"
            )
        chosen, rejected = table.to(index.device)[index].unbind(1)  # (P,) each
        return torch.cat([chosen, rejected])

    def pair_terms(self, batch: dict[str, torch.Tensor], split: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's per-pair (KTO: per-answer) loss ``(P,)`` and ``(2, P, len(metric_names))`` metric values and weights
        (a KTO answer weighs 1 in the metrics of its kind, 0 in the other's)."""
        logps, n_tokens = self.sequence_logps(batch)
        pairs = logps.shape[0] // 2
        logp_w, logp_l, n_w, n_l = logps[:pairs], logps[pairs:], n_tokens[:pairs], n_tokens[pairs:]
        settings = self.hparams.objective
        if self.objective == "kto":
            reference = self.reference_logps(batch, split).to(logps.dtype)
            weights = (settings["desirable_weight"], settings["undesirable_weight"])
            answers = kto(logp_w, reference[:pairs], logp_l, reference[pairs:], batch["desirable"], settings["beta"], *weights)
            good = batch["desirable"].float()
            values = [answers.reward, answers.reward, answers.kl.expand(pairs), logp_w.detach(), logp_w.detach()]
            kinds = [good, 1 - good, torch.ones_like(good), good, 1 - good]
            return answers.loss, torch.stack([torch.stack(values, dim=1), torch.stack(kinds, dim=1)])
        if self.objective == "dpo":
            reference = self.reference_logps(batch, split).to(logps.dtype)
            terms = dpo(logp_w, logp_l, reference[:pairs], reference[pairs:], settings["beta"], settings["label_smoothing"])
        elif self.objective == "simpo":
            terms = simpo(logp_w, logp_l, n_w, n_l, settings["beta"], settings["gamma"])
        else:
            terms = orpo(logp_w, logp_l, n_w, n_l, settings["beta"])
        accurate = (terms.reward_chosen > terms.reward_rejected).float()
        values = torch.stack([terms.reward_chosen, terms.reward_rejected, accurate, logp_w.detach(), logp_l.detach()], dim=1)
        return terms.loss, torch.stack([values, torch.ones_like(values)])

    def metric_means(self, sums: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: mean}`` from per-metric weighted sums and weights ``(len(metric_names),)``, and ``reward_margin``; a metric of
        no weight (no answer of that kind) is left out."""
        means = {name: total / weight for name, total, weight in zip(self.metric_names, sums, weights, strict=True) if weight > 0}
        first, second = self.metric_names[:2]
        if first in means and second in means:
            means["reward_margin"] = means[first] - means[second]
        return means

    def model_step(self, batch: dict[str, torch.Tensor], split: str | None = None) -> tuple[torch.Tensor, int]:
        """The summed pair (KTO: answer) loss of the micro-batch and its number of pairs."""
        loss, _ = self.pair_terms(batch, split)
        return loss.sum(), loss.shape[0]

    def loss_divisor(self) -> float:
        return self.inputs.micro_batch_size if self.inputs is not None else 1

    def on_train_start(self) -> None:
        super().on_train_start()
        self._window_pairs = torch.zeros(2, len(self.metric_names), device=self.device)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss, values = self.pair_terms(batch, "train")
        self._window_pairs += torch.stack([(values[0] * values[1]).sum(dim=0), values[1].sum(dim=0)])
        mask = batch["token_mask"]  # (2P, T) 1 = a real token
        self._window_tokens += mask.sum()
        self.log_step_metric("train/padding_fraction", 1.0 - mask.float().mean())
        return self.add_to_window(loss.sum(), loss.shape[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # train/loss (the step's pairs: self._step_items), train/tokens
        sums, weights = self.trainer.strategy.reduce(self._window_pairs, reduce_op="sum")  # (all devices)
        for name, value in self.metric_means(sums, weights).items():
            self.log_step_metric(f"train/{name}", value)
        self._window_pairs.zero_()
        self.at_starting_weights = False

    def eval_step(self, batch: dict[str, torch.Tensor], split: str) -> None:
        loss, (values, weights) = self.pair_terms(batch, SPLIT_OF_STAGE[split])
        getattr(self, f"{split}_loss").update(loss.mean(), weight=loss.shape[0])
        metrics = getattr(self, f"{split}_pairs")
        for name, column, weight in zip(self.metric_names, values.unbind(1), weights.unbind(1), strict=True):
            metrics[name].update((column * weight).sum())
            metrics[f"{name}_weight"].update(weight.sum())

    def reset_metrics(self, split: str) -> None:
        super().reset_metrics(split)
        for metric in getattr(self, f"{split}_pairs").values():
            metric.reset()

    def log_metrics(self, split: str) -> None:
        metrics = getattr(self, f"{split}_pairs")
        sums = torch.stack([metrics[name].compute() for name in self.metric_names])
        means = self.metric_means(sums, torch.stack([metrics[f"{name}_weight"].compute() for name in self.metric_names]))
        headline = "reward_margin" if self.objective == "kto" else "reward_accuracy"  # (on the progress bar for val, with the loss)
        shown = {f"{split}/loss": getattr(self, f"{split}_loss").compute()}
        if headline in means:  # (not when the split's answers are all of one kind)
            shown[f"{split}/{headline}"] = means.pop(headline)
        self.log_dict(shown, prog_bar=split == "val")
        self.log_dict({f"{split}/{name}": value for name, value in means.items()})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["reference_logps"] = {
            split: {"logps": table.cpu(), "fingerprints": self.reference_fingerprints[split].cpu()}
            for split, table in self.reference_tables.items()
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        stored = checkpoint.get("reference_logps", {})
        self.reference_tables = {str(split): tables["logps"].float() for split, tables in stored.items()}
        self.reference_fingerprints = {str(split): tables["fingerprints"].long() for split, tables in stored.items()}
        self.at_starting_weights = False


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0: each ``nn.Dropout`` (LoRA's too) and float ``attention_dropout``/``dropout``
    attribute read at forward (Llama's, passed to SDPA); the config is left as it was (exports keep it)."""
    for module in model.modules():
        if isinstance(module, DROPOUT):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
