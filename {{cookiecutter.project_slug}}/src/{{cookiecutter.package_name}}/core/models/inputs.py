"""What a task module is told about its data and its run, in one described object.

A module never reads the trainer's data module: it is handed a :class:`ModelInputs`
(``module.connect``).  ``train`` and ``plan`` build the module with the config's facts
(:meth:`ModelInputs.before_data`: precision, ``max_length``, per-process micro-batch), and
:class:`ConnectData` hands it the data's (tokenizer, labels, end-of-turn token) once the data
module is set up, before the model is built.  The module builds its model and normalises its loss
from them, saves them in every checkpoint (``checkpoint["model_inputs"]``), and
eval/predict/generate/export read them back from there, with nothing but the checkpoint.
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
        tokenizer: the data's tokenizer (the model's ``vocab_size`` and special token ids follow
            it); ``None`` before the data is read (:meth:`before_data`).
        max_length: the longest row, in tokens (``data.max_length``); ``None`` unknown.
        micro_batch_size: rows per forward/backward pass of one process (the per-process
            micro-batch the ``batch`` group derives; DDP: the global batch's share of one device).
        precision: Lightning's precision flag the model is trained under (``bf16-mixed``, ...).
        id2label: class index -> label name (classification); ``None`` for a causal LM.
        end_of_turn: chat data (:mod:`...tasks.causal_lm.chat`): the token closing assistant turns, where
            generation stops; ``None`` for raw text (and classification).
        system_prompt: chat data: the system turn set on every row (``data.system_prompt``).
        task_facts: what else a task's data tells its module, in plain JSON types, that the
            framework does not read (token classification: the tag scheme its metrics parse);
            ``None`` for a task that has none.
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
        """The facts the config gives before any data is read (``train`` and ``plan`` hand them to
        the module at construction, :func:`...tasks.build_module`): the module's spec checks run
        on them before the data is tokenised; ``tokenizer`` stays ``None`` until
        :class:`ConnectData` hands over the data's."""
        return cls(tokenizer=None, max_length=max_length, micro_batch_size=micro_batch_size, precision=precision)

    @classmethod
    def of(cls, datamodule: L.LightningDataModule, precision: str) -> ModelInputs:
        """The facts of a set-up data module (a :class:`..data.batching.TokenizedDataModule`: the
        attributes it declares) under Lightning's ``precision`` flag."""
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
        # Imported here: the builder brings transformers' model classes and, through them, torchao,
        # whose import logs warnings; train imports this module before Hydra has set up logging.
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
    """Hands a task module the facts of its data once the data module is set up: Lightning
    calls the data module's ``setup``, then the callbacks' (this one), then the module's, and
    ``configure_model`` after them.  ``train`` and ``eval`` (an exported folder) put it first in
    their trainer's callbacks; a module that already has its data facts (loaded from a
    checkpoint) is left as it is.

    Why not before ``fit``: the data facts (the tokenizer, the classifier's labels) exist once
    ``prepare_data`` has installed the files (on one process per node) and ``setup`` has read
    them (on every process), in Lightning's order; reading them earlier would run the downloads
    on every DDP/SLURM rank at once.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.datamodule is not None and not pl_module.knows_its_data:  # (an HFModule)
            pl_module.connect(ModelInputs.of(trainer.datamodule, str(trainer.precision)))


def chat_end_of_turn(datamodule: L.LightningDataModule) -> str | None:
    """The end-of-turn token of a chat data module (set up), ``None`` for any other data."""
    return None if datamodule.eot_id is None else datamodule.tokenizer.convert_ids_to_tokens(datamodule.eot_id)
