"""What a trainer's loss computes, as far as its diagnostics need to know.

Which signals a microbatch emits is a function of this config alone, never of the
data, so every fragment of a run has the same names and no device sync decides them.
"""

from __future__ import annotations

from dataclasses import dataclass

from steptally.client.loss.errors import ConfigError


@dataclass(frozen=True)
class DiagnosticsConfig:
    """The clip settings and which optional tensors the trainer passes.

    - ``epsilon_low`` / ``epsilon_high``: the ratio is clamped to ``[1 - ε_low,
      1 + ε_high]`` (``epsilon_high`` defaults to ``epsilon_low``); ``ratio_cap``, when
      set, caps the ratio from above before the clip counts read it (TRL's ``delta``).
    - ``sequence_level``: one ratio per sequence (the mean log-ratio over its kept
      tokens, GSPO / TRL's ``importance_sampling_level="sequence"``); the ratio and clip
      means are then over sequences.
    - ``clip``: emit the clip counts (off for losses without the two-sided clip).
    - ``entropy``, ``reference``, ``sampling``, ``importance_ratio``: the per-token
      entropies, reference logprobs, sampling (generation) logprobs and a sampling
      importance ratio are passed (``importance_ratio_per_sequence``: it is ``[B, 1]``).
    - ``kl_bias_correction``: the KL term is weighted by the ratio (TRL's
      ``use_bias_correction_kl``).
    """

    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    ratio_cap: float | None = None
    sequence_level: bool = False
    clip: bool = True
    entropy: bool = True
    reference: bool = False
    kl_bias_correction: bool = False
    sampling: bool = False
    importance_ratio: bool = False
    importance_ratio_per_sequence: bool = False

    def __post_init__(self) -> None:
        if not self.epsilon_low >= 0 or not self.high >= 0:
            raise ConfigError("epsilon_low and epsilon_high must be >= 0")
        if self.ratio_cap is not None and not self.ratio_cap > 0:
            raise ConfigError(f"ratio_cap must be > 0, got {self.ratio_cap!r}")
        if self.kl_bias_correction and not self.reference:
            raise ConfigError("kl_bias_correction needs reference=True (the KL it weights)")
        if self.importance_ratio_per_sequence and not self.importance_ratio:
            raise ConfigError("importance_ratio_per_sequence needs importance_ratio=True")

    @property
    def high(self) -> float:
        """ε_high, defaulted."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high
