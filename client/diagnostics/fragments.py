"""The signals of one microbatch, from the per-token tensors a trainer already has.

Nothing here touches the trainer's loss or its gradient: every input is detached and
read under ``no_grad``. Nothing syncs with the host either: shapes and which tensors are
present are checked on the host, values never are, and every reduction stays on the
tensors' device. A sum is the **exact** sum of its terms as ``[LIMBS]`` parts (one stacked
exact pass for all of them), a count a float64
integer (exact in any order below 2**53), an extremum a 0-d float64 that holds the neutral
±inf over an empty set and is then skipped by its guard (see :mod:`.spec`).

The ``-inf`` keep-mask semantics of :mod:`steptally.client.loss.masks`: with
``full = mask != 0``, a position whose current or old logprob is ``-inf`` leaves the
actor set (ratio, clamped ratio, clip counts, entropy) but not the reference KL, which
reduces over ``full``; the sampling diagnostics, which never read the current logprobs,
reduce over ``full ∧ keep(old)``. Both filtered counts are emitted, so nothing is hidden.
A NaN sampling logprob (a token the sampler could not score) is left out of the sampling
log-probability difference and counted as unscored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from steptally.client.diagnostics.config import DiagnosticsConfig
from steptally.client.diagnostics.names import Signal
from steptally.client.diagnostics.spec import signal_kinds
from steptally.client.loss.errors import InputError
from steptally.client.loss.exact_sum import exact_sums_and_parts

S = Signal
F64 = torch.float64
INF = float("inf")


@dataclass(frozen=True)
class PolicyTensors:
    """One microbatch as the trainer has it: ``[B, T]`` per-token tensors aligned to the
    completion tokens, ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``, ``mask`` nonzero
    at every completion token the loss counts. ``old_logprobs`` defaults to the detached
    current ones (ratio exactly 1); ``unfiltered_logprobs``, when the trainer has them,
    are what the reference KL reads instead of ``logprobs``."""

    logprobs: Tensor
    mask: Tensor
    advantages: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    sampling_logprobs: Tensor | None = None
    entropies: Tensor | None = None
    importance_ratio: Tensor | None = None
    unfiltered_logprobs: Tensor | None = None


def check(config: DiagnosticsConfig, t: PolicyTensors) -> None:
    """Shapes and presence against ``config`` (host facts only)."""
    shape = t.logprobs.shape
    if len(shape) != 2:
        raise InputError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    wanted = {
        "entropies": config.entropy,
        "ref_logprobs": config.reference,
        "sampling_logprobs": config.sampling,
        "importance_ratio": config.importance_ratio,
    }
    for name, needed in wanted.items():
        if (getattr(t, name) is not None) != needed:
            state = "needs" if needed else "has no"
            raise InputError(f"the config {state} {name}: pass it iff the config says so")
    for name in ("mask", "old_logprobs", "ref_logprobs", "sampling_logprobs", "entropies"):
        value = getattr(t, name)
        if value is not None and value.shape != shape:
            raise InputError(f"{name} must have the shape of logprobs {tuple(shape)}")
    if t.advantages.shape not in ((shape[0],), (shape[0], 1), shape):
        raise InputError(f"advantages must be [B], [B, 1] or [B, T] for logprobs {tuple(shape)}")
    rows = (shape[0], 1) if config.importance_ratio_per_sequence else shape
    if t.importance_ratio is not None and t.importance_ratio.shape != rows:
        raise InputError(f"importance_ratio must have shape {tuple(rows)}")


@dataclass(frozen=True)
class _Sets:
    full: Tensor
    actor: Tensor
    actor_seq: Tensor
    mismatch: Tensor


def _sets(t: PolicyTensors, curr: Tensor, old: Tensor) -> _Sets:
    full = t.mask != 0
    keep_old = old != -INF
    actor = full & (curr != -INF) & keep_old
    return _Sets(full, actor, actor.any(-1), full & keep_old)


def _ratio(config: DiagnosticsConfig, curr: Tensor, old: Tensor, s: _Sets) -> Tensor:
    """The importance ratio ``[B, T]``, or ``[B, 1]`` at sequence level, in the logprobs'
    dtype (the values the trainer's own ``exp(logp - old)`` gives on kept positions)."""
    log_ratio = _log_ratio(config, curr, old, s)
    if config.sequence_level:
        kept = s.actor.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = _clamp(config, log_ratio.sum(-1, keepdim=True) / kept)
    return torch.exp(log_ratio)


def _clamp(config: DiagnosticsConfig, log_ratio: Tensor) -> Tensor:
    bound = config.log_ratio_clamp
    return log_ratio if bound is None else log_ratio.clamp(-bound, bound)


def _log_ratio(config: DiagnosticsConfig, curr: Tensor, old: Tensor, s: _Sets) -> Tensor:
    """``logp - old`` on the actor set (0 elsewhere), clamped where the config says."""
    return _clamp(config, torch.where(s.actor, curr - old, 0.0))


def _min(values: Tensor, where: Tensor) -> Tensor:
    return torch.where(where, values, INF).amin().to(F64)


def _max(values: Tensor, where: Tensor) -> Tensor:
    return torch.where(where, values, -INF).amax().to(F64)


class _Rows:
    """Per-token ``[B, T]`` and per-sequence ``[B]`` rows to sum exactly, the masks to
    count, and extrema."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.extrema: dict[str, Tensor] = {}

    def add(self, name: str, values: Tensor, where: Tensor) -> None:
        self.sums[name] = torch.where(where, values.to(F64), 0.0)

    def fragments(self) -> dict[str, Tensor]:
        """One exact pass over every row (a per-sequence row is padded with zeros to the
        per-token length, which changes no sum) and one stacked sum per shape of mask."""
        rows = {name: row.reshape(-1) for name, row in self.sums.items()}
        width = max((row.numel() for row in rows.values()), default=0)
        padded = {name: F.pad(row, (0, width - row.numel())) for name, row in rows.items()}
        _, parts = exact_sums_and_parts({}, padded)
        counts: dict[str, Tensor] = {}
        for shape in {mask.shape for mask in self.counts.values()}:
            names = [n for n, mask in self.counts.items() if mask.shape == shape]
            stacked = torch.stack([self.counts[n] for n in names]).reshape(len(names), -1)
            counts.update(zip(names, stacked.sum(-1, dtype=F64).unbind(0), strict=True))
        return {**parts, **counts, **self.extrema}


def _ratio_signals(
    config: DiagnosticsConfig, t: PolicyTensors, ratio: Tensor, s: _Sets, r: _Rows
) -> None:
    at = s.actor_seq if config.sequence_level else s.actor
    ratio = ratio[:, 0] if config.sequence_level else ratio
    clamped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.high)
    r.add(S.PROBS_RATIO_NUM, ratio, at)
    r.add(S.PROBS_RATIO_CLAMPED_NUM, clamped, at)
    r.extrema[S.PROBS_RATIO_MIN], r.extrema[S.PROBS_RATIO_MAX] = _min(ratio, at), _max(ratio, at)
    if not config.clip:
        return
    capped = ratio if config.ratio_cap is None else ratio.clamp(max=config.ratio_cap)
    adv = t.advantages.detach()
    adv = adv[:, 0] if config.sequence_level and adv.dim() == 2 else adv
    if not config.sequence_level and adv.dim() == 1:
        adv = adv[:, None]
    low = (capped < 1.0 - config.epsilon_low) & (adv < 0) & at
    high = (capped > 1.0 + config.high) & (adv > 0) & at
    r.counts[S.CLIPPED_LOW], r.counts[S.CLIPPED_HIGH] = low, high
    r.counts[S.CLIPPED_REGION] = low | high
    if config.dual_clip is not None:
        capped_loss = torch.maximum(ratio, clamped) > config.dual_clip
        r.counts[S.CLIPPED_DUAL] = capped_loss & (adv < 0) & at
    if config.sequence_level:
        per_seq_low, per_seq_high = low.to(F64), high.to(F64)
    else:
        kept = s.actor.sum(-1, dtype=F64).clamp(min=1.0)
        per_seq_low, per_seq_high = low.sum(-1, dtype=F64) / kept, high.sum(-1, dtype=F64) / kept
    r.extrema[S.CLIP_RATIO_LOW_MIN] = _min(per_seq_low, s.actor_seq)
    r.extrema[S.CLIP_RATIO_HIGH_MAX] = _max(per_seq_high, s.actor_seq)


def _kl(
    config: DiagnosticsConfig, t: PolicyTensors, curr: Tensor, ratio: Tensor, s: _Sets, r: _Rows
) -> None:
    assert t.ref_logprobs is not None
    lp = curr if t.unfiltered_logprobs is None else t.unfiltered_logprobs.detach()
    kl = _kl_estimate(config.kl_estimator, t.ref_logprobs.detach() - lp)
    if config.kl_bias_correction:
        kl = kl * ratio
    r.add(S.KL_NUM, kl, s.full)


def _kl_estimate(estimator: str, diff: Tensor) -> Tensor:
    """The per-token KL estimate from ``diff = ref - logp`` (see
    :class:`~.config.DiagnosticsConfig`'s ``kl_estimator``)."""
    if estimator == "k1":
        return -diff
    if estimator == "k2":
        return diff.square() * 0.5
    if estimator == "abs":
        return diff.abs()
    if estimator == "low_var_kl":
        diff = diff.clamp(-20.0, 20.0)
        return (torch.exp(diff) - diff - 1).clamp(-10.0, 10.0)
    return torch.exp(diff) - diff - 1


def _sampling(config: DiagnosticsConfig, t: PolicyTensors, old: Tensor, s: _Sets, r: _Rows) -> None:
    assert t.sampling_logprobs is not None
    sampling = t.sampling_logprobs.detach()
    scored = s.mismatch & ~torch.isnan(sampling)
    diff = torch.where(scored, old - sampling, 0.0).abs()
    r.counts[S.MISMATCH_TOKENS], r.counts[S.SCORED_TOKENS] = s.mismatch, scored
    r.add(S.SAMPLING_LOGP_DIFFERENCE_NUM, diff, scored)
    r.extrema[S.SAMPLING_LOGP_DIFFERENCE_MAX] = _max(diff, scored)
    if config.sampling_probs:
        probs = torch.where(scored, torch.exp(old) - torch.exp(sampling), 0.0).abs()
        r.add(S.SAMPLING_PROB_DIFFERENCE_NUM, probs, scored)
        r.extrema[S.SAMPLING_PROB_DIFFERENCE_MAX] = _max(probs, scored)


def _importance(config: DiagnosticsConfig, t: PolicyTensors, s: _Sets, r: _Rows) -> None:
    assert t.importance_ratio is not None
    value = t.importance_ratio.detach()
    r.counts[S.MISMATCH_TOKENS] = s.mismatch
    if config.importance_ratio_per_sequence:
        value, at = value[:, 0], s.full.any(-1)
        r.counts[S.COMPLETION_SEQS] = at
    else:
        at = s.mismatch
    r.add(S.IMPORTANCE_SAMPLING_RATIO_NUM, value, at)
    r.extrema[S.IMPORTANCE_SAMPLING_RATIO_MIN] = _min(value, at)
    r.extrema[S.IMPORTANCE_SAMPLING_RATIO_MAX] = _max(value, at)


def policy_fragments(config: DiagnosticsConfig, t: PolicyTensors) -> dict[str, Tensor]:
    """Every signal of the microbatch ``t`` under ``config``, in the spec's order."""
    check(config, t)
    with torch.no_grad():
        curr = t.logprobs.detach()
        old = curr if t.old_logprobs is None else t.old_logprobs.detach()
        s = _sets(t, curr, old)
        r = _Rows()
        r.counts[S.COMPLETION_TOKENS], r.counts[S.ACTOR_TOKENS] = s.full, s.actor
        r.counts[S.ACTOR_SEQS] = s.actor_seq
        r.counts[S.FILTERED_CURR_TOKENS] = s.full & (curr == -INF)
        r.counts[S.FILTERED_OLD_TOKENS] = s.full & (old == -INF)
        ratio = _ratio(config, curr, old, s)
        _ratio_signals(config, t, ratio, s, r)
        if config.approx_kl:
            r.add(S.APPROX_KL_NUM, -_log_ratio(config, curr, old, s), s.actor)
        if t.entropies is not None:
            r.add(S.ENTROPY_NUM, t.entropies.detach(), s.actor)
        if config.reference:
            _kl(config, t, curr, ratio, s, r)
        if config.sampling:
            _sampling(config, t, old, s, r)
        if config.importance_ratio:
            _importance(config, t, s, r)
        found = r.fragments()
    return {name: found[name] for name in signal_kinds(config)}
