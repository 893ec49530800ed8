"""GRPO's objective on sampled completions (Shao et al. 2024, "DeepSeekMath", sec. 4.1): each prompt's ``G`` completions form
a group; a completion's advantage is its reward minus the group's mean (divided by the group's std unless ``scale_rewards``
is false, as Dr. GRPO proposes: Liu et al. 2025, "Understanding R1-Zero-Like Training"); every completion token takes the
PPO clipped surrogate of that advantage (Schulman et al. 2017) with DAPO's optional wider upper clip (Yu et al. 2025), plus
``beta`` times the k3 estimate of the KL to the reference, ``exp(r - p) - (r - p) - 1`` (Schulman 2020, "Approximating KL
divergence"; the paper's eq. 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# How per-token losses become the batch's loss: "sequence" (the paper: mean over each completion's tokens, then over
# completions), "token" (DAPO: mean over every completion token of the batch), "constant" (Dr. GRPO: the token sum divided
# by max_completion_length, then the mean over completions: no length bias).
AGGREGATIONS = ("sequence", "token", "constant")


@dataclass(frozen=True)
class GRPOSettings:
    """The ``grpo`` group (configs/grpo/), declared by this task: its keys are these fields."""

    num_generations: int = 8  # G: completions sampled per prompt (>= 2: the advantage compares them)
    temperature: float = 1.0  # sampling temperature; the log-probs are of the same tempered distribution
    epsilon: float = 0.2  # the PPO clip: ratios outside [1 - epsilon, 1 + epsilon_high] pass no gradient
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher: 0.28)
    beta: float = 0.0  # the KL coefficient (0: no reference pass); the reference is the model with its adapters off
    loss_aggregation: str = "sequence"  # one of AGGREGATIONS
    scale_rewards: bool = True  # divide advantages by the group's reward std (false: Dr. GRPO)
    seed: int = 0  # the sampling seed: a micro-batch's samples are a function of (seed, step, micro-batch, rank)


@dataclass
class GRPOTerms:
    """A micro-batch's summed loss and its item count (completions, or tokens for ``token``), the share of scored tokens the
    clip stopped, and the mean k3 KL per token (0 without a reference); 0-dim tensors."""

    loss_sum: torch.Tensor
    items: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """``(N,)`` advantages of ``(N,)`` rewards, ``N = prompts x group`` (each prompt's completions consecutive): the reward
    minus its group's mean, divided by the group's std (unbiased, + 1e-4) when ``scale``. A group whose rewards are all
    equal has advantage 0: it passes no gradient."""
    grouped = rewards.float().view(-1, group)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return centred.flatten()


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    reference_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOSettings,
    max_completion_length: int,
) -> GRPOTerms:
    """The loss of ``N`` completions from per-token log-probs ``(N, C)`` (nats) of the policy, the policy that sampled them
    (``old_logps``; one update per sample, as here: ``logps.detach()``, ratio 1) and the reference (``None``: no KL term),
    ``(N,)`` advantages and ``(N, C)`` mask (1: a completion token, its end token included)."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    low, high = 1 - settings.epsilon, 1 + (settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon)
    advantage = advantages[:, None].to(logps.dtype)  # (N, 1)
    per_token = -torch.min(ratio * advantage, ratio.clamp(low, high) * advantage)  # (N, C)
    clipped = ((ratio < low) & (advantage < 0)) | ((ratio > high) & (advantage > 0))
    tokens = mask.sum()
    kl = logps.new_zeros(())
    if reference_logps is not None and settings.beta > 0:
        delta = reference_logps - logps
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + settings.beta * per_token_kl
        kl = (per_token_kl * mask).sum().detach() / tokens.clamp(min=1)
    summed = per_token * mask
    rows = torch.tensor(logps.shape[0], device=logps.device)
    if settings.loss_aggregation == "sequence":
        loss_sum, items = (summed.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), rows
    elif settings.loss_aggregation == "token":
        loss_sum, items = summed.sum(), tokens
    else:  # constant
        loss_sum, items = summed.sum() / max_completion_length, rows
    return GRPOTerms(loss_sum, items, (clipped.to(mask.dtype) * mask).sum() / tokens.clamp(min=1), kl)


def step_seed(seed: int, stage: int, rank: int, step: int, micro_batch: int) -> int:
    """The sampling seed of one micro-batch: a function of the run's ``seed``, the stage (0 train, 1 validation, 2 test),
    the process's ``rank``, the optimizer ``step`` and the micro-batch's place in it; so a resumed run samples what the
    uninterrupted one did, with no generator state to save."""
    return ((((seed * 3 + stage) * 1_000_003 + rank) * 1_000_003 + step) * 10_007 + micro_batch) % 2**63
