"""The fragments of one microbatch: additive numerators, counts and extrema.

Every mean is emitted as a numerator plus the count it divides by, never as a
per-microbatch mean, so the service divides once over the whole step. Each fragment is a
0-d float64 tensor on the loss's device; building them needs no host sync (every sum is
an :func:`~steptally.client.loss.exact_sum.exact_sum` of one stacked tensor, every
extremum an ``amin``/``amax`` over ``torch.where``-masked values).

Empty extrema. Which keys a microbatch emits cannot depend on its data without a sync,
so ``probs_ratio{,_clamped}_{min,max}`` are always present on the device; over an empty
actor mask they hold the neutral ±inf of ``amin``/``amax``. They are never sent as
values: :func:`fragments_to_host` moves all fragments to the host in one transfer (off
the critical path, on the reporter's thread) and omits every extremum whose companion
count (``actor_positions``, exact) is 0. An empty mask therefore contributes nothing,
while a genuine ±inf or NaN over a non-empty mask is kept as data.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.exact_sum import exact_sum
from steptally.client.loss.inputs import LossInputs
from steptally.client.loss.mismatch import mismatch_terms
from steptally.client.loss.spec import EXTREME_COMPANIONS, fragment_kinds
from steptally.client.loss.terms import Terms, approx_entropy

F64 = torch.float64


def _importance_terms(
    config: ClippedPGConfig, batch: LossInputs, terms: Terms
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    imp, masks = terms.importance, terms.masks
    sample = batch.sample_mask.to(F64)
    tokens: dict[str, Tensor] = {}
    seqs: dict[str, Tensor] = {}
    target = seqs if imp.per_sequence else tokens
    weight = sample if imp.per_sequence else masks.mismatch_weight
    target["sampling_importance_ratio_num"] = imp.value.to(F64) * weight
    if imp.oob is not None:
        oob_weight = sample if imp.oob_per_sequence else masks.mismatch_weight
        (seqs if imp.oob_per_sequence else tokens)["is_oob_num"] = imp.oob.to(F64) * oob_weight
    return tokens, seqs


def _count_terms(config: ClippedPGConfig, batch: LossInputs, terms: Terms) -> dict[str, Tensor]:
    """Counts per sequence: integer row counts, times the sample weight for weighted ones
    (the same exact values as summing token_mask·sample_mask over each mask)."""
    m = terms.masks
    sample = batch.sample_mask.to(F64)

    def rows(mask: Tensor) -> Tensor:
        return mask.sum(-1, dtype=F64)

    full = rows(m.full)
    out = {
        "valid_tokens": sample * full,
        "actor_tokens": sample * rows(m.actor),
        "mismatch_tokens": sample * rows(m.mismatch),
        "actor_positions": rows(m.actor),
        "filtered_curr_tokens": rows(m.filtered_curr),
        "filtered_prev_tokens": rows(m.filtered_prev),
        "valid_seqs": sample,
    }
    if terms.correct is not None and config.nll_enabled:
        out["correct_tokens"] = torch.where(terms.correct, sample * full, 0.0)
    return out


def fragment_terms(
    config: ClippedPGConfig, batch: LossInputs, terms: Terms
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-token ``[B, T]`` and per-sequence ``[B]`` float64 terms; each fragment that is a
    sum or a count is the exact sum of one of them (counts are summed per sequence)."""
    m = terms.masks
    r, rc = terms.ratios.ratio.detach(), terms.ratios.clamped.detach()
    tokens: dict[str, Tensor] = {
        "probs_ratio_num": torch.where(m.actor, r, 0.0).to(F64) * m.actor_weight,
        "probs_ratio_clamped_num": torch.where(m.actor, rc, 0.0).to(F64) * m.actor_weight,
        "approx_entropy_num": approx_entropy(terms, batch.generation_logprobs).to(F64)
        * m.actor_weight,
    }
    kind = config.reference_policy_kl_type
    for name, value in mismatch_terms(
        terms.prev, batch.generation_logprobs, m.mismatch, kind
    ).items():
        tokens[f"{name}_num"] = value.to(F64) * m.mismatch_weight
    imp_tokens, seqs = _importance_terms(config, batch, terms)
    tokens.update(imp_tokens)
    seqs.update(_count_terms(config, batch, terms))
    return tokens, seqs


def extremes(terms: Terms) -> dict[str, Tensor]:
    """Extrema of the ratio and the clamped ratio over the actor mask (see module doc)."""
    actor = terms.masks.actor
    out: dict[str, Tensor] = {}
    for name, value in (
        ("probs_ratio", terms.ratios.ratio),
        ("probs_ratio_clamped", terms.ratios.clamped),
    ):
        value = value.detach().to(F64)
        out[f"{name}_min"] = torch.where(actor, value, float("inf")).amin()
        out[f"{name}_max"] = torch.where(actor, value, float("-inf")).amax()
    return out


def _sum_all(terms: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if not terms:
        return {}
    stacked = torch.stack([t.reshape(-1) for t in terms.values()])
    return dict(zip(terms, exact_sum(stacked).unbind(0), strict=True))


def collect_fragments(
    config: ClippedPGConfig, batch: LossInputs, terms: Terms, numerators: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Every fragment of the microbatch, in the order of the spec."""
    tokens, seqs = fragment_terms(config, batch, terms)
    found = {**_sum_all(tokens), **_sum_all(seqs), **extremes(terms)}
    found.update({name: value.detach() for name, value in numerators.items()})
    return {name: found[name] for name in fragment_kinds(config)}


def fragments_to_host(
    fragments: Mapping[str, Tensor], companions: Mapping[str, str] = EXTREME_COMPANIONS
) -> dict[str, float]:
    """Fragment values as floats, in one device-to-host transfer (the only sync).

    An extremum whose companion count is 0 (an empty mask) is omitted, so it contributes
    nothing to the step; every other value, NaN and ±inf included, is kept.
    """
    names = list(fragments)
    if not names:
        return {}
    values = torch.stack([fragments[n].to(F64) for n in names]).cpu().tolist()
    host = dict(zip(names, values, strict=True))
    return {
        name: value
        for name, value in host.items()
        if not (name in companions and host.get(companions[name], 1.0) == 0)
    }
