"""KL estimators and the reference-policy KL penalty.

``logr = ref - curr`` (the framework's ``logprobs_reference - logprobs``):
k1 = -logr, k2 = logr²/2, k3 = e^logr - 1 - logr. The penalty reduces over the
original full mask and reads ``curr_logprobs_unfiltered``, which is finite where
filtering put a -inf into the current logprobs: those terms are real, so they stay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig


def kl_estimate(log_ratio: Tensor, kind: str) -> Tensor:
    """The k1/k2/k3 estimator of a KL from ``log_ratio`` = log(q/p) at samples of p."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return torch.square(log_ratio) / 2
    return torch.exp(log_ratio) - 1 - log_ratio


def _clamp(value: Tensor, bound: float | None) -> Tensor:
    return value if bound is None else value.clamp(-bound, bound)


def reference_kl(
    config: ClippedPGConfig, curr_unfiltered: Tensor, reference: Tensor, gen: Tensor, full: Tensor
) -> Tensor:
    """The per-token KL penalty term without β (0 outside the full mask)."""
    curr = torch.where(full, curr_unfiltered, 0.0)
    log_ratio = _clamp(torch.where(full, reference - curr, 0.0), config.kl_input_clamp_value)
    estimate = kl_estimate(log_ratio, config.reference_policy_kl_type)
    if config.use_on_policy_kl_approximation:
        weight = torch.exp(torch.where(full, curr - gen, 0.0))
    else:
        weight = torch.exp(curr - curr.detach())
    kl = _clamp(weight * estimate, config.kl_output_clamp_value)
    return torch.where(full, kl, 0.0)
