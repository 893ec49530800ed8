"""Preference objectives on per-sequence log-probabilities: DPO, ORPO, SimPO on pairs, KTO on unpaired answers.

Each takes summed completion log-probs (:func:`completion_logps`) and returns a :class:`PairTerms`: for pairs, ``w`` is the
chosen completion, ``l`` the rejected one, ``x`` the prompt, as in the papers; for KTO, ``P`` answers each marked desirable or
not, and ``P`` mismatched answers (another row's answer to this row's prompt) for the KL estimate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...core.data.tokenization import IGNORE_INDEX

# The objectives that compare the policy with a reference model (the others need none).
NEEDS_REFERENCE = ("dpo", "kto")
OBJECTIVES = ("dpo", "orpo", "simpo", "kto")
UNPAIRED = ("kto",)  # the objectives trained on unpaired answers (data=unpaired)


@dataclass(frozen=True)
class Objective:
    """The ``objective`` group (configs/objective/), declared by this task: its keys are these
    fields (the config check binds the group to this signature)."""

    name: str  # dpo | orpo | simpo | kto
    beta: float
    label_smoothing: float = 0.0  # DPO only
    gamma: float = 0.0  # SimPO only
    desirable_weight: float = 1.0  # KTO only (lambda_D)
    undesirable_weight: float = 1.0  # KTO only (lambda_U)


@dataclass
class PairTerms:
    """Per-pair ``(P,)`` float32 values: the loss and each side's reward (``reward_chosen > reward_rejected``: ranked right)."""

    loss: torch.Tensor
    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor


@dataclass
class AnswerTerms:
    """Per-answer ``(P,)`` float32 values of KTO: the loss, the reward, and the micro-batch's KL estimate ``z0`` (a 0-dim tensor)."""

    loss: torch.Tensor
    reward: torch.Tensor
    kl: torch.Tensor


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps, n_tokens)``: each row's summed log-probability of its scored tokens, ``(N,)`` float32, and their count,
    ``(N,)`` int64, from ``logits`` ``(N, T, V)`` (position ``t`` predicts ``t + 1``) and ``labels`` ``(N, T)`` (-100: not scored)."""
    # Shift the labels left as causal_lm's token_loss_sum does; the last position has no next token (-100).
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (N, T)
    scored = targets != IGNORE_INDEX
    # cross_entropy is -log p of the target; ignored positions give 0.
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view_as(targets).sum(dim=1), scored.sum(dim=1)


def completion_logps_from_hidden(
    hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, scored_from: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_logps` from the last hidden states ``(N, T, D)``, the lm_head (``D -> V``) applied to the scored
    positions only (no logits for prompt and padding, about half a pair's tokens). ``scored_from``: every row scores
    positions ``scored_from .. T-2`` (the planner's example batch), sliced so its fake-tensor trace has static shapes."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (N, T), shifted as in completion_logps
    if scored_from is not None:
        logits = lm_head(hidden[:, scored_from:-1])  # (N, S, V)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets[:, scored_from:-1].flatten(), reduction="none")
        return -nll.view(hidden.shape[0], -1).sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)
    rows, positions = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # (n,) each
    logits = lm_head(hidden[rows, positions])  # (n, V)
    token_logps = -F.cross_entropy(logits.float(), targets[rows, positions], reduction="none")  # (n,)
    logps = torch.zeros(labels.shape[0], dtype=token_logps.dtype, device=token_logps.device).index_add(0, rows, token_logps)
    return logps, torch.bincount(rows, minlength=labels.shape[0])


def dpo(
    logp_w: torch.Tensor, logp_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor, beta: float, label_smoothing: float
) -> PairTerms:
    """DPO, sigmoid loss (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model", eq. 7), with the conservative label smoothing ``eps`` of Mitchell (2023, "A note on DPO with noisy preferences"):

        r(y) = beta * (log pi(y|x) - log pi_ref(y|x))          (the implicit reward, sec. 5)
        L    = -(1 - eps) * log sigmoid(r(y_w) - r(y_l)) - eps * log sigmoid(r(y_l) - r(y_w))

    ``logp_*``: ``(P,)`` summed completion log-probs of the policy; ``ref_*`` of the reference."""
    reward_w, reward_l = beta * (logp_w - ref_w), beta * (logp_l - ref_l)
    margin = reward_w - reward_l
    loss = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return PairTerms(loss, reward_w.detach(), reward_l.detach())


def simpo(logp_w: torch.Tensor, logp_l: torch.Tensor, n_w: torch.Tensor, n_l: torch.Tensor, beta: float, gamma: float) -> PairTerms:
    """SimPO (Meng, Xia and Chen, 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6):
    a length-normalised reward, the chosen side winning by ``gamma``; ``n_*``: ``(P,)`` completion tokens (``|y|``).

        r(y) = beta / |y| * log pi(y|x)
        L    = -log sigmoid(r(y_w) - r(y_l) - gamma)
    """
    reward_w, reward_l = beta * logp_w / n_w, beta * logp_l / n_l
    loss = -F.logsigmoid(reward_w - reward_l - gamma)
    return PairTerms(loss, reward_w.detach(), reward_l.detach())


def orpo(logp_w: torch.Tensor, logp_l: torch.Tensor, n_w: torch.Tensor, n_l: torch.Tensor, beta: float) -> PairTerms:
    """ORPO (Hong, Lee and Thorne, 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 4-7),
    the paper's lambda as ``beta``; the rewards are ``beta * log P``, as TRL's ORPO trainer reports them:

        P(y|x)    = exp(log pi(y|x) / |y|)                      (length-normalised likelihood)
        odds(y|x) = P / (1 - P);  log odds = log P - log(1 - P)
        L         = -log pi(y_w|x) / |y_w| + beta * -log sigmoid(log odds(y_w|x) - log odds(y_l|x))
    """
    mean_w, mean_l = logp_w / n_w, logp_l / n_l  # log P, each < 0
    # log(1 - P) = log(1 - exp(log P)) = log1p(-exp(log P)); clamped away from P = 1 (log 0).
    log_odds = (mean_w - torch.log1p(-torch.exp(mean_w).clamp(max=1 - 1e-6))) - (
        mean_l - torch.log1p(-torch.exp(mean_l).clamp(max=1 - 1e-6))
    )
    loss = -mean_w - beta * F.logsigmoid(log_odds)
    return PairTerms(loss, (beta * mean_w).detach(), (beta * mean_l).detach())


def kto(
    logp: torch.Tensor,
    ref: torch.Tensor,
    logp_kl: torch.Tensor,
    ref_kl: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> AnswerTerms:
    """KTO (Ethayarajh et al., 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8): each answer alone,
    desirable or not, against a reference point ``z0``, the policy's KL from the reference estimated on mismatched answers
    (``y'``: another row's answer to this prompt) as in sec. 4.1, clamped at 0 and not differentiated:

        r(x, y) = log pi(y|x) - log pi_ref(y|x)                 (reward: beta * r)
        z0      = max(0, mean over the micro-batch of log pi(y'|x) - log pi_ref(y'|x))
        v(x, y) = lambda_D * sigmoid(beta * (r - z0))  if desirable,  lambda_U * sigmoid(beta * (z0 - r))  if not
        L       = lambda_y - v(x, y)

    ``logp``, ``ref``: ``(P,)`` summed log-probs of the answers, policy and reference; ``logp_kl``, ``ref_kl`` ``(P,)`` of the
    mismatched answers; ``desirable`` ``(P,)`` bool. The estimate is over one micro-batch (TRL's over the whole batch)."""
    ratio = logp - ref
    z0 = (logp_kl - ref_kl).mean().clamp(min=0).detach()
    weight = torch.where(desirable, desirable_weight, undesirable_weight)
    value = torch.where(desirable, torch.sigmoid(beta * (ratio - z0)), torch.sigmoid(beta * (z0 - ratio)))
    return AnswerTerms(weight * (1 - value), (beta * ratio).detach(), z0)
