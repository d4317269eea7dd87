"""The settings of the clipped policy-gradient loss, checked once at construction.

Pure Python (no torch), so a service or a launcher can build and validate a config and
its metric spec without the ``torch`` extra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from steptally.client.loss.errors import ConfigError

KlType = Literal["k1", "k2", "k3"]
TisType = Literal["tis", "icepop", "seq-mask-tis"]

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3")
TIS_TYPES: tuple[str, ...] = ("tis", "icepop", "seq-mask-tis")


@dataclass(frozen=True)
class ClippedPGConfig:
    """Settings of :class:`~steptally.client.loss.ClippedPGLoss` (defaults as the framework).

    ``ratio_clip_c`` enables the dual clip; ``truncated_importance_sampling_ratio`` is the
    upper bound of the importance weight and ``..._ratio_min`` the lower one.
    """

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: KlType = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    token_level_loss: bool = True
    disable_ppo_ratio: bool = False
    use_cispo: bool = False
    sequence_level_importance_ratios: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: TisType | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    force_on_policy_ratio: bool = False
    positive_example_nll_weight: float = 0.0

    def __post_init__(self) -> None:
        problems = [*_value_problems(self), *_cispo_problems(self), *_tis_problems(self)]
        if self.sequence_level_importance_ratios and self.token_level_loss:
            problems.append(
                "sequence_level_importance_ratios (GSPO) needs a sequence-level loss: "
                "set token_level_loss=False"
            )
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def kl_enabled(self) -> bool:
        return self.reference_policy_kl_penalty != 0.0

    @property
    def nll_enabled(self) -> bool:
        return self.positive_example_nll_weight != 0.0

    @property
    def gspo(self) -> bool:
        return self.sequence_level_importance_ratios


def _finite_non_negative(name: str, value: float | None) -> list[str]:
    if value is None or (math.isfinite(value) and value >= 0):
        return []
    return [f"{name} must be a finite number >= 0, not {value!r}"]


def _value_problems(c: ClippedPGConfig) -> list[str]:
    problems: list[str] = []
    for name in (
        "ratio_clip_min",
        "ratio_clip_max",
        "reference_policy_kl_penalty",
        "kl_input_clamp_value",
        "kl_output_clamp_value",
        "positive_example_nll_weight",
    ):
        problems += _finite_non_negative(name, getattr(c, name))
    if c.ratio_clip_c is not None and not (math.isfinite(c.ratio_clip_c) and c.ratio_clip_c > 1):
        problems.append(
            f"ratio_clip_c (dual clip) must be a finite number > 1, not {c.ratio_clip_c!r}"
        )
    if c.reference_policy_kl_type not in KL_TYPES:
        problems.append(
            f"reference_policy_kl_type must be one of {', '.join(KL_TYPES)}, not "
            f"{c.reference_policy_kl_type!r}"
        )
    return problems


def _cispo_problems(c: ClippedPGConfig) -> list[str]:
    if not c.use_cispo:
        return []
    clashes = [
        name
        for name, on in (
            ("disable_ppo_ratio", c.disable_ppo_ratio),
            ("force_on_policy_ratio", c.force_on_policy_ratio),
            ("sequence_level_importance_ratios", c.sequence_level_importance_ratios),
            ("ratio_clip_c", c.ratio_clip_c is not None),
        )
        if on
    ]
    problems = [f"use_cispo cannot be combined with {name}" for name in clashes]
    if not c.token_level_loss:
        problems.append("use_cispo needs a token-level loss: set token_level_loss=True")
    return problems


def _tis_problems(c: ClippedPGConfig) -> list[str]:
    kind = c.truncated_importance_sampling_type
    if kind is None:
        return []
    if kind not in TIS_TYPES:
        return [
            f"truncated_importance_sampling_type must be one of {', '.join(TIS_TYPES)} "
            f"or None, not {kind!r}"
        ]
    problems: list[str] = []
    if not c.use_importance_sampling_correction:
        problems.append(
            f"truncated_importance_sampling_type={kind!r} needs "
            "use_importance_sampling_correction=True"
        )
    high, low = c.truncated_importance_sampling_ratio, c.truncated_importance_sampling_ratio_min
    if high is None:
        problems.append(
            f"truncated_importance_sampling_type={kind!r} needs "
            "truncated_importance_sampling_ratio (the upper bound)"
        )
    if kind != "tis" and low is None:
        problems.append(
            f"truncated_importance_sampling_type={kind!r} needs "
            "truncated_importance_sampling_ratio_min (the lower bound)"
        )
    problems += _finite_non_negative("truncated_importance_sampling_ratio", high)
    problems += _finite_non_negative("truncated_importance_sampling_ratio_min", low)
    if high is not None and low is not None and low > high:
        problems.append(
            "truncated_importance_sampling_ratio_min must not exceed "
            "truncated_importance_sampling_ratio"
        )
    if kind == "seq-mask-tis" and c.sequence_level_importance_ratios:
        problems.append(
            "truncated_importance_sampling_type='seq-mask-tis' cannot be combined "
            "with sequence_level_importance_ratios (GSPO)"
        )
    return problems
