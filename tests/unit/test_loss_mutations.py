"""A semantics checker for the loss, and proof that it goes red under each known mutation.

The checker runs four scenarios; each mutation is applied with ``monkeypatch`` (or a
wrapper) in this file only, never in production code, and the checker must report it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from steptally.client.algebra import StepAccumulator  # noqa: E402
from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    fragments_to_host,
    terms,
)
from steptally.client.loss.masks import mask_out_neg_inf_logprobs  # noqa: E402
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402
from steptally.client.loss.spec import metric_spec  # noqa: E402

pytestmark = pytest.mark.torch
INF = float("inf")
LossFactory = Callable[[ClippedPGConfig], Callable[[LossInputs], tuple]]


def batch(curr, prev, gen, ref=None, unf=None, n_tok=None):
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    shape = (len(curr), len(curr[0]))
    return LossInputs(
        curr_logprobs=t(curr),
        prev_logprobs=t(prev),
        generation_logprobs=t(gen),
        advantages=torch.ones(shape),
        token_mask=torch.ones(shape, dtype=torch.bool),
        sample_mask=torch.ones(shape[0]),
        global_valid_tokens=float(n_tok or shape[0] * shape[1]),
        global_valid_seqs=1.0,
        reference_logprobs=None if ref is None else t(ref),
        curr_logprobs_unfiltered=None if unf is None else t(unf),
    )


def _curr_filtered(make: LossFactory) -> list[str]:
    config = ClippedPGConfig(kl_input_clamp_value=None, kl_output_clamp_value=None)
    unf, ref = [[-4.0, -1.0, -2.0]], [[-3.0, -1.2, -2.0]]
    b = batch([[-INF, -1.0, -2.0]], [[-3.0, -1.1, -2.0]], [[-3.0, -1.1, -2.0]], ref, unf)
    f = fragments_to_host(make(config)(b)[1], rounded=True)
    kl = sum(math.exp(r - c) - 1 - (r - c) for r, c in zip(ref[0], unf[0], strict=True))
    problems = []
    if f[F.ACTOR_TOKENS] != 2.0 or f[F.PROBS_RATIO_MAX] > 1.2:
        problems.append("curr -inf reaches the actor reductions")
    if f[F.VALID_TOKENS] != 3.0 or f[F.KL_PENALTY_NUM] != pytest.approx(kl, rel=1e-6):
        problems.append("the reference KL is narrowed by the keep mask")
    if f[F.MISMATCH_TOKENS] != 3.0:
        problems.append("the mismatch diagnostics are narrowed by the current keep mask")
    return problems


def _prev_filtered(make: LossFactory) -> list[str]:
    b = batch([[-1.0, -1.5, -2.0]], [[-1.2, -INF, -2.1]], [[-1.2, -1.4, -2.1]])
    f = fragments_to_host(
        make(ClippedPGConfig(reference_policy_kl_penalty=0.0))(b)[1], rounded=True
    )
    problems = []
    if f[F.ACTOR_TOKENS] != 2.0 or f[F.PROBS_RATIO_MIN] < 1.0:
        problems.append("prev -inf makes an exp(curr) ratio")
    if f[F.MISMATCH_TOKENS] != 2.0:
        problems.append("prev -inf reaches the mismatch diagnostics")
    return problems


def _force_on_policy(make: LossFactory) -> list[str]:
    config = ClippedPGConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True)
    b = batch([[-INF, -1.0, -2.0]], [[-3.0, -1.0, -2.0]], [[-5.0, -1.0, -2.0]])
    f = fragments_to_host(make(config)(b)[1], rounded=True)
    error = f[F.TOKEN_MULT_PROB_ERROR_NUM] / f[F.MISMATCH_TOKENS]
    return [] if error == 1.0 else [f"token_mult_prob_error reads {error:.2f}, not 1"]


def _uneven_microbatches(make: LossFactory) -> list[str]:
    config = ClippedPGConfig(reference_policy_kl_penalty=0.0)
    big = batch([[-1.0] * 6], [[-1.5] * 6], [[-1.5] * 6], n_tok=7)
    small = batch([[-1.0]], [[-0.5]], [[-0.5]], n_tok=7)
    acc = StepAccumulator(metric_spec(config))
    for b in (big, small):
        acc.add(fragments_to_host(make(config)(b)[1]))
    ratios = [float(torch.tensor(0.5).exp())] * 6 + [float(torch.tensor(-0.5).exp())]
    value = acc.report()[D.PROBS_RATIO].value
    expected = math.fsum(ratios) / 7
    return (
        []
        if value == pytest.approx(expected, rel=1e-12)
        else [f"probs_ratio over uneven microbatches is {value}, not {expected}"]
    )


def semantic_failures(make: LossFactory) -> list[str]:
    """Every violated semantic rule, by scenario; empty when the loss is right."""
    return [
        *_curr_filtered(make),
        *_prev_filtered(make),
        *_force_on_policy(make),
        *_uneven_microbatches(make),
    ]


def _keep_ignored(monkeypatch) -> LossFactory:
    def ignore(logprobs, mask):
        filled, _ = mask_out_neg_inf_logprobs(logprobs, mask)
        return filled, mask.to(torch.bool)

    monkeypatch.setattr(terms, "mask_out_neg_inf_logprobs", ignore)
    return ClippedPGLoss


def _keep_folded_into_token_mask(monkeypatch) -> LossFactory:
    real = terms.build_masks

    def fold(token_mask, sample_mask, keep_curr, keep_prev):
        return real(token_mask & keep_curr & keep_prev, sample_mask, keep_curr, keep_prev)

    monkeypatch.setattr(terms, "build_masks", fold)
    return ClippedPGLoss


def _prev_keep_ignored(monkeypatch) -> LossFactory:
    real = terms.previous_side

    def ignore(config, b, curr, keep_curr):
        prev, _ = real(config, b, curr, keep_curr)
        return prev, b.token_mask.to(torch.bool)

    monkeypatch.setattr(terms, "previous_side", ignore)
    return ClippedPGLoss


def _means_per_microbatch(monkeypatch) -> LossFactory:
    def make(config):
        loss = ClippedPGLoss(config)
        spec = loss.metric_spec()

        def call(b):
            value, frags = loss(b)
            out = dict(frags)
            for expr in spec.derived.values():
                num, _, den = expr.partition(" / ")
                if num.endswith("_num") and den in frags:
                    out[num] = frags[num] / frags[den]
            for name in (F.ACTOR_TOKENS, F.MISMATCH_TOKENS, F.VALID_TOKENS, F.VALID_SEQS):
                out[name] = torch.ones_like(frags[name])
            return value, out

        return call

    return make


MUTATIONS = {
    "keep mask ignored": (_keep_ignored, "curr -inf reaches the actor reductions"),
    "keep mask folded into token_mask": (
        _keep_folded_into_token_mask,
        "the reference KL is narrowed by the keep mask",
    ),
    "previous keep mask ignored": (_prev_keep_ignored, "prev -inf makes an exp(curr) ratio"),
    "per-microbatch means averaged": (_means_per_microbatch, "probs_ratio over uneven"),
}


def test_semantics_hold_for_the_loss():
    assert semantic_failures(ClippedPGLoss) == []


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_checker_detects_mutation(mutation, monkeypatch):
    apply, expected = MUTATIONS[mutation]
    failures = semantic_failures(apply(monkeypatch))
    assert any(f.startswith(expected) for f in failures), failures


def test_keep_ignored_reproduces_the_old_50_14(monkeypatch):
    make = _keep_ignored(monkeypatch)
    config = ClippedPGConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True)
    b = batch([[-INF, -1.0, -2.0]], [[-3.0, -1.0, -2.0]], [[-5.0, -1.0, -2.0]])
    f = fragments_to_host(make(config)(b)[1], rounded=True)
    old = f[F.TOKEN_MULT_PROB_ERROR_NUM] / f[F.MISMATCH_TOKENS]
    assert old == pytest.approx(50.14, abs=0.005)


def test_unmutated_loss_is_unchanged_after_mutation_tests():
    b = replace(batch([[-1.0]], [[-1.0]], [[-1.0]]), global_valid_tokens=1.0)
    assert (
        fragments_to_host(
            ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.0))(b)[1], rounded=True
        )[F.PROBS_RATIO_NUM]
        == 1.0
    )
