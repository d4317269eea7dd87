"""Every loss diagnostic equals an independent float64 reference on random batches.

The reference here is written from the definitions alone (the loss semantics of the
reference framework and Steptally's mask rules), in plain Python over floats and
Fractions; of the loss it imports only the public entry points that run it. Masks:

- full = token_mask ∧ sample_mask > 0; the reference KL and the normalisers read it;
- actor = full ∧ keep(curr) ∧ keep(prev): ratio, clamped ratio, their extrema, entropy,
  the surrogate (both reduction modes), the GSPO sequence ratio, the NLL;
- mismatch = full ∧ keep(prev): the four mismatch metrics and the importance weights;
- keep(x) = token_mask ∧ x ≠ -inf (and, on the previous side, ∧ prev_keep_mask); under
  force_on_policy_ratio the previous side *is* the current one, keep mask included.

Each step value is Σ numerator / Σ count over the whole batch. The project's values come
from random microbatch splits of the same batch, combined by the project's algebra.

Tolerances. Counts, weighted counts (sample weights are powers of two), extrema of
values computed without exp/log, and sums of such values are compared exactly. A value
that goes through exp or log may differ by an ulp or so between libm and torch, so it is
compared within 1e-12 of the float64 scale of its terms (Σ |weight|·|largest
intermediate|): far below anything a wrong mask, sign or denominator moves. Inputs are
float64, so the project's exp runs at the reference's precision.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")

from support.loss_reference import (  # noqa: E402
    REL,
    Batch,
    Expected,
    Grid,
    Reference,
    expected_values,
    random_batch,
    reference,
)

from steptally.client.algebra import StepAccumulator  # noqa: E402
from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    fragments_to_host,
)
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402

pytestmark = pytest.mark.torch

IS_TIS = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"}
CONFIGS = {
    "ppo+kl-k3(default)": ClippedPGConfig(),
    "ppo+kl-k1-clamped-on-policy+nll": ClippedPGConfig(
        reference_policy_kl_type="k1",
        kl_input_clamp_value=0.15,
        kl_output_clamp_value=0.1,
        use_on_policy_kl_approximation=True,
        positive_example_nll_weight=0.1,
        ratio_clip_min=0.1,
        ratio_clip_max=0.28,
    ),
    "gspo+tis": ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        truncated_importance_sampling_ratio=1.05,
        **IS_TIS,  # type: ignore[arg-type]
    ),
    "gspo+icepop+kl-k2": ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        reference_policy_kl_type="k2",
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.2,
        truncated_importance_sampling_ratio_min=0.8,
    ),
    "sequence-level+seq-mask-tis": ClippedPGConfig(
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.02,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "icepop+dual-clip": ClippedPGConfig(
        ratio_clip_c=1.1,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
    "tis-with-min+nll": ClippedPGConfig(
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.97,
        positive_example_nll_weight=0.3,
        **IS_TIS,  # type: ignore[arg-type]
    ),
    "is-correction-only": ClippedPGConfig(use_importance_sampling_correction=True),
    "cispo": ClippedPGConfig(use_cispo=True),
    "reinforce-no-kl": ClippedPGConfig(disable_ppo_ratio=True, reference_policy_kl_penalty=0.0),
    "force-on-policy+tis": ClippedPGConfig(
        force_on_policy_ratio=True,
        truncated_importance_sampling_ratio=1.1,
        **IS_TIS,  # type: ignore[arg-type]
    ),
}


# --- random batches, as plain Python lists --------------------------------------------


# --- the project's step values --------------------------------------------------------


def tensors(b: Batch, rows: list[int], ref: Reference) -> LossInputs:
    """Rows ``rows`` of the batch as one microbatch, with the step's global normalisers."""

    def grid(values: Grid) -> torch.Tensor:
        return torch.tensor([values[i] for i in rows], dtype=torch.float64)

    c = ref.counts
    return LossInputs(
        curr_logprobs=grid(b.curr),
        prev_logprobs=grid(b.prev),
        generation_logprobs=grid(b.gen),
        advantages=grid(b.adv),
        token_mask=torch.tensor([b.token[i] for i in rows]),
        sample_mask=torch.tensor([b.sample[i] for i in rows], dtype=torch.float64),
        global_valid_tokens=float(c[F.VALID_TOKENS]),
        global_valid_seqs=float(c[F.VALID_SEQS]),
        reference_logprobs=grid(b.ref),
        curr_logprobs_unfiltered=grid(b.unfiltered),
        prev_keep_mask=None
        if b.prev_keep is None
        else torch.tensor([b.prev_keep[i] for i in rows]),
        rewards=torch.tensor([b.reward[i] for i in rows], dtype=torch.float64),
        global_correct_tokens=float(c.get(F.CORRECT_TOKENS, Fraction(1))),
    )


def project_step(
    config: ClippedPGConfig, b: Batch, ref: Reference, rng: random.Random
) -> tuple[dict[str, float | None], float]:
    """The batch cut into random microbatches, their fragments combined by the algebra;
    and the sum of the microbatch losses."""
    loss = ClippedPGLoss(config)
    order = list(range(len(b.token)))
    rng.shuffle(order)
    acc = StepAccumulator(loss.metric_spec())
    loss_sum = 0.0
    while order:
        size = rng.randint(1, 4)
        rows, order = order[:size], order[size:]
        value, fragments = loss(tensors(b, rows, ref))
        loss_sum += float(value)
        acc.add(fragments_to_host(fragments))
    return {name: result.value for name, result in acc.report().items()}, loss_sum


def close(got: float | None, want: Expected) -> bool:
    if want.value is None or got is None:
        return got is want.value
    if want.tol == 0.0:
        return got == want.value
    return abs(got - want.value) <= want.tol


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_diagnostic_equals_the_reference(name: str, seed: int) -> None:
    config = CONFIGS[name]
    batch = random_batch(seed * 101 + 7, prev_keep=seed != 0)
    ref = reference(config, batch)
    want = expected_values(config, ref)
    got, loss_sum = project_step(config, batch, ref, random.Random(f"{name}/{seed}"))
    # every name of the spec has a reference value: a new diagnostic without one fails here
    assert set(want) == set(ClippedPGLoss(config).metric_spec().names())
    wrong = {n: (got[n], want[n].value, want[n].tol) for n in want if not close(got[n], want[n])}
    assert not wrong
    assert want[D.LOSS].value is not None
    assert abs(loss_sum - want[D.LOSS].value) <= want[D.LOSS].tol + REL * abs(loss_sum)


def test_the_batches_reach_every_branch() -> None:
    """The random batches are not vacuous: filtering on both sides, ratios clamped at both
    bounds, out-of-bounds importance weights, a zero and fractional sample weights."""
    clamped: set[float] = set()
    for seed in (0, 1, 2):
        batch = random_batch(seed * 101 + 7, prev_keep=seed != 0)
        ref = reference(CONFIGS["icepop+dual-clip"], batch)
        c = ref.counts
        assert c[F.FILTERED_CURR_TOKENS] > 0 and c[F.FILTERED_PREV_TOKENS] > 0
        assert 0 < c[F.ACTOR_TOKENS] < c[F.MISMATCH_TOKENS] < c[F.VALID_TOKENS]
        assert 0 < ref.sums[F.IS_OOB_NUM].total < c[F.MISMATCH_TOKENS]
        assert 0.0 in batch.sample and {0.5, 0.25} & set(batch.sample)
        clamped |= {v for v, _ in ref.extremes[F.PROBS_RATIO_CLAMPED_MIN].values}
    assert {0.8, 1.2} <= clamped
