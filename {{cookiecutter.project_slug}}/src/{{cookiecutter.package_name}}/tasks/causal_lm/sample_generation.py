"""Generate from fixed prompts during training: the quickest sanity check of a language model."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

log = logging.getLogger(__name__)


class SampleGeneration(L.Callback):
    """Every ``every_n_steps`` optimizer steps (0: none) and after the last, complete each prompt with the module's
    ``generate_text`` and append the text to ``output_file`` (default ``<run>/samples.txt``) and a W&B ``samples``
    table. Greedy unless ``do_sample``, so samples compare across steps.

    Raises:
        ValueError: ``prompts`` is empty, ``every_n_steps`` < 0 or ``max_new_tokens`` < 1.
    """

    def __init__(
        self,
        prompts: list[str],
        every_n_steps: int = 100,
        max_new_tokens: int = 48,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        output_file: str | None = None,
    ) -> None:
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"callbacks.sample_generation.prompts={prompts!r} must be a non-empty list of non-empty strings")
        if every_n_steps < 0 or max_new_tokens < 1:
            raise ValueError(
                f"callbacks.sample_generation: every_n_steps={every_n_steps} must be >= 0 and max_new_tokens={max_new_tokens} >= 1"
            )
        self.prompts, self.every_n_steps = list(prompts), every_n_steps
        self.generation = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
        if do_sample:
            self.generation.update(temperature=temperature, top_p=top_p)
        self.output_file = output_file
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.generate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.generate(trainer, pl_module)

    def generate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Generate now (all ranks run the model; rank 0 writes); return the completions.  A
        failure is a warning, never the end of the run (``[]`` returned); out of memory is raised."""
        self._last_step = trainer.global_step
        # On a fork of the RNG, so sampling does not shift the training stream (a resume must draw the same masks).
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                completions = pl_module.generate_text(self.prompts, **self.generation)
        except Exception as error:  # a sanity check must never cost the run its results
            if isinstance(error, torch.OutOfMemoryError):
                raise  # (the out-of-memory guard reports it, with a checkpoint)
            rank_zero_warn(
                f"callbacks.sample_generation failed at step {trainer.global_step} and is skipped: {type(error).__name__}: {error}"
            )
            return []
        self._write(trainer, completions, chat=bool(getattr(pl_module, "chat", False)))
        return completions

    @rank_zero_only
    def _write(self, trainer: L.Trainer, completions: list[str], chat: bool) -> None:
        step = trainer.global_step
        path = Path(self.output_file or Path(trainer.default_root_dir) / "samples.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            for prompt, completion in zip(self.prompts, completions):
                # A chat model answers the prompt (a user turn); a text model continues it.
                text = f"{prompt}\n--- answer:\n{completion}" if chat else f"{prompt}{completion}"
                file.write(f"=== step {step} | prompt: {prompt!r}\n{text}\n\n")
        log.info("Samples at step %d written to %s", step, path)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text(
                    key="samples",
                    columns=["step", "prompt", "completion"],
                    data=[[step, p, c] for p, c in zip(self.prompts, completions)],
                    step=step,
                )
