"""Pruning during training, at optimizer-step boundaries (the ``pruning`` group; docs/compression.md).

Not Lightning's ``ModelPruning``: it prunes only at epoch or validation ends; the cubic schedule of Zhu & Gupta 2017
prunes every ``frequency`` optimizer steps.  The sparsity is a function of the step alone, so a resumed run catches up
to the same masks before its first forward.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.utils import prune

from ..checkpoints.io import read_checkpoint
from ..compress import CONV1D_MODEL_TYPES, conv1d_refusal
from ..compress.pruning import (
    BERT_FFN_TYPES,
    GATED_FFN_TYPES,
    FFNBlock,
    apply_mask,
    ffn_blocks,
    masked_count,
    model_type_named,
    prune_magnitude,
    prune_neurons,
    pruned_tensors,
    pruning_problems,
    scheduled_sparsity,
    structured_refusal,
    two_four_mask,
)
from ..errors import ConfigError
from ..models.contract import TrainedModule


class Pruning(L.Callback):
    """Prune ``pl_module.model`` during ``fit``, logging ``train/sparsity`` and ``train/sparsity_model`` each step.  The
    masks are this callback's state; checkpoints hold plain ``weight`` tensors (eval/export need no pruning code).  A
    resume re-applies the masks once the optimizer exists, keeping each parameter object (its state still matches).

    Args:
        end_step: the step the ramp reaches ``final_sparsity`` (null for 2:4).
        frequency: optimizer steps between prunings on the ramp (null for 2:4).

    Raises:
        ConfigError: a bad value (at construction), a model ``structured`` does not know (``setup``), or Linear shapes
            the method cannot take (at fit start).
    """

    def __init__(self, method: str, begin_step: int, end_step: int | None, final_sparsity: float, frequency: int | None) -> None:
        settings = {
            "method": method,
            "begin_step": begin_step,
            "end_step": end_step,
            "final_sparsity": final_sparsity,
            "frequency": frequency,
        }
        problems = pruning_problems(settings)
        if problems or method == "none":
            raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems or ["pruning.method=none builds no Pruning callback"]))
        self.method, self.begin_step, self.end_step = method, begin_step, end_step
        self.final_sparsity, self.frequency = final_sparsity, frequency
        self.tensors: list[tuple[torch.nn.Module, str]] = []  # what the method masks
        self.blocks: list[FFNBlock] = []  # structured: the FFN of each block
        self.keys: list[str] = []  # their state_dict keys in the LightningModule
        self.weights = 0  # entries of the pruned Linear weights
        self.parameters = 0
        self.pruned = 0  # masked entries of the pruned Linear weights
        self.pruned_all = 0  # masked entries of every pruned tensor (biases too)
        self.step = -1  # the optimizer step whose sparsity the masks hold
        self._pending: dict | None = None
        self.removed_masks: dict = {}  # the masks on_train_end made permanent
        self._stepped = False

    # ---------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not hasattr(pl_module, "hparams") or "model" not in pl_module.hparams:
            return
        spec = pl_module.hparams.model
        model_type = model_type_named(spec)
        if model_type is None and spec.get("name_or_path"):  # model files are local by now (prepare_data)
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(spec["name_or_path"]).model_type
        if model_type in CONV1D_MODEL_TYPES:
            raise ConfigError(conv1d_refusal(f"pruning={self.method}", model_type, "pruning=none"))
        if self.method == "structured" and model_type is not None and model_type not in BERT_FFN_TYPES + GATED_FFN_TYPES:
            raise ConfigError(structured_refusal(model_type))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After configure_optimizers: the optimizer holds the unpruned parameters in the saving run's order.
        model = pl_module.model
        self.tensors = pruned_tensors(model, self.method)
        self.blocks = ffn_blocks(model) if self.method == "structured" else []
        names = {id(module): name for name, module in pl_module.named_modules()}
        self.keys = [f"{names[id(module)]}.{name}" for module, name in self.tensors]
        self.weights = sum(getattr(m, n).numel() for m, n in self.tensors if n == "weight")
        self.parameters = sum(p.numel() for p in model.parameters())
        if self._pending is not None:
            if self._pending["method"] != self.method:
                raise ConfigError(
                    f"pruning.method={self.method} but the checkpoint was pruned with {self._pending['method']}; "
                    f"fix: pruning={self._pending['method']} to resume it"
                )
            for (module, name), key in zip(self.tensors, self.keys, strict=True):
                if key in self._pending["masks"]:
                    apply_mask(module, name, self._pending["masks"][key].to(getattr(module, name).device))
            self.step = self._pending["step"]
            self._pending = None
            self._count()
        if self.method == "semi_structured_2_4" and pl_module.device.type != "cuda":
            rank_zero_info(
                "pruning=semi_structured_2_4 on the CPU: the 2:4 pattern is trained, but its speed-up cannot be measured here "
                "(torch.sparse.to_sparse_semi_structured needs a CUDA GPU; see core.compress.pruning.to_semi_structured_sparse)"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        last = self.begin_step if self.method == "semi_structured_2_4" else self.end_step
        total = trainer.estimated_stepping_batches
        if total < last:
            reached = scheduled_sparsity(int(total), self.begin_step, self.end_step, self.final_sparsity, self.frequency)
            rank_zero_warn(
                f"pruning reaches pruning.final_sparsity={self.final_sparsity} after optimizer step {last}, and this run has "
                f"{int(total)}: it ends at sparsity {reached:.3f}; fix: a pruning.end_step below {int(total)}"
            )
        self.update(trainer.global_step)  # begin_step=0; or a checkpoint saved before its step's pruning

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int) -> None:
        self._stepped = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        if not self._stepped:  # a micro-batch inside an accumulation window
            return
        self.update(trainer.global_step)
        for name, value in (("train/sparsity", self.sparsity), ("train/sparsity_model", self.sparsity_model)):
            if isinstance(pl_module, TrainedModule):
                pl_module.log_step_metric(name, value)  # in the step's CSV row, also when written early
            else:
                pl_module.log(name, value, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.removed_masks = self.state_dict()["masks"]  # (a checkpoint saved after this, e.g. Lightning's last, keeps them)
        for module, name in self.tensors:
            if hasattr(module, name + "_mask"):
                prune.remove(module, name)  # permanent: the zeros stay in a plain parameter

    # ---------------------------------------------------------------------- checkpoints
    @property
    def schedule_end(self) -> int:
        """The optimizer step after which the masks hold ``final_sparsity`` (2:4 is applied at once)."""
        return self.begin_step if self.method == "semi_structured_2_4" else self.end_step

    def checkpoint_to_test(self, best: str, final: str, global_step: int) -> str:
        """``best``, unless saved before the schedule ended (or ``global_step``, for a shorter run): then ``final``, with a
        warning.  A less-pruned model can validate better; it is not the pruned model the run was for."""
        saved_at = read_checkpoint(Path(best), "global_step")
        done = min(self.schedule_end, global_step)
        if saved_at is None or saved_at >= done:
            return best
        rank_zero_warn(
            f"the best checkpoint ({best}, optimizer step {saved_at}) was saved before pruning reached its final sparsity "
            f"(step {done}): testing and reporting the weights the fit ended with ({final}) instead"
        )
        return final

    def state_dict(self) -> dict:
        masks = {
            key: getattr(m, n + "_mask").bool() for (m, n), key in zip(self.tensors, self.keys, strict=True) if hasattr(m, n + "_mask")
        }
        return {"method": self.method, "step": self.step, "masks": masks or self.removed_masks}

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for key in self.keys:
            if key + "_orig" in state:
                state[key] = state.pop(key + "_orig") * state.pop(key + "_mask")

    # ------------------------------------------------------------------------ pruning
    @property
    def sparsity(self) -> float:
        """Masked entries over the pruned Linear weights."""
        return self.pruned / self.weights if self.weights else 0.0

    @property
    def sparsity_model(self) -> float:
        """Masked entries over all the model's parameters."""
        return self.pruned_all / self.parameters if self.parameters else 0.0

    def update(self, step: int) -> None:
        """Bring the masks to the sparsity scheduled after ``step`` optimizer steps."""
        if step < self.begin_step or step == self.step:
            return
        self.step = step
        if self.method == "semi_structured_2_4":
            if self.pruned == 0:
                for module, name in self.tensors:
                    apply_mask(module, name, two_four_mask(getattr(module, name)))
                self._count()
            return
        target = scheduled_sparsity(step, self.begin_step, self.end_step, self.final_sparsity, self.frequency)
        if self.method == "magnitude":
            count = round(target * self.weights)  # an integer amount: the sparsity is exact
            if count > self.pruned:
                prune_magnitude(self.tensors, count - self.pruned)
                self._count()
        else:
            width = self.blocks[0].width
            neurons = round(target * width)  # the same count in every block
            if neurons > round(self.sparsity * width):
                prune_neurons(self.blocks, neurons)
                self._count()

    def _count(self) -> None:
        self.pruned = masked_count([(m, n) for m, n in self.tensors if n == "weight"])
        self.pruned_all = masked_count(self.tensors)
