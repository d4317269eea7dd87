"""Importance weights between the previous and the generation policy, and their truncation.

They read only the previous and the generation logprobs, so they reduce over the
mismatch mask (full ∧ keep(previous)). Token level: ``w = exp(prev - gen)``. GSPO:
``w_i = exp(Σ_t (prev - gen)·M)`` per sequence. NaN and ±inf weights become 0, as in
the framework. ``tis`` clamps to [min (default 0), max]; ``icepop`` zeroes weights
outside [min, max]; ``seq-mask-tis`` multiplies by the gate 1[min ≤ g_i ≤ max] with
``g_i = exp(mean over the mismatch mask of (prev - gen))``. Everything here is detached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.exact_sum import exact_sum
from steptally.client.loss.masks import Masks
from steptally.client.loss.ratio import sequence_log_ratio


@dataclass(frozen=True)
class Importance:
    """``weight`` [B, T] multiplies the loss (with IS correction on); ``value`` and ``oob``
    are the diagnostic values, per token [B, T] or per sequence [B] (``per_sequence``)."""

    weight: Tensor
    value: Tensor
    oob: Tensor | None
    per_sequence: bool
    oob_per_sequence: bool


def _finite_or_zero(weight: Tensor) -> Tensor:
    return torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)


def _truncate(config: ClippedPGConfig, weight: Tensor) -> tuple[Tensor, Tensor | None]:
    kind = config.truncated_importance_sampling_type
    if kind is None or kind == "seq-mask-tis":
        return weight, None
    high = float(config.truncated_importance_sampling_ratio or 0.0)
    low = float(config.truncated_importance_sampling_ratio_min or 0.0)
    oob = ((weight < low) | (weight > high)).to(weight.dtype)
    if kind == "tis":
        return weight.clamp(low, high), oob
    return torch.where((weight >= low) & (weight <= high), weight, 0.0), oob


def _sequence_gate(config: ClippedPGConfig, log_w: Tensor, masks: Masks) -> Tensor:
    high = float(config.truncated_importance_sampling_ratio or 0.0)
    low = float(config.truncated_importance_sampling_ratio_min or 0.0)
    gate = torch.exp(sequence_log_ratio(log_w, masks.mismatch))
    return (gate >= low) & (gate <= high)


def importance_weights(
    config: ClippedPGConfig, prev: Tensor, gen: Tensor, masks: Masks
) -> Importance:
    """The importance weights of one microbatch and their diagnostics."""
    log_w = torch.where(masks.mismatch, prev - gen, 0.0).detach()
    if config.gspo:
        total = exact_sum(log_w.to(torch.float64) * masks.mismatch_weight)
        weight, oob = _truncate(config, _finite_or_zero(torch.exp(total)))
        expanded = weight.to(prev.dtype)[:, None].expand_as(prev)
        return Importance(expanded, weight, oob, per_sequence=True, oob_per_sequence=True)
    weight = _finite_or_zero(torch.exp(log_w))
    if config.truncated_importance_sampling_type == "seq-mask-tis":
        kept = _sequence_gate(config, log_w, masks)
        gated = torch.where(kept[:, None], weight, 0.0)
        oob = (~kept).to(torch.float64)
        return Importance(gated, gated, oob, per_sequence=False, oob_per_sequence=True)
    weight, oob = _truncate(config, weight)
    return Importance(weight, weight, oob, per_sequence=False, oob_per_sequence=False)
