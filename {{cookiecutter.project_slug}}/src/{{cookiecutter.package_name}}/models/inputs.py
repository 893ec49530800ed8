"""What a task module is told about its data and its run, in one described object.

A module does not read the trainer's data module or precision itself: :func:`model_inputs` reads
them once (when Lightning sets the module up, the data set up before it) into a
:class:`ModelInputs`; the module builds its model and normalises its loss from that, saves it in
every checkpoint (``checkpoint["model_inputs"]``), and eval/predict/generate/export read it back
from there, with nothing but the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
from transformers import PreTrainedTokenizerBase

from .builder import tokenizer_from_files, tokenizer_to_files
from .precision import compute_dtype


@dataclass
class ModelInputs:
    """The facts of the data and the run a task module builds and trains from.

    Attributes:
        tokenizer: the data's tokenizer (the model's ``vocab_size`` and special token ids follow it).
        max_length: the longest row, in tokens (``data.max_length``); ``None`` unknown.
        micro_batch_size: rows per forward/backward pass of one process (the per-process
            micro-batch the ``batch`` group derives; DDP: the global batch's share of one device).
        precision: Lightning's precision flag the model is trained under (``bf16-mixed``, ...).
        id2label: class index -> label name (classification); ``None`` for a causal LM.
        end_of_turn: chat data (:mod:`..tasks.causal_lm.chat`): the token closing assistant turns, where
            generation stops; ``None`` for raw text (and classification).
        system_prompt: chat data: the system turn set on every row (``data.system_prompt``).
    """

    tokenizer: PreTrainedTokenizerBase
    max_length: int | None
    micro_batch_size: int
    precision: str = "32-true"
    id2label: dict[int, str] | None = None
    end_of_turn: str | None = None
    system_prompt: str | None = None
    _files: dict[str, str] | None = field(default=None, repr=False, compare=False)

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
            self._files = tokenizer_to_files(self.tokenizer)
        return {
            "tokenizer_files": self._files,
            "max_length": self.max_length,
            "micro_batch_size": self.micro_batch_size,
            "precision": self.precision,
            "id2label": None if self.id2label is None else {int(k): v for k, v in self.id2label.items()},
            "end_of_turn": self.end_of_turn,
            "system_prompt": self.system_prompt,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> ModelInputs:
        """Inverse of :meth:`state_dict`."""
        id2label = state.get("id2label")
        return cls(
            tokenizer=tokenizer_from_files(state["tokenizer_files"]),
            max_length=state.get("max_length"),
            micro_batch_size=int(state.get("micro_batch_size") or 1),
            precision=str(state.get("precision", "32-true")),
            id2label=None if id2label is None else {int(k): v for k, v in id2label.items()},
            end_of_turn=state.get("end_of_turn"),
            system_prompt=state.get("system_prompt"),
            _files=state["tokenizer_files"],
        )


def model_inputs(trainer: L.Trainer) -> ModelInputs | None:
    """The :class:`ModelInputs` of a run: the trainer's data module (set up: its tokenizer and,
    for classification, its labels) and precision.  ``None`` when fit on bare data loaders (no
    data module).  The one place a module reads them."""
    datamodule = trainer.datamodule
    if datamodule is None:
        return None
    return ModelInputs(
        tokenizer=datamodule.tokenizer,
        max_length=datamodule.max_length,
        micro_batch_size=datamodule.batch_size,
        precision=str(trainer.precision),
        id2label=datamodule.id2label,
        end_of_turn=chat_end_of_turn(datamodule),
        system_prompt=datamodule.system_prompt,
    )


def chat_end_of_turn(datamodule: L.LightningDataModule) -> str | None:
    """The end-of-turn token of a chat data module (set up), ``None`` for any other data."""
    return None if datamodule.eot_id is None else datamodule.tokenizer.convert_ids_to_tokens(datamodule.eot_id)
