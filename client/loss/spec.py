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
"""

from __future__ import annotations

from steptally.client.algebra import MetricSpec
from steptally.client.loss.config import ClippedPGConfig

EXTREMES: dict[str, str] = {
    "probs_ratio_min": "min",
    "probs_ratio_max": "max",
    "probs_ratio_clamped_min": "min",
    "probs_ratio_clamped_max": "max",
}
EXTREME_COMPANIONS: dict[str, str] = dict.fromkeys(EXTREMES, "actor_positions")

COUNTS = ("actor_positions", "filtered_curr_tokens", "filtered_prev_tokens")
WEIGHTS = ("valid_tokens", "valid_seqs", "actor_tokens", "mismatch_tokens")
ACTOR_MEANS = ("probs_ratio", "probs_ratio_clamped", "approx_entropy")
MISMATCH_MEANS = (
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
)


def loss_denominator(config: ClippedPGConfig) -> str:
    """The weight fragment the loss-scale numerators divide by."""
    return "valid_tokens" if config.token_level_loss else "valid_seqs"


def importance_denominator(config: ClippedPGConfig) -> str:
    """What the importance-weight diagnostics divide by: sequences under GSPO."""
    return "valid_seqs" if config.gspo else "mismatch_tokens"


def oob_denominator(config: ClippedPGConfig) -> str:
    per_sequence = config.gspo or config.truncated_importance_sampling_type == "seq-mask-tis"
    return "valid_seqs" if per_sequence else "mismatch_tokens"


def fragment_kinds(config: ClippedPGConfig) -> dict[str, str]:
    """Every fragment name the loss emits under ``config``, with its kind."""
    kinds: dict[str, str] = dict.fromkeys(WEIGHTS, "sum")
    kinds.update(dict.fromkeys(COUNTS, "count"))
    kinds["actor_loss_num"] = "sum"
    kinds.update({f"{name}_num": "sum" for name in (*ACTOR_MEANS, *MISMATCH_MEANS)})
    kinds["sampling_importance_ratio_num"] = "sum"
    kinds.update(EXTREMES)
    if config.truncated_importance_sampling_type is not None:
        kinds["is_oob_num"] = "sum"
    if config.kl_enabled:
        kinds["kl_penalty_num"] = "sum"
    if config.nll_enabled:
        kinds["nll_num"] = "sum"
        kinds["correct_tokens"] = "sum"
    return kinds


def derived_expressions(config: ClippedPGConfig) -> dict[str, str]:
    """Every derived value: a numerator over its count, divided once on the service."""
    derived = {name: f"{name}_num / actor_tokens" for name in ACTOR_MEANS}
    derived.update({name: f"{name}_num / mismatch_tokens" for name in MISMATCH_MEANS})
    derived["sampling_importance_ratio"] = (
        f"sampling_importance_ratio_num / {importance_denominator(config)}"
    )
    if config.truncated_importance_sampling_type is not None:
        derived["is_oob_ratio"] = f"is_oob_num / {oob_denominator(config)}"
    scale = loss_denominator(config)
    derived["actor_loss"] = f"actor_loss_num / {scale}"
    loss = "actor_loss"
    if config.kl_enabled:
        derived["kl_penalty"] = f"kl_penalty_num / {scale}"
        loss += f" + {config.reference_policy_kl_penalty!r} * kl_penalty"
    if config.nll_enabled:
        derived["positive_nll_loss"] = "nll_num / correct_tokens"
        loss += f" + {config.positive_example_nll_weight!r} * positive_nll_loss"
    derived["loss"] = loss
    derived["num_valid_samples"] = "valid_seqs"
    return derived


def metric_spec(config: ClippedPGConfig) -> MetricSpec:
    """The run's metric spec for the loss under ``config``."""
    return MetricSpec.build(
        fragment_kinds(config), derived_expressions(config), guards=EXTREME_COMPANIONS
    )
