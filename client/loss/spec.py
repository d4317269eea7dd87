"""The fragments the loss emits and the metric spec that turns them into exact step values.

Pure Python (no torch). Which fragments exist is a function of the config only, never of
the data, so the key set of every microbatch is the same and no device sync decides it.

Kinds:

- ``*_tokens``, ``valid_seqs``: weighted counts (sample masks may be fractional), so
  they are ``sum`` metrics; ``actor_positions`` and ``filtered_*_tokens`` are plain
  position counts (``count``).
- ``*_num``: additive numerators (``sum``); the service divides each by its count once.
- ``*_min`` / ``*_max``: extrema over the actor mask. Each has a companion count
  (:data:`EXTREME_COMPANIONS`), declared as its **guard** in the spec: a microbatch
  whose companion count is 0 has an empty mask, and its neutral ±inf extremum counts
  nowhere — the algebra skips it on the service, and
  :func:`~steptally.client.loss.fragments_to_host` already omits it on the host.

Every name is a member of :mod:`steptally.client.loss.names`; the spec hands them on as
plain strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from steptally.client.algebra import MetricSpec
from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.names import MISMATCH, NUMERATOR, Diagnostic, Fragment

F, D = Fragment, Diagnostic

EXTREMES: dict[str, str] = {
    F.PROBS_RATIO_MIN: "min",
    F.PROBS_RATIO_MAX: "max",
    F.PROBS_RATIO_CLAMPED_MIN: "min",
    F.PROBS_RATIO_CLAMPED_MAX: "max",
}
EXTREME_COMPANIONS: dict[str, str] = {str(name): str(F.ACTOR_POSITIONS) for name in EXTREMES}

COUNTS = (F.ACTOR_POSITIONS, F.MASK_POSITIONS, F.FILTERED_CURR_TOKENS, F.FILTERED_PREV_TOKENS)
WEIGHTS = (F.VALID_TOKENS, F.VALID_SEQS, F.ACTOR_TOKENS, F.MISMATCH_TOKENS)
ACTOR_MEANS = (D.PROBS_RATIO, D.PROBS_RATIO_CLAMPED, D.APPROX_ENTROPY)
MISMATCH_MEANS = MISMATCH


def loss_denominator(config: ClippedPGConfig) -> Fragment:
    """The weight fragment the loss-scale numerators divide by."""
    return F.VALID_TOKENS if config.token_level_loss else F.VALID_SEQS


def importance_denominator(config: ClippedPGConfig) -> Fragment:
    """What the importance-weight diagnostics divide by: sequences under GSPO."""
    return F.VALID_SEQS if config.gspo else F.MISMATCH_TOKENS


def oob_denominator(config: ClippedPGConfig) -> Fragment:
    per_sequence = config.gspo or config.truncated_importance_sampling_type == "seq-mask-tis"
    return F.VALID_SEQS if per_sequence else F.MISMATCH_TOKENS


def fragment_kinds(config: ClippedPGConfig) -> dict[str, str]:
    """Every fragment name the loss emits under ``config``, with its kind."""
    kinds: dict[str, str] = dict.fromkeys(WEIGHTS, "sum")
    kinds.update(dict.fromkeys(COUNTS, "count"))
    kinds[F.ACTOR_LOSS_NUM] = "sum"
    kinds.update(dict.fromkeys((NUMERATOR[d] for d in (*ACTOR_MEANS, *MISMATCH_MEANS)), "sum"))
    kinds[F.SAMPLING_IMPORTANCE_RATIO_NUM] = "sum"
    kinds.update(EXTREMES)
    if config.truncated_importance_sampling_type is not None:
        kinds[F.IS_OOB_NUM] = "sum"
    if config.kl_enabled:
        kinds[F.KL_PENALTY_NUM] = "sum"
    if config.nll_enabled:
        kinds[F.NLL_NUM] = "sum"
        kinds[F.CORRECT_TOKENS] = "sum"
    return {str(name): kind for name, kind in kinds.items()}  # plain strings on the wire


def _mean(name: Diagnostic, count: Fragment) -> str:
    return f"{NUMERATOR[name]} / {count}"


def derived_expressions(config: ClippedPGConfig) -> dict[str, str]:
    """Every derived value: a numerator over its count, divided once on the service."""
    derived = {name: _mean(name, F.ACTOR_TOKENS) for name in ACTOR_MEANS}
    derived.update({name: _mean(name, F.MISMATCH_TOKENS) for name in MISMATCH_MEANS})
    sampling = D.SAMPLING_IMPORTANCE_RATIO
    derived[sampling] = _mean(sampling, importance_denominator(config))
    if config.truncated_importance_sampling_type is not None:
        derived[D.IS_OOB_RATIO] = _mean(D.IS_OOB_RATIO, oob_denominator(config))
    scale = loss_denominator(config)
    derived[D.ACTOR_LOSS] = _mean(D.ACTOR_LOSS, scale)
    loss = f"{D.ACTOR_LOSS}"
    if config.kl_enabled:
        derived[D.KL_PENALTY] = _mean(D.KL_PENALTY, scale)
        loss += f" + {config.reference_policy_kl_penalty!r} * {D.KL_PENALTY}"
    if config.nll_enabled:
        derived[D.POSITIVE_NLL_LOSS] = _mean(D.POSITIVE_NLL_LOSS, F.CORRECT_TOKENS)
        loss += f" + {config.positive_example_nll_weight!r} * {D.POSITIVE_NLL_LOSS}"
    derived[D.LOSS] = loss
    derived[D.NUM_VALID_SAMPLES] = str(F.VALID_SEQS)
    derived[D.FILTERED_TOKEN_SHARE] = (
        f"({F.MASK_POSITIONS} - {F.ACTOR_POSITIONS}) / {F.MASK_POSITIONS}"
    )
    return {str(name): expression for name, expression in derived.items()}


def default_alerts(config: ClippedPGConfig) -> list[dict[str, Any]]:
    """The alert rules a run of the loss gets unless it names its own: the mean ratio
    drifting from 1, a ratio far off, the generation/policy KL, a KL penalty spike, the
    share of tokens the ``-inf`` keep mask drops, and a non-finite loss. The thresholds
    are starting points for GRPO/PPO runs: pass your own rules to change them (a
    registered rule never changes meaning; a new name adds one)."""
    rules: list[dict[str, Any]] = [
        {"name": "ratio_drift", "metric": D.PROBS_RATIO, "above": 1.1, "below": 0.9},
        {"name": "ratio_max", "metric": F.PROBS_RATIO_MAX, "above": 10.0},
        {"name": "generation_kl", "metric": D.GEN_KL_ERROR, "above": 0.05},
        {"name": "filtered_token_share", "metric": D.FILTERED_TOKEN_SHARE, "above": 0.1},
        {"name": "loss_non_finite", "metric": D.LOSS, "non_finite": True},
    ]
    if config.kl_enabled:
        # more than twice (or below zero times) the mean of the last 10 steps
        spike = {"change_above": 1.0, "relative": True, "window": 10}
        rules.insert(3, {"name": "kl_spike", "metric": D.KL_PENALTY, **spike})
    return rules


def metric_spec(
    config: ClippedPGConfig, alerts: Sequence[Mapping[str, Any]] | None = None
) -> MetricSpec:
    """The run's metric spec for the loss under ``config``, with ``alerts`` (None: the
    :func:`default_alerts`; ``[]``: none)."""
    return MetricSpec.build(
        fragment_kinds(config),
        derived_expressions(config),
        guards=EXTREME_COMPANIONS,
        alerts=default_alerts(config) if alerts is None else list(alerts),
    )
