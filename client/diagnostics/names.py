"""Every name the policy diagnostics emit or derive, in one place.

:class:`Signal` names what a microbatch sends (numerators, counts, extrema);
:class:`Metric` names what the service derives from them, divided once per step. The
metric names are the ones TRL logs, with ``/`` spelt ``_`` to fit the contract's name
pattern (``clip_ratio/low_mean`` is ``clip_ratio_low_mean``); other trainers' names are
derived expressions over the same signals (see :func:`~.spec.metric_spec`'s ``aliases``).
"""

from __future__ import annotations

from enum import StrEnum


class Signal(StrEnum):
    """A fragment of one microbatch (its kind is declared in :mod:`.spec`)."""

    # position counts
    COMPLETION_TOKENS = "completion_tokens"  # mask > 0
    ACTOR_TOKENS = "actor_tokens"  # ... ∧ keep(current) ∧ keep(old)
    ACTOR_SEQS = "actor_seqs"  # sequences with an actor token
    COMPLETION_SEQS = "completion_seqs"  # sequences with a completion token
    MISMATCH_TOKENS = "mismatch_tokens"  # mask ∧ keep(old)
    SCORED_TOKENS = "scored_tokens"  # mismatch ∧ the sampling logprob is not NaN
    FILTERED_CURR_TOKENS = "filtered_curr_tokens"  # mask ∧ current logprob -inf
    FILTERED_OLD_TOKENS = "filtered_old_tokens"  # mask ∧ old logprob -inf
    CLIPPED_LOW = "clipped_low"  # actor ∧ ratio < 1 - ε_low ∧ A < 0
    CLIPPED_HIGH = "clipped_high"  # actor ∧ ratio > 1 + ε_high ∧ A > 0
    CLIPPED_REGION = "clipped_region"  # either
    CLIPPED_DUAL = "clipped_dual"  # actor ∧ A < 0 ∧ max(ratio, clamped) > c
    # additive numerators
    PROBS_RATIO_NUM = "probs_ratio_num"
    PROBS_RATIO_CLAMPED_NUM = "probs_ratio_clamped_num"
    ENTROPY_NUM = "entropy_num"
    KL_NUM = "kl_num"
    APPROX_KL_NUM = "approx_kl_num"  # Σ old - logp over the actor set
    SAMPLING_LOGP_DIFFERENCE_NUM = "sampling_logp_difference_num"
    SAMPLING_PROB_DIFFERENCE_NUM = "sampling_prob_difference_num"  # Σ |e^old - e^sampling|
    IMPORTANCE_SAMPLING_RATIO_NUM = "importance_sampling_ratio_num"
    # extrema, each guarded by the count of the set it ranges over
    PROBS_RATIO_MIN = "probs_ratio_min"
    PROBS_RATIO_MAX = "probs_ratio_max"
    CLIP_RATIO_LOW_MIN = "clip_ratio_low_min"
    CLIP_RATIO_HIGH_MAX = "clip_ratio_high_max"
    SAMPLING_LOGP_DIFFERENCE_MAX = "sampling_logp_difference_max"
    SAMPLING_PROB_DIFFERENCE_MAX = "sampling_prob_difference_max"
    IMPORTANCE_SAMPLING_RATIO_MIN = "importance_sampling_ratio_min"
    IMPORTANCE_SAMPLING_RATIO_MAX = "importance_sampling_ratio_max"


class Metric(StrEnum):
    """A value the service derives from the signals: a numerator over its count."""

    PROBS_RATIO = "probs_ratio"
    PROBS_RATIO_CLAMPED = "probs_ratio_clamped"
    ENTROPY = "entropy"
    KL = "kl"
    CLIP_RATIO_LOW_MEAN = "clip_ratio_low_mean"
    CLIP_RATIO_HIGH_MEAN = "clip_ratio_high_mean"
    CLIP_RATIO_REGION_MEAN = "clip_ratio_region_mean"
    CLIP_RATIO_DUAL_MEAN = "clip_ratio_dual_mean"
    APPROX_KL = "approx_kl"
    SAMPLING_LOGP_DIFFERENCE_MEAN = "sampling_logp_difference_mean"
    SAMPLING_PROB_DIFFERENCE_MEAN = "sampling_prob_difference_mean"
    IMPORTANCE_SAMPLING_RATIO_MEAN = "importance_sampling_ratio_mean"
    UNSCORED_TOKENS = "unscored_tokens"  # mismatch ∧ a NaN sampling logprob
    FILTERED_TOKEN_SHARE = "filtered_token_share"  # completion tokens the actor side drops
