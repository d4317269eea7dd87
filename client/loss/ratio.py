"""The probability ratio, its clamp, and the clipped surrogate it enters.

Every difference is masked with ``torch.where`` before ``exp``, so a position outside
the actor mask computes ``exp(0)`` and neither overflows nor feeds a NaN into the
backward pass; its gradient is exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.exact_sum import exact_sum


@dataclass(frozen=True)
class Ratios:
    """``r`` and ``r_c`` per token (under GSPO, each sequence's ratio repeated)."""

    ratio: Tensor
    clamped: Tensor


def safe_divisor(count: Tensor) -> Tensor:
    """``count`` with zeros replaced by 1: an empty mask divides a zero numerator."""
    return torch.where(count > 0, count, 1.0)


def sequence_log_ratio(diff: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean of ``diff`` over ``mask`` (float64 ``[B]``; 0 for an empty row)."""
    return exact_sum(diff) / safe_divisor(exact_sum(mask.to(torch.float64)))


def probs_ratios(config: ClippedPGConfig, curr: Tensor, prev: Tensor, actor: Tensor) -> Ratios:
    """``r`` and ``r_c`` from filled current and previous logprobs over the actor mask."""
    if config.disable_ppo_ratio:
        ratio = torch.where(actor, curr, 0.0)
        return Ratios(ratio, ratio)
    diff = torch.where(actor, curr - prev, 0.0)
    if config.gspo:
        mean = sequence_log_ratio(diff, actor).to(curr.dtype)
        ratio = torch.exp(mean)[:, None].expand_as(curr)
    else:
        ratio = torch.exp(diff)
    clamped = ratio.clamp(1.0 - config.ratio_clip_min, 1.0 + config.ratio_clip_max)
    return Ratios(ratio, clamped)


def surrogate(
    config: ClippedPGConfig, advantages: Tensor, curr: Tensor, ratios: Ratios, actor: Tensor
) -> Tensor:
    """The per-token surrogate ℓ (0 outside the actor mask)."""
    adv = torch.where(actor, advantages, 0.0)
    if config.use_cispo:
        loss = -adv * ratios.clamped.detach() * curr
    else:
        loss = torch.maximum(-adv * ratios.ratio, -adv * ratios.clamped)
    if config.ratio_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * config.ratio_clip_c), loss)
    return torch.where(actor, loss, 0.0)
