"""Keep masks and the three masks the loss reduces over.

``token_mask`` is never narrowed. From it and the keep masks of both policies:

- ``full``: token_mask ∧ sample_mask > 0. The reference KL and the normalisers read it.
- ``actor``: full ∧ keep(current) ∧ keep(previous). Everything derived from the current
  logprobs reads it: actor loss, ratio and clamped ratio with their extrema, entropy
  approximation, GSPO sequence ratio, NLL.
- ``mismatch``: full ∧ keep(previous). The diagnostics that read only the previous and
  the generation logprobs (and the importance weights built from them) read it.

Under ``force_on_policy_ratio`` the previous policy *is* the current one, so its keep
mask is the current one and no substituted value reaches a diagnostic or a weight.
Each mask has a float64 weight twin (``token_mask · sample_mask`` restricted to it), so
fractional sample masks weigh tokens exactly as the framework's ``M`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(filled, keep)``: keep = mask ∧ logprob ≠ -inf; filled is 0.0 wherever not kept.

    Written with ``torch.where`` (never a multiply), so a -inf never meets a 0 and the
    gradient at a position that is not kept is exactly 0. Only -inf (the signature of
    top-k/top-p filtering) is filtered: a NaN or +inf is kept as data, so it shows.
    """
    keep = mask.to(torch.bool) & (logprobs != float("-inf"))
    return torch.where(keep, logprobs, 0.0), keep


@dataclass(frozen=True)
class Masks:
    """Boolean masks ``[B, T]``, their float64 weights, and the sample mask in float64."""

    full: Tensor
    actor: Tensor
    mismatch: Tensor
    keep_curr: Tensor
    keep_prev: Tensor
    full_weight: Tensor
    actor_weight: Tensor
    mismatch_weight: Tensor
    sample_weight: Tensor


def build_masks(
    token_mask: Tensor, sample_mask: Tensor, keep_curr: Tensor, keep_prev: Tensor
) -> Masks:
    """The masks of one microbatch from the original masks and both keep masks."""
    sample = sample_mask.to(torch.float64)
    weight = token_mask.to(torch.float64) * sample[:, None]
    full = token_mask.to(torch.bool) & (weight > 0)
    actor = full & keep_curr & keep_prev
    mismatch = full & keep_prev
    return Masks(
        full=full,
        actor=actor,
        mismatch=mismatch,
        keep_curr=keep_curr,
        keep_prev=keep_prev,
        full_weight=torch.where(full, weight, 0.0),
        actor_weight=torch.where(actor, weight, 0.0),
        mismatch_weight=torch.where(mismatch, weight, 0.0),
        sample_weight=sample,
    )
