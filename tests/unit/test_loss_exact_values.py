"""Exact values of the loss fragments on small hand-computed cases."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    fragments_to_host,
    mask_out_neg_inf_logprobs,
)
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402

pytestmark = pytest.mark.torch
INF = float("inf")


def tiny(curr, prev, gen, *, ref=None, unfiltered=None, adv=None, mask=None, sample=None):
    """One microbatch from nested lists (its normalisers are its own)."""
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    curr_t = t(curr).requires_grad_(True)
    mask_t = torch.ones(curr_t.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    sample_t = torch.ones(curr_t.shape[0]) if sample is None else t(sample)
    weight = mask_t.double() * sample_t.double()[:, None]
    return LossInputs(
        curr_logprobs=curr_t,
        prev_logprobs=t(prev),
        generation_logprobs=t(gen),
        advantages=torch.ones(curr_t.shape) if adv is None else t(adv),
        token_mask=mask_t,
        sample_mask=sample_t,
        global_valid_tokens=float(weight.sum()),
        global_valid_seqs=float(sample_t.sum()),
        reference_logprobs=None if ref is None else t(ref),
        curr_logprobs_unfiltered=None if unfiltered is None else t(unfiltered),
    )


def run(config: ClippedPGConfig, batch: LossInputs) -> dict[str, float]:
    return fragments_to_host(ClippedPGLoss(config)(batch)[1], rounded=True)


NO_KL = ClippedPGConfig(reference_policy_kl_penalty=0.0)


def test_mask_out_neg_inf_fills_zero_and_keeps_mask():
    lp = torch.tensor([[-INF, -1.0, float("nan"), -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    filled, keep = mask_out_neg_inf_logprobs(lp, mask)
    assert keep.tolist() == [[False, True, True, False]]
    assert filled[0, [0, 1, 3]].tolist() == [0.0, -1.0, 0.0]
    assert math.isnan(filled[0, 2].item())  # a NaN is data, never filtered away
    filled[0, [0, 1, 3]].sum().backward()
    assert lp.grad is not None and lp.grad.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_review_three_token_example_force_on_policy():
    # One filtered position with π_gen = e^-5. Under force_on_policy_ratio prev := sg(curr);
    # the old code reads (e^5 + 1 + 1) / 3 = 50.14 there. Narrowed, the error is exactly 1.
    batch = tiny([[-INF, -1.0, -2.0]], [[-3.0, -1.0, -2.0]], [[-5.0, -1.0, -2.0]])
    config = ClippedPGConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True)
    f = run(config, batch)
    assert f[F.TOKEN_MULT_PROB_ERROR_NUM] == 2.0
    assert f[F.MISMATCH_TOKENS] == 2.0
    assert f[F.VALID_TOKENS] == 3.0
    assert f[F.FILTERED_CURR_TOKENS] == 1.0
    assert f[F.SAMPLING_IMPORTANCE_RATIO_NUM] == 2.0
    assert f[F.PROBS_RATIO_MAX] == 1.0 and f[F.PROBS_RATIO_MIN] == 1.0
    old = (math.exp(5.0) + 2.0) / 3.0
    assert old == pytest.approx(50.14, abs=0.005)


def test_review_example_gspo_weight_is_not_e5():
    batch = tiny([[-INF, -1.0, -2.0]], [[-3.0, -1.0, -2.0]], [[-5.0, -1.0, -2.0]])
    config = ClippedPGConfig(
        reference_policy_kl_penalty=0.0,
        force_on_policy_ratio=True,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )
    f = run(config, batch)
    assert f[F.SAMPLING_IMPORTANCE_RATIO_NUM] == 1.0  # not e^5 = 148.41
    assert f[F.VALID_SEQS] == 1.0


def test_prev_side_neg_inf_narrows_instead_of_exp_curr():
    curr, prev, gen = [[-1.0, -1.5, -2.0]], [[-1.2, -INF, -2.1]], [[-1.2, -1.4, -2.1]]
    f = run(NO_KL, tiny(curr, prev, gen))
    r0, r2 = math.exp(0.2), math.exp(0.1)
    assert f[F.ACTOR_TOKENS] == 2.0 and f[F.ACTOR_POSITIONS] == 2.0
    assert f[F.FILTERED_PREV_TOKENS] == 1.0 and f[F.FILTERED_CURR_TOKENS] == 0.0
    assert f[F.PROBS_RATIO_NUM] == pytest.approx(r0 + r2, rel=1e-6)
    assert f[F.PROBS_RATIO_MIN] == pytest.approx(r2, rel=1e-6)  # exp(curr) = 0.22 is gone
    assert f[F.PROBS_RATIO_MAX] == pytest.approx(r0, rel=1e-6)
    assert f[F.MISMATCH_TOKENS] == 2.0  # the mismatch narrows by the prev keep mask
    assert f[F.TOKEN_MULT_PROB_ERROR_NUM] == pytest.approx(2.0, rel=1e-6)
    assert f[F.VALID_TOKENS] == 3.0  # the normaliser keeps the full mask


def test_curr_side_neg_inf_narrows_actor_but_not_kl_or_mismatch():
    curr, unf = [[-INF, -1.0, -2.0]], [[-4.0, -1.0, -2.0]]
    prev, gen, ref = [[-3.0, -1.1, -2.0]], [[-3.0, -1.1, -2.2]], [[-3.5, -1.0, -2.5]]
    config = ClippedPGConfig(kl_input_clamp_value=None, kl_output_clamp_value=None)
    f = run(config, tiny(curr, prev, gen, ref=ref, unfiltered=unf))
    k3 = [math.exp(r - c) - 1 - (r - c) for r, c in zip(ref[0], unf[0], strict=True)]
    assert f[F.KL_PENALTY_NUM] == pytest.approx(sum(k3), rel=1e-6)  # includes position 0
    assert f[F.ACTOR_TOKENS] == 2.0 and f[F.MISMATCH_TOKENS] == 3.0
    assert f[F.PROBS_RATIO_MAX] == pytest.approx(math.exp(0.1), rel=1e-6)  # not e^3
    expected = math.exp(0.0) + math.exp(0.0) + math.exp(0.2)
    assert f[F.TOKEN_MULT_PROB_ERROR_NUM] == pytest.approx(expected, rel=1e-6)


def test_token_level_loss_value_and_scale():
    curr, prev, gen = [[-1.0, -1.0]], [[-1.5, -0.5]], [[-1.5, -0.5]]
    batch = tiny(curr, prev, gen, adv=[[1.0, -2.0]])
    loss, frags = ClippedPGLoss(NO_KL)(batch)
    r = [math.exp(0.5), math.exp(-0.5)]
    # A=+1: max(-r, -clamp(r)) = -1.2 ; A=-2: max(2r, 2·clamp) = 2·0.8 = 1.6
    terms = [max(-r[0], -min(r[0], 1.2)), max(2 * r[1], 2 * max(r[1], 0.8))]
    assert fragments_to_host(frags, rounded=True)[F.ACTOR_LOSS_NUM] == pytest.approx(
        sum(terms), rel=1e-6
    )
    assert float(loss.detach()) == pytest.approx(sum(terms) / 2, rel=1e-6)


def test_gspo_sampling_ratio_is_right_for_many_sequences():
    # w_i = exp(Σ_t (prev - gen)·M); Σ_i w_i·m_i, not (Σ w)(Σ m) as the framework's broadcast
    prev = [[-1.0, -1.0], [-2.0, -2.0], [-1.0, -3.0]]
    gen = [[-1.1, -1.0], [-2.0, -2.2], [-1.0, -3.0]]
    sample = [1.0, 0.5, 1.0]
    config = ClippedPGConfig(
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )
    f = run(config, tiny(prev, prev, gen, sample=sample))
    w = [math.exp(0.1), math.exp(0.5 * 0.2), 1.0]
    assert f[F.SAMPLING_IMPORTANCE_RATIO_NUM] == pytest.approx(w[0] + 0.5 * w[1] + w[2], rel=1e-6)
    assert f[F.VALID_SEQS] == 2.5


def test_empty_actor_mask_omits_extrema_and_keeps_counts():
    batch = tiny([[-INF, -INF]], [[-1.0, -1.0]], [[-1.0, -1.0]])
    loss, frags = ClippedPGLoss(NO_KL)(batch)
    host = fragments_to_host(frags, rounded=True)
    assert host[F.ACTOR_POSITIONS] == 0.0 and host[F.FILTERED_CURR_TOKENS] == 2.0
    assert not any(name.endswith(("_min", "_max")) for name in host)
    assert float(frags[F.PROBS_RATIO_MIN]) == INF  # the device value is the neutral one
    assert float(loss.detach()) == 0.0


def test_sequence_level_loss_divides_by_original_token_count():
    curr, prev = [[-1.0, -INF, -1.0, -1.0]], [[-1.0, -1.0, -1.0, -1.0]]
    config = ClippedPGConfig(reference_policy_kl_penalty=0.0, token_level_loss=False)
    loss, f = ClippedPGLoss(config)(tiny(curr, prev, prev, adv=[[1.0] * 4]))
    # three retained tokens of ratio 1 contribute -1 each; the row keeps its 4 tokens
    assert fragments_to_host(f, rounded=True)[F.ACTOR_LOSS_NUM] == -0.75
    assert float(loss.detach()) == -0.75


def test_the_spec_guards_make_raw_device_values_safe_to_send():
    """Sent without fragments_to_host (every key, the neutral ±inf included), the
    fragments of an empty-mask microbatch still contribute no extremum: the spec's
    guards skip them, exactly as the host-side omission does."""
    from steptally.client.algebra import StepAccumulator

    loss_fn = ClippedPGLoss(NO_KL)
    empty = tiny([[-INF, -INF]], [[-1.0, -1.0]], [[-1.0, -1.0]])
    full = tiny([[-1.0, -1.2]], [[-1.1, -1.0]], [[-1.0, -1.0]])
    raw, filtered = StepAccumulator(loss_fn.metric_spec()), StepAccumulator(loss_fn.metric_spec())
    for batch in (empty, full):
        frags = loss_fn(batch)[1]
        raw.add(fragments_to_host(frags, companions={}))  # nothing omitted
        filtered.add(fragments_to_host(frags))
    assert raw.report() == filtered.report()
    only_full = fragments_to_host(loss_fn(full)[1], rounded=True)[F.PROBS_RATIO_MIN]
    assert raw.report()[F.PROBS_RATIO_MIN].value == only_full
    assert math.isfinite(only_full)
    assert loss_fn.metric_spec().guards[F.PROBS_RATIO_MAX] == F.ACTOR_POSITIONS


def test_js_divergence_is_the_seeds_half_sum_from_p_minus_m():
    # e^prev = 0.2, e^gen = 0.6: m = log 0.4, h(prev) = 0.5 - ln 0.5 - 1, h(gen) = 1.5 - ln 1.5
    # - 1, so ½(h(prev) + h(gen)) = ½ ln(4/3) (from m - p it would be ⅓ - ½ ln(4/3))
    from steptally.client.loss.mismatch import mismatch_values

    prev = torch.tensor([[math.log(0.2)]], dtype=torch.float64)
    gen = torch.tensor([[math.log(0.6)]], dtype=torch.float64)
    mask = torch.tensor([[True]])
    js = mismatch_values(prev, gen, mask, "k3")[D.JS_DIVERGENCE_ERROR]
    assert js.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-14, abs=0)
    f = run(NO_KL, tiny([[-1.0]], [[math.log(0.2)]], [[math.log(0.6)]]))
    assert f[F.JS_DIVERGENCE_ERROR_NUM] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert f[F.JS_DIVERGENCE_ERROR_NUM] != pytest.approx(1 / 3 - 0.5 * math.log(4 / 3), rel=0.1)
