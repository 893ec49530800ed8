"""NEFTune: uniform noise on the input embeddings while training (Jain et al., "NEFTune: Noisy
Embeddings Improve Instruction Finetuning", ICLR 2024, arXiv:2310.05914, Algorithm 1).

Each training forward adds ``eps * alpha / sqrt(L * d)`` to the embedding output (``eps ~ Uniform(-1, 1)`` per element,
``d`` the embedding width). ``L`` is each row's own length (the paper's is that of its one-row batches), so a row
packed or beside a longer one gets the noise it would alone; padding gets none, and so does all but training."""

from __future__ import annotations

import lightning as L
import torch
from omegaconf import DictConfig


def neftune_problems(cfg: DictConfig) -> list[str]:
    """``callbacks=neftune``: a positive alpha, and no compiled model (one line each: field, value, fix)."""
    neftune = (cfg.get("callbacks") or {}).get("neftune")
    if neftune is None:
        return []
    problems = []
    alpha = neftune.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        problems.append(
            f"callbacks.neftune.alpha={alpha!r} must be a positive number (the paper's 5, 10, 15); fix: callbacks.neftune.alpha=5"
        )
    if "compile" in cfg and str(cfg.compile.mode) != "off":
        problems.append(
            f"callbacks=neftune with compile={cfg.compile.mode}: the noise hook changes its scale every batch inside the "
            "compiled graph (recompiles, untested); fix: compile=off"
        )
    return problems


def row_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per token, the length ``L`` of its row in tokens, ``(B, T)`` float32, 0 on padding: from ``position_ids`` (each run
    from 0 a row; trailing padding is one too, attended by no row), else ``attention_mask`` ``(B, T)``, else ``T``."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        starts = batch["position_ids"] == 0
        run = starts.long().cumsum(dim=1) - 1  # (B, T) index of each token's run in its block
        counts = torch.zeros_like(run).scatter_add_(1, run.clamp(min=0), torch.ones_like(run))
        return counts.gather(1, run.clamp(min=0)).float()
    if "attention_mask" in batch:
        mask = batch["attention_mask"]
        return mask.sum(dim=1, keepdim=True).float() * (mask > 0)
    return torch.full(ids.shape, float(ids.shape[1]), device=ids.device)


class NEFTune(L.Callback):
    """Add NEFTune noise to the model's input-embedding output in training steps.

    Raises:
        ValueError: ``alpha`` (the paper uses 5, 10, 15) is not a positive number.
    """

    def __init__(self, alpha: float = 5.0) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(
                f"callbacks.neftune.alpha={alpha!r} must be a positive number (the paper's 5, 10, 15); fix: callbacks.neftune.alpha=5"
            )
        self.alpha = float(alpha)
        self._scale: torch.Tensor | None = None  # (B, T, 1) of the running training batch
        self._handle = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        embedding = pl_module.model.get_input_embeddings()
        self._handle = embedding.register_forward_hook(self._add_noise)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int) -> None:
        width = pl_module.model.get_input_embeddings().embedding_dim
        lengths = row_lengths(batch)
        self._scale = torch.where(lengths > 0, self.alpha / torch.sqrt(lengths.clamp(min=1) * width), 0.0).unsqueeze(-1)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: dict, batch_idx: int) -> None:
        self._scale = None

    def _add_noise(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or self._scale is None or self._scale.shape[:2] != output.shape[:2]:
            return None  # eval, generation, or a forward that is not the batch's (the output unchanged)
        noise = torch.empty_like(output).uniform_(-1.0, 1.0)
        return output + noise * self._scale.to(output.dtype)
