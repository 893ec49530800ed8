"""The base of every task's LightningModule: model files, optimizer, loss normalisation, checkpointed tokenizer."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from transformers import AutoConfig, PretrainedConfig

from ..assets import fetch_model_files
from ..errors import ConfigError
from ..identity.fingerprint import base_problem
from ..optim import build_optimizer, lightning_allows_fused
from ..run.secrets import mask
from ..task import task_folder
from .adapters import (
    adapter_tensors,
    check_adapter_spec,
    quantized_loading,
    restore_residual,
    rewrites_base,
    target_modules,
    uses_peft,
    wrap_with_lora,
)
from .builder import check_max_length, config_to_dict, linear_layer_names, spec_config
from .inputs import ModelInputs
from .levers import apply_levers
from .precision import weights_dtype


class HFModule(L.LightningModule):
    """Base of the task modules: ``self.model`` (built in ``configure_model``), ``self.tokenizer``, ``hparams.<group>`` dicts.

    **Loss normalisation.**  ``training_step`` hands :meth:`add_to_window` the *sum* of its micro-batch's per-item losses
    (per token or per row) and the item count; before the optimizer step the gradients are divided by the items of the
    whole accumulated batch (all micro-batches and devices).  So a step follows the global batch's mean whatever the
    micro-batch size, and an epoch's last, partial window is not shrunk by ``accumulate_grad_batches`` as Lightning's
    per-micro-batch division would leave it: HF Trainer's ``num_items_in_batch`` (transformers PR #34191).

    ``skipped_steps`` (checkpointed) counts updates skipped on a non-finite loss.  :attr:`inputs` is handed over
    (:meth:`connect`) and checkpointed, so eval/predict/generate/export need nothing but the checkpoint.
    """

    TASK_NAME = ""  # the task folder of the subclass, stored in checkpoints
    AUTO_CLASS: type  # the transformers Auto class of the task's model
    PEFT_TASK_TYPE = "CAUSAL_LM"  # peft's task type (a classifier's keeps its new head trainable)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.TASK_NAME = task_folder(cls)

    def __init__(self) -> None:
        super().__init__()
        self.model = None  # built in configure_model
        self.fresh_ids: set[int] = set()  # ids of the parameters from_pretrained drew at random (remember_fresh)
        # True when a checkpoint will set the weights: plain peft init, and a PiSSA/OLoRA residual from the checkpoint.
        self.restores_weights = False
        self.initial_adapter: dict[str, torch.Tensor] | None = None  # PiSSA/OLoRA: (A0, B0), kept in checkpoints
        self.tokenizer = None
        self.inputs: ModelInputs | None = None
        self.task_objects: dict = {}  # the data module's task_objects, handed over each run (ConnectData), never saved
        self.skipped_steps = 0
        # `val/*_start` (train.py), checkpointed so that a resumed run's metrics.json still reports them.
        self.start_metrics: dict[str, float] = {}
        self.validated_at_step: int | None = None  # the optimizer step of the last full validation pass
        self._loss_divisor = 1.0
        # The step being accumulated: summed loss (None before its first micro-batch) and item count (an int while host-known).
        self._window_loss: torch.Tensor | None = None
        self._window_items: int | torch.Tensor = 0
        self._step_loss: torch.Tensor | None = None
        self._step_items: float | torch.Tensor = 0.0
        self.step_metrics: dict[str, torch.Tensor | float] = {}  # the latest optimizer step's row (log_step_metric)
        self._row_step = 0
        self._row_pending = False  # an optimizer step whose row on_train_batch_end has not sent yet
        # (the run's entry of its base files, where the checkpoint is): an adapter checkpoint's base is checked against it
        self.expected_base: tuple[dict, str] | None = None

    def attached_trainer(self) -> L.Trainer | None:
        """The trainer running this module, or ``None`` (built by hand, or loaded for eval/export)."""
        try:
            return self.trainer
        except RuntimeError:  # Lightning's "not attached to a Trainer"
            return None

    @property
    def knows_its_data(self) -> bool:
        """Whether the module holds its data's facts (tokenizer, labels), not only the config's."""
        return self.inputs is not None and self.inputs.tokenizer is not None

    def connect(self, inputs: ModelInputs) -> None:
        """Hand the module the facts of its data and run (:mod:`.inputs`), before ``configure_model``."""
        self.inputs = inputs
        self.tokenizer = inputs.tokenizer

    def setup(self, stage: str) -> None:
        """Refuse to build a model without the data's facts.

        Raises:
            RuntimeError: never handed them (no :class:`.inputs.ConnectData`, ``connect`` or checkpoint).
        """
        if not self.knows_its_data:
            raise RuntimeError(
                f"{type(self).__name__} was not handed its data's facts (tokenizer, labels): add "
                "core.models.inputs.ConnectData() to the trainer's callbacks (train and eval do), or call module.connect(...)"
            )

    def datamodule_kwargs(self) -> dict:
        """What eval/predict/quantize hand the task's data module: the checkpoint's tokenizer; a task adds more (labels)."""
        return {"tokenizer": self.tokenizer} if self.tokenizer is not None else {}

    def prepare_data(self) -> None:
        """Install the model files (``model.fetch``), check an adapter checkpoint's base and a fresh spec, before any load.

        Raises:
            ConfigError: the base at ``model.name_or_path`` differs from the run's, or see :meth:`check_spec`.
        """
        if self.hparams.model.get("fetch"):
            fetch_model_files(self.hparams.model["fetch"])
        if self.expected_base is not None:
            entry, where = self.expected_base
            problem = base_problem(entry, str(self.hparams.model["name_or_path"]), where)
            if problem:
                raise ConfigError(problem)
        if self.hparams.hf_config is None and self.inputs is not None:  # (the config's facts: no tokenizer yet, none needed)
            self.check_spec(self.architecture(), self.inputs.precision, self.inputs.max_length)

    # ------------------------------------------------------------------ the model
    def architecture(self) -> PretrainedConfig:
        """The model's HF config without weights: the checkpoint's (``hf_config``), else the spec's."""
        if self.hparams.hf_config is not None:
            fields = dict(self.hparams.hf_config)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return spec_config(self.hparams.model, self.tokenizer, **self.config_fields())

    def config_fields(self) -> dict:
        """Config fields the task's data gives a model (a classifier's labels); ``{}`` by default."""
        return {}

    def check_spec(self, config: PretrainedConfig, precision: str, max_length: int | None) -> list[str] | str:
        """Check the spec against ``config`` before any weights load; return the LoRA targets (``[]`` without adapters).

        Raises:
            ConfigError: ``max_length`` above the positions, LoRA/QLoRA the spec or precision cannot take, an unmatched target.
        """
        check_max_length(config, max_length)
        check_adapter_spec(self.hparams.get("peft"), self.hparams.model, precision)
        if self.peft_method == "none":
            return []
        return target_modules(self.hparams.peft, config, linear_layer_names(config, self.AUTO_CLASS))

    def build_model(self, precision: str, config: PretrainedConfig | None = None) -> torch.nn.Module:
        """The one builder of a task's model: random weights (``config``, :meth:`architecture`) or pretrained; then LoRA, QAT.

        Raises:
            ConfigError: see :meth:`check_spec`; QLoRA's 4-bit load failing.
        """
        spec, method, stored = self.hparams.model, self.peft_method, self.hparams.hf_config
        architecture = config if config is not None else self.architecture()
        targets = self.check_spec(architecture, precision, self.inputs.max_length if self.inputs is not None else None)
        options = {"attn_implementation": self.attn_implementation, "dtype": weights_dtype(precision, method)}
        from_base = config is None and bool(spec.get("name_or_path")) and (method != "none" or stored is None)
        if not from_base:
            model = self.AUTO_CLASS.from_config(architecture, **options)
        else:
            if stored is not None:  # an adapter checkpoint: its base is read again
                HFModule.prepare_data(self)
            if method == "qlora":
                trainer = self.attached_trainer()
                options.update(quantized_loading(self.hparams.peft, precision, trainer.strategy.root_device if trainer else None))
            try:
                model, info = self.AUTO_CLASS.from_pretrained(
                    spec["name_or_path"], output_loading_info=True, **options, **self.config_fields()
                )
            except (ImportError, RuntimeError, ValueError) as error:
                if method != "qlora":
                    raise
                raise ConfigError(
                    f"peft=qlora could not load {spec['name_or_path']!r} in 4-bit: {error}\nfix: bitsandbytes with a "
                    "backend for this device (CUDA, or the CPU from bitsandbytes 0.45: pip install -U bitsandbytes), or peft=lora"
                ) from error
            self.remember_fresh(model, info)
        if method != "none":
            model = self.add_adapters(model, targets, task_type=self.PEFT_TASK_TYPE, pretrained=from_base)
        self.prepare_qat(model)
        return model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Loaded from a checkpoint (eval/export), the module has no inputs yet: fp32 weights.
        self.model = self.build_model(self.inputs.precision if self.inputs is not None else "32-true")
        if self.hparams.hf_config is None:  # (the first fit: the architecture, stored for eval/export)
            self.hparams.hf_config = config_to_dict(self.model.config)
        self.model.train()  # from_pretrained returns eval mode, and Lightning keeps the modes it finds
        self.apply_levers(compile_target=self.compile_target())
        self.configure_metrics()

    def compile_target(self) -> torch.nn.Module | None:
        """What ``compile`` compiles (``None``: the model)."""
        return None

    def configure_metrics(self) -> None:
        """Build the task's metrics (after the model: they follow its device)."""

    def setup_optimization(self) -> None:
        """Call after ``save_hyperparameters``: manual optimization when stepping inside backward (Lightning would step twice)."""
        self.automatic_optimization = not self.hparams.optimizer["step_in_backward"]

    @property
    def peft_method(self) -> str:
        """none | lora | qlora (``none`` for a module built without the ``peft`` group)."""
        return self.hparams.peft["method"] if self.hparams.get("peft") else "none"

    @property
    def attn_implementation(self) -> str:
        """The ``attention`` group's choice (``sdpa`` without it)."""
        return self.hparams.attention["implementation"] if self.hparams.get("attention") else "sdpa"

    def prepare_qat(self, model: torch.nn.Module) -> None:
        """Fake-quantise ``model``'s Linear layers in place for the ``qat`` group, if set."""
        qat = self.hparams.get("qat")
        if qat and qat["scheme"] != "none":
            from ..compress.qat import prepare_qat

            prepare_qat(model, qat)

    def apply_levers(self, compile_target: torch.nn.Module | None = None) -> None:
        """Activation checkpointing/offloading and compile (:mod:`.levers`); sets ``self.activation_offload`` (or None)."""
        self.activation_offload = apply_levers(
            self.model, self.hparams.get("activation_checkpointing"), self.hparams.get("compile"), compile_target
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No LR scheduler: the schedule callback sets the LR from the step count, the same way for every optimizer.
        trainer = self.attached_trainer()
        fused = trainer is None or lightning_allows_fused(trainer.precision, trainer.gradient_clip_val)
        ratio = (self.hparams.get("peft") or {}).get("loraplus_lr_ratio") if uses_peft(self.hparams.get("peft")) else None
        return build_optimizer(self.model, self.hparams.optimizer, self.device.type, fused_allowed=fused, loraplus_lr_ratio=ratio)

    # ------------------------------------------------------------------ loss normalisation
    def model_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Every task's loss contract: ``(loss_sum, items)``, summed loss (fp32 scalar) and item count (long scalar or int)."""
        raise NotImplementedError

    def loss_divisor(self) -> float:
        """Divides the summed loss before backward (undone before the step); near the per-item scale suits fp16 loss scaling."""
        raise NotImplementedError

    def on_train_start(self) -> None:
        self._loss_divisor = float(self.loss_divisor())
        self._window_loss, self._window_items, self._step_loss = None, 0, None

    def add_to_window(self, loss_sum: torch.Tensor, items: torch.Tensor | int) -> torch.Tensor | None:
        """Count one micro-batch; return the loss to backpropagate, or ``None`` after stepping here (step_in_backward)."""
        loss_sum_detached = loss_sum.detach()
        self._window_loss = loss_sum_detached if self._window_loss is None else self._window_loss + loss_sum_detached
        self._window_items = items if isinstance(self._window_items, int) and self._window_items == 0 else self._window_items + items
        if not self.automatic_optimization:
            # step_in_backward: no accumulation, one device, so normalise now (the update happens during backward).
            self.backward_and_step(loss_sum / items)
            return None
        # Lightning divides this by accumulate_grad_batches; on_before_optimizer_step undoes both and divides by the items.
        return loss_sum / self._loss_divisor

    def step_loss(self) -> torch.Tensor:
        """Mean loss per item of the optimizer step being taken (all micro-batches and devices), a 0-dim tensor."""
        if self._step_loss is None:
            if self._window_loss is None:  # cannot happen: Lightning steps after a training_step
                raise RuntimeError("an optimizer step before any micro-batch of it")
            loss, items = self._window_loss, self._window_items
            if self.trainer.world_size > 1:
                items = self.trainer.strategy.reduce(torch.as_tensor(items, dtype=torch.float32, device=self.device), reduce_op="sum")
                loss = self.trainer.strategy.reduce(loss, reduce_op="sum")
            elif isinstance(items, int):
                items = float(items)
            self._step_loss, self._step_items = loss / items, items
        return self._step_loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        loss = self.step_loss()
        items = float(self._step_items)  # (a host read when the count is a device tensor)
        if items <= 0:  # cannot happen with our data modules
            raise RuntimeError("an optimizer step with nothing to learn from: every label is -100")
        # DDP averages gradients over devices, hence the world-size factor.
        scale = self._loss_divisor * self.trainer.accumulate_grad_batches * self.trainer.world_size / items
        # (stepped in backward, the loss was normalised already; a scale of exactly 1 needs no pass over the gradients)
        if self.automatic_optimization and scale != 1.0:
            for parameter in self.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        self._row_step = self.trainer.global_step  # (the step this optimizer step's row is logged at)
        self._row_pending = True
        self.log_step_metric("train/loss", loss)
        self._window_loss, self._window_items, self._step_loss = None, 0, None

    def log_step_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Put a metric of the step being taken in :attr:`step_metrics` (a tensor stays on its device: no host sync).  Not
        ``self.log`` (slow per call), so not in ``trainer.callback_metrics``: :meth:`on_train_batch_end` sends the row."""
        if isinstance(value, (int, float)):
            self.step_metrics[name] = float(value)
            return
        value = torch.as_tensor(value, device=self.device)
        if value.requires_grad:
            value = value.detach()
        if value.dtype not in (torch.float32, torch.float64):
            value = value.to(torch.get_default_dtype())
        self.step_metrics[name] = value

    def step_row(self) -> tuple[int, dict[str, float]]:
        """``(step, metrics)``: the latest optimizer step's row, as Lightning numbers rows, plus ``epoch``; a host sync per metric."""
        return self._row_step, {**self.final_step_metrics(), "epoch": self.trainer.current_epoch}

    def sends_step_row(self) -> bool:
        """Whether the latest step's row goes to the loggers: every ``log_every_n_steps``-th step and the last (Lightning's pace)."""
        return (self._row_step + 1) % self.trainer.log_every_n_steps == 0 or self.trainer.should_stop

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """Send the step's row to the loggers after the callbacks' ``on_train_batch_end``, where Lightning sends its own."""
        if not self._row_pending:
            return
        self._row_pending = False
        if not self.sends_step_row() or not self.trainer.is_global_zero:
            return  # (Lightning's loggers write on the global-zero process only: no host syncs elsewhere)
        step, metrics = self.step_row()
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def final_step_metrics(self) -> dict[str, float]:
        """The latest step's :meth:`log_step_metric` values as numbers (for ``metrics.json``)."""
        return {name: value if isinstance(value, float) else value.item() for name, value in self.step_metrics.items()}

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """``step_in_backward``: backward updates the parameters, ``step()`` only counts; a non-finite loss is not
        backpropagated (the update would land before any check)."""
        if torch.isfinite(loss):
            self.manual_backward(loss)
        self.optimizers().step()

    # ----------------------------------------------------------------------- checkpoints
    def remember_fresh(self, model: torch.nn.Module, loading_info: dict) -> None:
        """Record the parameters ``from_pretrained`` drew at random: an adapter checkpoint saves them (a rebuild redraws them)."""
        missing = set(loading_info.get("missing_keys") or ())
        self.fresh_ids = {id(param) for name, param in model.named_parameters() if name in missing}

    def fresh_prefixes(self, prefix: str = "") -> set[str]:
        """State-dict prefixes of the modules holding a parameter drawn at random (:meth:`remember_fresh`)."""
        return {prefix + name.rsplit(".", 1)[0] + "." for name, param in self.named_parameters() if id(param) in self.fresh_ids}

    def state_dict(self, *args, **kwargs) -> dict:
        """The full state, or with LoRA/QLoRA only trained, randomly drawn and own state (a load re-reads the frozen base)."""
        state = super().state_dict(*args, **kwargs)
        if self.peft_method == "none" or self.model is None:
            return state
        prefix = kwargs.get("prefix", "")
        trained = {prefix + name for name, param in self.named_parameters() if param.requires_grad}
        fresh = tuple(self.fresh_prefixes(prefix))
        return {
            key: value
            for key, value in state.items()
            if key in trained or not key.startswith(prefix + "model.") or (fresh and key.startswith(fresh))
        }

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load a full state, or (LoRA/QLoRA) the state of :meth:`state_dict` onto the rebuilt base.

        Raises:
            RuntimeError: ``strict`` and the keys differ from what :meth:`state_dict` produces.
        """
        if self.peft_method == "none":
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        expected = set(self.state_dict())
        if strict and set(state_dict) != expected:
            missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            fresh = tuple(self.fresh_prefixes())
            drawn = [key for key in missing if fresh and key.startswith(fresh)]
            if drawn:
                raise RuntimeError(
                    f"the adapter checkpoint lacks {len(drawn)} weight(s) that the base model.name_or_path does not hold either, "
                    f"so this load would draw them at random and give other results at every load: {drawn[:5]}; "
                    "fix: retrain the adapters (checkpoints of this version save such weights), or a full fine-tune (peft=none)"
                )
            raise RuntimeError(f"adapter checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return type(result)([], result.unexpected_keys)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at_step = self.global_step  # train.py validates the final weights if this is not the last step

    def merged_model(self) -> torch.nn.Module:
        """A plain HF model with LoRA merged in; for QLoRA, call it on a module rebuilt unquantized (as export does)."""
        return self.model.merge_and_unload() if uses_peft(self.hparams.get("peft")) else self.model

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if "hyper_parameters" in checkpoint:  # the stored groups, with secrets masked (core/run/secrets.py)
            checkpoint["hyper_parameters"] = mask(dict(checkpoint["hyper_parameters"]))
        checkpoint["task"] = self.TASK_NAME  # which task's module reads it back (utils/checkpoints.load_trained_module)
        if self.initial_adapter:  # PiSSA/OLoRA: what rebuilds the residual base on a load
            checkpoint["initial_adapter"] = self.initial_adapter
        checkpoint["model_inputs"] = self.inputs.state_dict()
        checkpoint["skipped_steps"] = self.skipped_steps
        checkpoint["start_metrics"] = dict(self.start_metrics)
        for logger in self.loggers if self.attached_trainer() is not None else []:
            if isinstance(logger, WandbLogger) and logger.version:  # the run's id, once it exists (or the id resumed)
                checkpoint["wandb_run_id"] = logger.version  # a resume's W&B run names the run it continues

    def add_adapters(self, model: torch.nn.Module, targets: list[str] | str, task_type: str = "CAUSAL_LM", pretrained: bool = True):
        """``model`` with LoRA adapters; a fresh PiSSA/OLoRA start keeps :attr:`initial_adapter` to rebuild its residual base."""
        # (a stored HF config: the module of a checkpoint, whose load sets the weights)
        initialise = pretrained and not self.restores_weights and self.hparams.get("hf_config") is None
        model = wrap_with_lora(model, self.hparams.peft, targets, task_type=task_type, initialise=initialise)
        if initialise and rewrites_base(self.hparams.peft):
            self.initial_adapter = adapter_tensors(model)
        return model

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the module's own state; for PiSSA/OLoRA first the residual base, which the loaded weights then adapt.

        Raises:
            ConfigError: a PiSSA/OLoRA checkpoint without its initial adapter, or adapters initialised again otherwise.
        """
        initial = checkpoint.get("initial_adapter")
        if rewrites_base(self.hparams.get("peft")) and self.model is not None:
            if not initial:
                raise ConfigError(
                    f"the checkpoint was trained with peft.init_lora_weights={self.hparams.peft['init_lora_weights']} but holds "
                    "no initial adapter, without which its residual base weights cannot be rebuilt; fix: retrain with this version"
                )
            if self.initial_adapter is None:
                restore_residual(self.model, initial)
                self.initial_adapter = {name: tensor.cpu() for name, tensor in initial.items()}
            elif initial.keys() != self.initial_adapter.keys() or not all(
                torch.equal(self.initial_adapter[name].cpu(), tensor.cpu()) for name, tensor in initial.items()
            ):  # (built with PiSSA/OLoRA again: its base is not the original)
                raise ConfigError("internal: a PiSSA/OLoRA model was initialised before its checkpoint loaded (restores_weights unset)")
            # else the fit that wrote the checkpoint, in this process (its test of the best checkpoint): the base is its residual
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))
        self.start_metrics = {str(k): float(v) for k, v in checkpoint.get("start_metrics", {}).items()}
        if not self.knows_its_data:  # (a resumed fit keeps the data's)
            self.connect(ModelInputs.from_state_dict(checkpoint["model_inputs"]))
