"""What a trainer's loss computes, as far as its diagnostics need to know.

Which signals a microbatch emits is a function of this config alone, never of the
data, so every fragment of a run has the same names and no device sync decides them.
"""

from __future__ import annotations

from dataclasses import dataclass

from steptally.client.loss.errors import ConfigError

KL_ESTIMATORS: tuple[str, ...] = ("k3", "low_var_kl", "k1", "k2", "abs")


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
    - ``kl_estimator``: how the reference KL is estimated per token from
      ``d = ref - logp``: ``"k3"`` is ``e^d - d - 1`` (TRL's); ``"low_var_kl"`` is the
      same with ``d`` clamped to ±20 and the result to ±10 (verl's ``k3``/``low_var_kl``);
      ``"k1"`` is ``-d``, ``"k2"`` is ``d²/2`` and ``"abs"`` is ``|d|``.
    - ``log_ratio_clamp``: the log ratio is clamped to ±this before ``exp`` (verl's 20),
      for the ratio, its clip counts and the approximate KL alike.
    - ``dual_clip``: the dual-clip bound ``c`` > 1; emits the share of kept tokens with a
      negative advantage whose loss the bound caps (verl's ``pg_clipfrac_lower``).
    - ``approx_kl``: emit the mean of ``old - logp`` over the kept tokens (verl's
      ``ppo_kl``).
    - ``sampling_probs`` (with ``sampling``): also the sampling mismatch in probability,
      ``|e^old - e^sampling|`` (verl's ``rollout_probs_diff``).
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
    kl_estimator: str = "k3"
    log_ratio_clamp: float | None = None
    dual_clip: float | None = None
    approx_kl: bool = False
    sampling_probs: bool = False

    def __post_init__(self) -> None:
        if not self.epsilon_low >= 0 or not self.high >= 0:
            raise ConfigError("epsilon_low and epsilon_high must be >= 0")
        if self.ratio_cap is not None and not self.ratio_cap > 0:
            raise ConfigError(f"ratio_cap must be > 0, got {self.ratio_cap!r}")
        if self.kl_bias_correction and not self.reference:
            raise ConfigError("kl_bias_correction needs reference=True (the KL it weights)")
        if self.importance_ratio_per_sequence and not self.importance_ratio:
            raise ConfigError("importance_ratio_per_sequence needs importance_ratio=True")
        if self.sampling_probs and not self.sampling:
            raise ConfigError("sampling_probs needs sampling=True (the logprobs it compares)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, not {self.kl_estimator!r}"
            )
        if self.log_ratio_clamp is not None and not self.log_ratio_clamp > 0:
            raise ConfigError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip!r}")

    @property
    def high(self) -> float:
        """ε_high, defaulted."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high
