"""Fragments of uneven microbatches over simulated ranks, combined by the algebra, equal the
single-pass global computation over all tokens bit for bit: counts, and every numerator
as the exact sum of the same terms rounded once (each fragment carries its exact sum)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")

from steptally.client.algebra import StepAccumulator  # noqa: E402
from steptally.client.loss import ClippedPGConfig, ClippedPGLoss, fragments_to_host  # noqa: E402
from steptally.client.loss.fragments import fragment_terms  # noqa: E402
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402
from steptally.client.loss.spec import fragment_kinds  # noqa: E402
from steptally.client.loss.synthetic import synthetic_step, with_global_normalisers  # noqa: E402
from steptally.client.loss.terms import compute_terms  # noqa: E402

pytestmark = pytest.mark.torch

CONFIGS = {
    "default+nll": ClippedPGConfig(positive_example_nll_weight=0.1),
    "gspo+tis": ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
    ),
    "seq-mask-tis": ClippedPGConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.02,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "force": ClippedPGConfig(force_on_policy_ratio=True),
}


def step_batches(seed):
    ranks = synthetic_step(seed, (3, 1, 2), sequences=5, max_len=40)
    empty = replace(ranks[1][0], sample_mask=torch.zeros_like(ranks[1][0].sample_mask))
    ranks[1].append(empty)  # a microbatch with nothing valid: contributes only zeros
    flat = with_global_normalisers([b for rank in ranks for b in rank])
    it = iter(flat)
    return [[next(it) for _ in rank] for rank in ranks]


def exact_sums(config, batches):
    """Exact (Fraction) sum of every summed fragment's per-token terms over all batches."""
    total: dict[str, Fraction] = {}
    for b in batches:
        tokens, seqs = fragment_terms(config, b, compute_terms(config, b))
        for name, value in {**tokens, **seqs}.items():
            terms = sum(map(Fraction, value.flatten().tolist()))
            total[name] = total.get(name, Fraction(0)) + terms
    return total


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_ranks_combine_to_the_global_single_pass(name, seed):
    config = CONFIGS[name]
    loss = ClippedPGLoss(config)
    ranks = step_batches(seed)
    per_rank, loss_sum = [], 0.0
    for rank in ranks:
        acc = StepAccumulator(loss.metric_spec())
        for b in rank:
            value, frags = loss(b)
            loss_sum += float(value.detach())
            acc.add(fragments_to_host(frags))
        per_rank.append(acc)
    random.Random(seed).shuffle(per_rank)
    combined = StepAccumulator(loss.metric_spec())
    for acc in per_rank:
        combined.merge(acc)
    report = combined.report()
    flat = [b for rank in ranks for b in rank]
    exact = exact_sums(config, flat)
    assert set(exact) <= set(fragment_kinds(config))
    for metric, total in exact.items():
        assert report[metric].value == float(total), metric  # rounded once, to the last bit
    for mean in (D.PROBS_RATIO, D.APPROX_ENTROPY, D.TOKEN_MULT_PROB_ERROR):
        num = exact[f"{mean}_num"]
        den = exact[F.ACTOR_TOKENS if mean != D.TOKEN_MULT_PROB_ERROR else F.MISMATCH_TOKENS]
        assert report[mean].value == float(num / den)  # the exact quotient, rounded once
    assert report[F.VALID_TOKENS].value == flat[0].global_valid_tokens
    assert report[F.VALID_SEQS].value == flat[0].global_valid_seqs
    assert report[D.LOSS].value == pytest.approx(loss_sum, rel=1e-5)


def test_extrema_are_the_global_extrema():
    config = CONFIGS["default+nll"]
    ranks = step_batches(3)
    combined = StepAccumulator(ClippedPGLoss(config).metric_spec())
    values = []
    for b in (b for rank in ranks for b in rank):
        combined.add(fragments_to_host(ClippedPGLoss(config)(b)[1]))
        t = compute_terms(config, b)
        values += t.ratios.ratio.detach()[t.masks.actor].double().tolist()
    report = combined.report()
    assert report[F.PROBS_RATIO_MIN].value == min(values)
    assert report[F.PROBS_RATIO_MAX].value == max(values)


def test_mean_of_microbatch_means_differs_from_the_exact_mean():
    """The failure this design removes is real on this data."""
    config = CONFIGS["default+nll"]
    frags = [
        fragments_to_host(ClippedPGLoss(config)(b)[1], rounded=True)
        for rank in step_batches(4)
        for b in rank
    ]
    means = [f[F.PROBS_RATIO_NUM] / f[F.ACTOR_TOKENS] for f in frags if f[F.ACTOR_TOKENS] > 0]
    exact = math.fsum(f[F.PROBS_RATIO_NUM] for f in frags) / math.fsum(
        f[F.ACTOR_TOKENS] for f in frags
    )
    assert abs(sum(means) / len(means) - exact) > 1e-6
