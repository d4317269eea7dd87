"""Every name the loss emits or derives, in one place.

:class:`Fragment` names what a microbatch sends; :class:`Diagnostic` names what the
service derives from it (a numerator over its count, divided once). Members are
strings (``Fragment.ACTOR_TOKENS == "actor_tokens"``), so they index fragment dicts
and step reports directly; a misspelt member is an ``AttributeError``, never a silent
new metric. The loss, its spec and the tests all import them from here.
"""

from __future__ import annotations

from enum import StrEnum


class Fragment(StrEnum):
    """A fragment of one microbatch (its kind is declared in :mod:`.spec`)."""

    # weighted counts (sum), plain position counts (count)
    VALID_TOKENS = "valid_tokens"
    VALID_SEQS = "valid_seqs"
    ACTOR_TOKENS = "actor_tokens"
    MISMATCH_TOKENS = "mismatch_tokens"
    CORRECT_TOKENS = "correct_tokens"
    ACTOR_POSITIONS = "actor_positions"
    MASK_POSITIONS = "mask_positions"  # every position of the token mask
    FILTERED_CURR_TOKENS = "filtered_curr_tokens"
    FILTERED_PREV_TOKENS = "filtered_prev_tokens"
    # additive numerators
    ACTOR_LOSS_NUM = "actor_loss_num"
    KL_PENALTY_NUM = "kl_penalty_num"
    NLL_NUM = "nll_num"
    PROBS_RATIO_NUM = "probs_ratio_num"
    PROBS_RATIO_CLAMPED_NUM = "probs_ratio_clamped_num"
    APPROX_ENTROPY_NUM = "approx_entropy_num"
    TOKEN_MULT_PROB_ERROR_NUM = "token_mult_prob_error_num"
    GEN_KL_ERROR_NUM = "gen_kl_error_num"
    POLICY_KL_ERROR_NUM = "policy_kl_error_num"
    JS_DIVERGENCE_ERROR_NUM = "js_divergence_error_num"
    SAMPLING_IMPORTANCE_RATIO_NUM = "sampling_importance_ratio_num"
    IS_OOB_NUM = "is_oob_num"
    # extrema over the actor mask
    PROBS_RATIO_MIN = "probs_ratio_min"
    PROBS_RATIO_MAX = "probs_ratio_max"
    PROBS_RATIO_CLAMPED_MIN = "probs_ratio_clamped_min"
    PROBS_RATIO_CLAMPED_MAX = "probs_ratio_clamped_max"


class Diagnostic(StrEnum):
    """A value the service derives from the fragments."""

    LOSS = "loss"
    ACTOR_LOSS = "actor_loss"
    KL_PENALTY = "kl_penalty"
    POSITIVE_NLL_LOSS = "positive_nll_loss"
    PROBS_RATIO = "probs_ratio"
    PROBS_RATIO_CLAMPED = "probs_ratio_clamped"
    APPROX_ENTROPY = "approx_entropy"
    TOKEN_MULT_PROB_ERROR = "token_mult_prob_error"
    GEN_KL_ERROR = "gen_kl_error"
    POLICY_KL_ERROR = "policy_kl_error"
    JS_DIVERGENCE_ERROR = "js_divergence_error"
    SAMPLING_IMPORTANCE_RATIO = "sampling_importance_ratio"
    IS_OOB_RATIO = "is_oob_ratio"
    NUM_VALID_SAMPLES = "num_valid_samples"
    FILTERED_TOKEN_SHARE = "filtered_token_share"  # mask positions the actor side drops


F, D = Fragment, Diagnostic

#: the numerator of every mean over a count
NUMERATOR: dict[Diagnostic, Fragment] = {
    D.ACTOR_LOSS: F.ACTOR_LOSS_NUM,
    D.KL_PENALTY: F.KL_PENALTY_NUM,
    D.POSITIVE_NLL_LOSS: F.NLL_NUM,
    D.PROBS_RATIO: F.PROBS_RATIO_NUM,
    D.PROBS_RATIO_CLAMPED: F.PROBS_RATIO_CLAMPED_NUM,
    D.APPROX_ENTROPY: F.APPROX_ENTROPY_NUM,
    D.TOKEN_MULT_PROB_ERROR: F.TOKEN_MULT_PROB_ERROR_NUM,
    D.GEN_KL_ERROR: F.GEN_KL_ERROR_NUM,
    D.POLICY_KL_ERROR: F.POLICY_KL_ERROR_NUM,
    D.JS_DIVERGENCE_ERROR: F.JS_DIVERGENCE_ERROR_NUM,
    D.SAMPLING_IMPORTANCE_RATIO: F.SAMPLING_IMPORTANCE_RATIO_NUM,
    D.IS_OOB_RATIO: F.IS_OOB_NUM,
}

#: the four mismatch diagnostics, by the per-token value :mod:`.mismatch` computes
MISMATCH: tuple[Diagnostic, ...] = (
    D.TOKEN_MULT_PROB_ERROR,
    D.GEN_KL_ERROR,
    D.POLICY_KL_ERROR,
    D.JS_DIVERGENCE_ERROR,
)
