"""The per-token terms of one microbatch: masks, ratios, weights, surrogate, KL, NLL.

This is the single place that decides which logprobs each quantity reads:

- the previous side is ``sg(curr)`` under ``force_on_policy_ratio`` (before anything
  else reads it), else the previous logprobs with their -inf masked out and narrowed by
  ``prev_keep_mask`` when given;
- the reference KL reads ``curr_logprobs_unfiltered`` over the full mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.importance import Importance, importance_weights
from steptally.client.loss.inputs import LossInputs
from steptally.client.loss.kl import reference_kl
from steptally.client.loss.masks import Masks, build_masks, mask_out_neg_inf_logprobs
from steptally.client.loss.ratio import Ratios, probs_ratios, surrogate


@dataclass(frozen=True)
class Terms:
    """Everything the loss value and the fragments are reduced from."""

    masks: Masks
    curr: Tensor
    prev: Tensor
    ratios: Ratios
    importance: Importance
    surrogate: Tensor
    kl: Tensor | None
    correct: Tensor | None


def previous_side(
    config: ClippedPGConfig, batch: LossInputs, curr: Tensor, keep_curr: Tensor
) -> tuple[Tensor, Tensor]:
    """The filled previous logprobs and their keep mask."""
    if config.force_on_policy_ratio:
        return curr.detach(), keep_curr
    prev, keep = mask_out_neg_inf_logprobs(batch.prev_logprobs, batch.token_mask)
    if batch.prev_keep_mask is not None:
        keep = keep & batch.prev_keep_mask.to(torch.bool)
        prev = torch.where(keep, prev, 0.0)
    return prev, keep


def compute_terms(config: ClippedPGConfig, batch: LossInputs) -> Terms:
    """The per-token terms of ``batch`` (regular layout) under ``config``."""
    curr, keep_curr = mask_out_neg_inf_logprobs(batch.curr_logprobs, batch.token_mask)
    prev, keep_prev = previous_side(config, batch, curr, keep_curr)
    masks = build_masks(batch.token_mask, batch.sample_mask, keep_curr, keep_prev)
    ratios = probs_ratios(config, curr, prev, masks.actor)
    importance = importance_weights(config, prev, batch.generation_logprobs, masks)
    loss = surrogate(config, batch.advantages, curr, ratios, masks.actor)
    if config.use_importance_sampling_correction:
        loss = loss * importance.weight
    kl = None
    if config.kl_enabled:
        assert batch.curr_logprobs_unfiltered is not None and batch.reference_logprobs is not None
        kl = reference_kl(
            config,
            batch.curr_logprobs_unfiltered,
            batch.reference_logprobs,
            batch.generation_logprobs,
            masks.full,
        )
    correct = None if batch.rewards is None else batch.rewards > 0
    return Terms(masks, curr, prev, ratios, importance, loss, kl, correct)


def approx_entropy(terms: Terms, gen: Tensor) -> Tensor:
    """Per-token -e^(curr - gen)·curr over the actor mask (detached)."""
    actor = terms.masks.actor
    curr = terms.curr.detach()
    value = -torch.exp(torch.where(actor, curr - gen, 0.0)) * curr
    return torch.where(actor, value, 0.0)
