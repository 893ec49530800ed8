"""What a task module is told about its data and run (:class:`ModelInputs`), handed over by ``module.connect``.

``train``/``plan`` give the config's facts at construction (:meth:`ModelInputs.before_data`), :class:`ConnectData` the
data's once it is set up; the module saves them in every checkpoint, so eval/predict/generate/export need only that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
from transformers import PreTrainedTokenizerBase

from .precision import compute_dtype


@dataclass
class ModelInputs:
    """The facts of the data and the run a task module builds and trains from.

    Attributes:
        tokenizer: the data's (the model's ``vocab_size`` and special ids follow it); ``None`` before the data is read.
        max_length: the longest row, in tokens; ``None`` unknown.
        micro_batch_size: rows per forward/backward pass of one process.
        precision: Lightning's precision flag (``bf16-mixed``, ...).
        end_of_turn: chat data: the token closing assistant turns, where generation stops.
        task_facts: a task's own data facts in JSON types, unread by the framework (token classification's tag scheme).
    """

    tokenizer: PreTrainedTokenizerBase | None
    max_length: int | None
    micro_batch_size: int
    precision: str = "32-true"
    id2label: dict[int, str] | None = None
    end_of_turn: str | None = None
    system_prompt: str | None = None
    task_facts: dict | None = None
    _files: dict[str, str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def before_data(cls, precision: str, max_length: int | None, micro_batch_size: int) -> ModelInputs:
        """The config's facts before any data is read, for the spec checks (``tokenizer`` ``None`` until :class:`ConnectData`)."""
        return cls(tokenizer=None, max_length=max_length, micro_batch_size=micro_batch_size, precision=precision)

    @classmethod
    def of(cls, datamodule: L.LightningDataModule, precision: str) -> ModelInputs:
        """The facts of a set-up data module (the attributes :class:`..data.batching.TokenizedDataModule` declares)."""
        return cls(
            tokenizer=datamodule.tokenizer,
            max_length=datamodule.max_length,
            micro_batch_size=datamodule.batch_size,
            precision=precision,
            id2label=datamodule.id2label,
            end_of_turn=chat_end_of_turn(datamodule),
            system_prompt=datamodule.system_prompt,
            task_facts=datamodule.task_facts,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The matmul dtype of :attr:`precision` (see :mod:`.precision`)."""
        return compute_dtype(self.precision)

    @property
    def label2id(self) -> dict[str, int]:
        """Label name -> class index (classification)."""
        return {name: index for index, name in (self.id2label or {}).items()}

    def state_dict(self) -> dict:
        """Plain JSON types (a ``weights_only`` checkpoint holds them): the tokenizer as its files' text."""
        if self._files is None:
            from .builder import tokenizer_to_files  # (see from_state_dict)

            self._files = tokenizer_to_files(self.tokenizer)
        return {
            "tokenizer_files": self._files,
            "max_length": self.max_length,
            "micro_batch_size": self.micro_batch_size,
            "precision": self.precision,
            "id2label": None if self.id2label is None else {int(k): v for k, v in self.id2label.items()},
            "end_of_turn": self.end_of_turn,
            "system_prompt": self.system_prompt,
            "task_facts": self.task_facts,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> ModelInputs:
        """Inverse of :meth:`state_dict`."""
        # Imported here: the builder brings in torchao, whose import logs warnings before Hydra has set up logging.
        from .builder import tokenizer_from_files

        id2label = state.get("id2label")
        return cls(
            tokenizer=tokenizer_from_files(state["tokenizer_files"]),
            max_length=state.get("max_length"),
            micro_batch_size=int(state.get("micro_batch_size") or 1),
            precision=str(state.get("precision", "32-true")),
            id2label=None if id2label is None else {int(k): v for k, v in id2label.items()},
            end_of_turn=state.get("end_of_turn"),
            system_prompt=state.get("system_prompt"),
            task_facts=state.get("task_facts"),
            _files=state["tokenizer_files"],
        )


class ConnectData(L.Callback):
    """Hands a module its data's facts in ``setup`` (after the data module's, before ``configure_model``).  Not before
    ``fit``: the facts exist once ``prepare_data`` ran (one process per node); earlier, every rank would download.  The
    data module's ``task_objects`` (objects, not facts: GRPO's reward functions) are handed over on every run, a loaded
    checkpoint's too: they come from this run's config, never from a checkpoint."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.datamodule is not None and not pl_module.knows_its_data:  # (an HFModule)
            pl_module.connect(ModelInputs.of(trainer.datamodule, str(trainer.precision)))
        if trainer.datamodule is not None and getattr(trainer.datamodule, "task_objects", None):
            pl_module.task_objects = dict(trainer.datamodule.task_objects)


def chat_end_of_turn(datamodule: L.LightningDataModule) -> str | None:
    """The end-of-turn token of a set-up chat data module, else ``None``."""
    return None if datamodule.eot_id is None else datamodule.tokenizer.convert_ids_to_tokens(datamodule.eot_id)
