"""The fragments of one microbatch: additive numerators, counts and extrema.

Every mean is emitted as a numerator plus the count it divides by, never as a
per-microbatch mean, so the service divides once over the whole step. Fragments are
float64 tensors on the loss's device: a ``sum`` fragment is the **exact** sum of its
terms as ``[LIMBS]`` parts (:func:`~steptally.client.loss.exact_sum.exact_parts`), which
the reporter turns into a float64 expansion on its own thread, so the fragments of any
split of a step's tokens over ranks and microbatches add up to the same bits on the
service; counts and extrema are 0-d. Building them needs no host sync (all per-token
sums, the loss numerators' included, are one stacked exact pass over ``[K, B·T]``, all
per-sequence sums another, and the extrema one masked ``amin`` and one ``amax``).

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

from steptally.client.algebra.combine import Value
from steptally.client.algebra.exact import expansion_of
from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.exact_sum import exact_sums_and_parts
from steptally.client.loss.inputs import LossInputs
from steptally.client.loss.mismatch import mismatch_values
from steptally.client.loss.names import NUMERATOR, Fragment
from steptally.client.loss.reduction import loss_rows
from steptally.client.loss.spec import EXTREME_COMPANIONS, fragment_kinds
from steptally.client.loss.terms import Terms, approx_entropy

F = Fragment
F64 = torch.float64
Rows = dict[str, Tensor]


def _importance_terms(config: ClippedPGConfig, terms: Terms) -> tuple[Rows, Rows]:
    imp, masks = terms.importance, terms.masks
    sample = masks.sample_weight
    tokens: Rows = {}
    seqs: Rows = {}
    target = seqs if imp.per_sequence else tokens
    weight = sample if imp.per_sequence else masks.mismatch_weight
    target[F.SAMPLING_IMPORTANCE_RATIO_NUM] = imp.value * weight
    if imp.oob is not None:
        oob_weight = sample if imp.oob_per_sequence else masks.mismatch_weight
        (seqs if imp.oob_per_sequence else tokens)[F.IS_OOB_NUM] = imp.oob * oob_weight
    return tokens, seqs


def _count_terms(config: ClippedPGConfig, terms: Terms) -> Rows:
    """Counts per sequence: integer row counts (one stacked sum over the masks), times the
    sample weight for weighted ones (the same exact values as summing
    token_mask·sample_mask over each mask). A filtered count is the full count minus the
    kept one, exactly (integers)."""
    m = terms.masks
    sample = m.sample_weight
    masks = torch.stack([m.full, m.actor, m.mismatch, m.full & m.keep_curr])
    counts = masks.sum(-1, dtype=F64)
    full, actor = counts[0], counts[1]
    weighted = counts[:3] * sample
    filtered = full - counts[2:]  # full ∧ ¬keep(prev), full ∧ ¬keep(curr)
    out: Rows = {
        F.VALID_TOKENS: weighted[0],
        F.ACTOR_TOKENS: weighted[1],
        F.MISMATCH_TOKENS: weighted[2],
        F.ACTOR_POSITIONS: actor,
        F.MASK_POSITIONS: full,
        F.FILTERED_CURR_TOKENS: filtered[1],
        F.FILTERED_PREV_TOKENS: filtered[0],
        F.VALID_SEQS: sample,
    }
    if terms.correct is not None and config.nll_enabled:
        out[F.CORRECT_TOKENS] = torch.where(terms.correct, weighted[0], 0.0)
    return out


def _actor_weighted(config: ClippedPGConfig, value: Tensor, terms: Terms) -> Tensor:
    """``value`` over the actor mask times its weight. Outside the actor mask a token-level
    ratio is exp(0) (or 0), finite, so the weight's 0 is enough; a GSPO ratio repeats its
    sequence's value there, which may be ±inf or NaN, so it is masked first."""
    m = terms.masks
    if config.gspo:
        value = torch.where(m.actor, value, 0.0)
    return value * m.actor_weight


def fragment_terms(config: ClippedPGConfig, batch: LossInputs, terms: Terms) -> tuple[Rows, Rows]:
    """Per-token ``[B, T]`` and per-sequence ``[B]`` float64 terms; each fragment that is a
    sum or a count is the exact sum of one of them (counts are summed per sequence).
    Every value outside its mask is a finite value times a weight of 0."""
    m = terms.masks
    r, rc = terms.ratios.ratio.detach(), terms.ratios.clamped.detach()
    tokens: Rows = {
        F.PROBS_RATIO_NUM: _actor_weighted(config, r, terms),
        F.PROBS_RATIO_CLAMPED_NUM: _actor_weighted(config, rc, terms),
        F.APPROX_ENTROPY_NUM: approx_entropy(terms, batch.generation_logprobs) * m.actor_weight,
    }
    kind = config.reference_policy_kl_type
    for name, value in mismatch_values(
        terms.prev, batch.generation_logprobs, m.mismatch, kind
    ).items():
        tokens[NUMERATOR[name]] = value * m.mismatch_weight
    imp_tokens, seqs = _importance_terms(config, terms)
    tokens.update(imp_tokens)
    seqs.update(_count_terms(config, terms))
    return tokens, seqs


def extremes(terms: Terms) -> dict[str, Tensor]:
    """Extrema of the ratio and the clamped ratio over the actor mask (see module doc):
    one masked min and one masked max over both, in their own dtype (the float64
    conversion is exact and monotone, so it can come after)."""
    actor = terms.masks.actor
    values = torch.stack([terms.ratios.ratio.detach(), terms.ratios.clamped.detach()])
    low = torch.where(actor, values, float("inf")).amin((1, 2))
    high = torch.where(actor, values, float("-inf")).amax((1, 2))
    found = torch.cat([low, high]).to(F64).unbind(0)
    names = (
        F.PROBS_RATIO_MIN,
        F.PROBS_RATIO_CLAMPED_MIN,
        F.PROBS_RATIO_MAX,
        F.PROBS_RATIO_CLAMPED_MAX,
    )
    return dict(zip(names, found, strict=True))


def _flat(rows: Rows) -> Rows:
    return {name: value.reshape(-1) for name, value in rows.items()}


def collect_fragments(
    config: ClippedPGConfig, batch: LossInputs, terms: Terms
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The loss numerators (with grad) and every fragment of the microbatch, in the order
    of the spec. The loss's own rows join the fragments' rows, so all per-token sums are
    one stacked exact pass and all per-sequence sums another. A ``sum`` fragment is its
    exact parts ``[LIMBS]``; a count, an integer below 2**53, is their plain sum."""
    loss_tokens, loss_seqs = loss_rows(config, batch, terms)
    tokens, seqs = fragment_terms(config, batch, terms)
    token_sums, token_parts = exact_sums_and_parts(loss_tokens, _flat(tokens))
    seq_sums, seq_parts = exact_sums_and_parts(loss_seqs, seqs)
    found: dict[str, Tensor] = {**token_parts, **seq_parts}
    found.update(extremes(terms))
    kinds = fragment_kinds(config)
    for name, kind in kinds.items():
        if kind == "count":
            found[name] = found[name].sum(-1)  # integer parts: exact in any order
    return {**token_sums, **seq_sums}, {name: found[name] for name in kinds}


def fragments_to_host(
    fragments: Mapping[str, Tensor],
    companions: Mapping[str, str] = EXTREME_COMPANIONS,
    rounded: bool = False,
) -> dict[str, Value]:
    """Fragment values on the host, in one device-to-host transfer (the only sync): a
    sum's parts as its canonical exact expansion (a tuple when it has more than one term,
    as the wire takes it), so fragments combined on the host keep every bit whatever the
    split; with ``rounded``, as its correctly rounded float instead (one rounding per
    fragment: combined, those change bits with the split).

    An extremum whose companion count is 0 (an empty mask) is omitted, so it contributes
    nothing to the step; every other value, NaN and ±inf included, is kept. The
    companions default to the loss's; for :mod:`steptally.client.diagnostics` pass its
    spec's ``guards``.
    """
    names = list(fragments)
    if not names:
        return {}
    flat = torch.cat([fragments[n].to(F64).reshape(-1) for n in names]).cpu().tolist()
    host: dict[str, Value] = {}
    at = 0
    for name in names:
        size = fragments[name].numel()
        if fragments[name].dim() == 0:
            host[name] = flat[at]
        else:
            terms = expansion_of(flat[at : at + size])
            host[name] = terms[0] if rounded or len(terms) == 1 else terms
        at += size
    return {
        name: value
        for name, value in host.items()
        if not (name in companions and host.get(companions[name], 1.0) == 0)
    }
