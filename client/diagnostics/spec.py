"""The signals a config emits, their kinds, and the metric spec that divides them once.

Pure Python (no torch). Every count is an exact integer (``count``), every numerator an
exact sum (``sum``), every extremum a ``min``/``max`` guarded by the count of the set it
ranges over, so a microbatch whose set is empty (its neutral ±inf) counts nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from steptally.client.algebra import MetricSpec
from steptally.client.diagnostics.config import DiagnosticsConfig
from steptally.client.diagnostics.names import Metric, Signal

S, M = Signal, Metric

ALWAYS: dict[Signal, str] = {
    S.COMPLETION_TOKENS: "count",
    S.ACTOR_TOKENS: "count",
    S.ACTOR_SEQS: "count",
    S.FILTERED_CURR_TOKENS: "count",
    S.FILTERED_OLD_TOKENS: "count",
    S.PROBS_RATIO_NUM: "sum",
    S.PROBS_RATIO_CLAMPED_NUM: "sum",
    S.PROBS_RATIO_MIN: "min",
    S.PROBS_RATIO_MAX: "max",
}
CLIP: dict[Signal, str] = {
    S.CLIPPED_LOW: "count",
    S.CLIPPED_HIGH: "count",
    S.CLIPPED_REGION: "count",
    S.CLIP_RATIO_LOW_MIN: "min",
    S.CLIP_RATIO_HIGH_MAX: "max",
}
SAMPLING: dict[Signal, str] = {
    S.MISMATCH_TOKENS: "count",
    S.SCORED_TOKENS: "count",
    S.SAMPLING_LOGP_DIFFERENCE_NUM: "sum",
    S.SAMPLING_LOGP_DIFFERENCE_MAX: "max",
}
IMPORTANCE: dict[Signal, str] = {
    S.MISMATCH_TOKENS: "count",
    S.IMPORTANCE_SAMPLING_RATIO_NUM: "sum",
    S.IMPORTANCE_SAMPLING_RATIO_MIN: "min",
    S.IMPORTANCE_SAMPLING_RATIO_MAX: "max",
}


def ratio_count(config: DiagnosticsConfig) -> Signal:
    """What the ratio and clip means divide by: kept tokens, or sequences."""
    return S.ACTOR_SEQS if config.sequence_level else S.ACTOR_TOKENS


def importance_count(config: DiagnosticsConfig) -> Signal:
    return S.COMPLETION_SEQS if config.importance_ratio_per_sequence else S.MISMATCH_TOKENS


def signal_kinds(config: DiagnosticsConfig) -> dict[str, str]:
    """Every signal a microbatch emits under ``config``, with its kind."""
    kinds = dict(ALWAYS)
    if config.clip:
        kinds.update(CLIP)
    if config.clip and config.dual_clip is not None:
        kinds[S.CLIPPED_DUAL] = "count"
    if config.approx_kl:
        kinds[S.APPROX_KL_NUM] = "sum"
    if config.entropy:
        kinds[S.ENTROPY_NUM] = "sum"
    if config.reference:
        kinds[S.KL_NUM] = "sum"
    if config.sampling:
        kinds.update(SAMPLING)
    if config.sampling_probs:
        kinds[S.SAMPLING_PROB_DIFFERENCE_NUM] = "sum"
        kinds[S.SAMPLING_PROB_DIFFERENCE_MAX] = "max"
    if config.importance_ratio:
        kinds.update(IMPORTANCE)
        if config.importance_ratio_per_sequence:
            kinds[S.COMPLETION_SEQS] = "count"
    return {str(name): kind for name, kind in kinds.items()}


def guards(config: DiagnosticsConfig) -> dict[str, str]:
    """Each extremum's companion count, for the signals ``config`` emits."""
    every = {
        S.PROBS_RATIO_MIN: ratio_count(config),
        S.PROBS_RATIO_MAX: ratio_count(config),
        S.CLIP_RATIO_LOW_MIN: S.ACTOR_SEQS,
        S.CLIP_RATIO_HIGH_MAX: S.ACTOR_SEQS,
        S.SAMPLING_LOGP_DIFFERENCE_MAX: S.SCORED_TOKENS,
        S.SAMPLING_PROB_DIFFERENCE_MAX: S.SCORED_TOKENS,
        S.IMPORTANCE_SAMPLING_RATIO_MIN: importance_count(config),
        S.IMPORTANCE_SAMPLING_RATIO_MAX: importance_count(config),
    }
    kinds = signal_kinds(config)
    return {str(name): str(count) for name, count in every.items() if name in kinds}


def derived_expressions(config: DiagnosticsConfig) -> dict[str, str]:
    """Every mean as its numerator over its count, divided once on the service."""
    kinds = signal_kinds(config)
    per = ratio_count(config)
    every = {
        M.PROBS_RATIO: f"{S.PROBS_RATIO_NUM} / {per}",
        M.PROBS_RATIO_CLAMPED: f"{S.PROBS_RATIO_CLAMPED_NUM} / {per}",
        M.FILTERED_TOKEN_SHARE: (
            f"({S.COMPLETION_TOKENS} - {S.ACTOR_TOKENS}) / {S.COMPLETION_TOKENS}"
        ),
        M.CLIP_RATIO_LOW_MEAN: f"{S.CLIPPED_LOW} / {per}",
        M.CLIP_RATIO_HIGH_MEAN: f"{S.CLIPPED_HIGH} / {per}",
        M.CLIP_RATIO_REGION_MEAN: f"{S.CLIPPED_REGION} / {per}",
        M.CLIP_RATIO_DUAL_MEAN: f"{S.CLIPPED_DUAL} / {per}",
        M.APPROX_KL: f"{S.APPROX_KL_NUM} / {S.ACTOR_TOKENS}",
        M.ENTROPY: f"{S.ENTROPY_NUM} / {S.ACTOR_TOKENS}",
        M.KL: f"{S.KL_NUM} / {S.COMPLETION_TOKENS}",
        M.SAMPLING_LOGP_DIFFERENCE_MEAN: f"{S.SAMPLING_LOGP_DIFFERENCE_NUM} / {S.SCORED_TOKENS}",
        M.SAMPLING_PROB_DIFFERENCE_MEAN: f"{S.SAMPLING_PROB_DIFFERENCE_NUM} / {S.SCORED_TOKENS}",
        M.UNSCORED_TOKENS: f"{S.MISMATCH_TOKENS} - {S.SCORED_TOKENS}",
        M.IMPORTANCE_SAMPLING_RATIO_MEAN: (
            f"{S.IMPORTANCE_SAMPLING_RATIO_NUM} / {importance_count(config)}"
        ),
    }
    numerator = {
        M.CLIP_RATIO_LOW_MEAN: S.CLIPPED_LOW,
        M.CLIP_RATIO_HIGH_MEAN: S.CLIPPED_HIGH,
        M.CLIP_RATIO_REGION_MEAN: S.CLIPPED_REGION,
        M.CLIP_RATIO_DUAL_MEAN: S.CLIPPED_DUAL,
        M.APPROX_KL: S.APPROX_KL_NUM,
        M.ENTROPY: S.ENTROPY_NUM,
        M.KL: S.KL_NUM,
        M.SAMPLING_LOGP_DIFFERENCE_MEAN: S.SAMPLING_LOGP_DIFFERENCE_NUM,
        M.SAMPLING_PROB_DIFFERENCE_MEAN: S.SAMPLING_PROB_DIFFERENCE_NUM,
        M.UNSCORED_TOKENS: S.SCORED_TOKENS,
        M.IMPORTANCE_SAMPLING_RATIO_MEAN: S.IMPORTANCE_SAMPLING_RATIO_NUM,
    }
    return {
        str(name): text
        for name, text in every.items()
        if name not in numerator or numerator[name] in kinds
    }


def default_alerts(config: DiagnosticsConfig) -> list[dict[str, Any]]:
    """The alert rules a run gets unless it names its own: the mean ratio drifting from
    1, a ratio far off, the clipped share, a reference-KL spike and the share of tokens
    the ``-inf`` keep mask drops. Starting points for GRPO/PPO runs: pass your own
    rules to change them (a registered rule never changes meaning)."""
    kinds = signal_kinds(config)
    rules: list[dict[str, Any]] = [
        {"name": "ratio_drift", "metric": M.PROBS_RATIO, "above": 1.1, "below": 0.9},
        {"name": "ratio_max", "metric": S.PROBS_RATIO_MAX, "above": 10.0},
    ]
    if S.CLIPPED_REGION in kinds:
        rules.append({"name": "clip_fraction", "metric": M.CLIP_RATIO_REGION_MEAN, "above": 0.2})
    if S.KL_NUM in kinds:
        # more than twice (or below zero times) the mean of the last 10 steps
        spike = {"change_above": 1.0, "relative": True, "window": 10}
        rules.append({"name": "kl_spike", "metric": M.KL, **spike})
    rules.append({"name": "filtered_token_share", "metric": M.FILTERED_TOKEN_SHARE, "above": 0.1})
    return rules


def metric_spec(
    config: DiagnosticsConfig,
    aliases: Mapping[str, str] | None = None,
    alerts: Sequence[Mapping[str, Any]] | None = None,
) -> MetricSpec:
    """The run's metric spec; ``aliases`` adds derived values under a trainer's own names
    (expressions over the signals and metrics, e.g. ``{"pg_clipfrac":
    "clip_ratio_region_mean"}``); ``alerts`` its alert rules (None: the
    :func:`default_alerts`; ``[]``: none)."""
    derived = {**derived_expressions(config), **(aliases or {})}
    return MetricSpec.build(
        signal_kinds(config),
        derived,
        guards=guards(config),
        alerts=default_alerts(config) if alerts is None else list(alerts),
    )
