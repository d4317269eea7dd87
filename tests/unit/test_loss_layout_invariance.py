"""Any split of a step's sequences over ranks and microbatches — one-sequence and
one-token microbatches, packed, padded or trimmed, merged in any order — gives step
values bit-identical to the whole batch in one call, for every fragment and every
derived diagnostic, with ``-inf`` on both the current and the previous side."""

from __future__ import annotations

import random
import struct
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from steptally.client.algebra import MetricResult, StepAccumulator  # noqa: E402
from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    fragments_to_host,
)
from steptally.client.loss.inputs import TOKEN_FIELDS  # noqa: E402
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.synthetic import (  # noqa: E402
    Microbatch,
    random_layout,
    rows_of,
    synthetic_microbatch,
)

pytestmark = pytest.mark.torch

CONFIGS = {
    "ppo+kl+vapo-nll": ClippedPGConfig(
        positive_example_nll_weight=0.1, kl_input_clamp_value=None, kl_output_clamp_value=None
    ),
    "gspo+tis": ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
    ),
    "seq-mask-tis+k2": ClippedPGConfig(
        token_level_loss=False,
        reference_policy_kl_type="k2",
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.02,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "icepop+dual-clip": ClippedPGConfig(
        ratio_clip_c=3.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
    "cispo": ClippedPGConfig(use_cispo=True),
    "reinforce": ClippedPGConfig(disable_ppo_ratio=True),
    "force-on-policy+k1": ClippedPGConfig(
        force_on_policy_ratio=True,
        reference_policy_kl_type="k1",
        use_on_policy_kl_approximation=True,
    ),
}


def step_batch(seed: int, dtype: torch.dtype = torch.float32) -> LossInputs:
    """All of a step's sequences in one batch, -inf on both sides, some responses of one
    token, fractional and zero sample weights (normalisers: the whole batch's own); in
    float64, token values use all 53 bits, so one rounding per microbatch would show."""
    batch = synthetic_microbatch(
        seed, 14, 33, curr_filtered=0.15, prev_filtered=0.15, requires_grad=False
    )
    mask = batch.token_mask.clone()
    for row in (1, 6):  # one-token responses
        first = int(mask[row].nonzero()[0])
        mask[row] = False
        mask[row, first] = True
    floats = {
        n: v.to(dtype)
        for n in TOKEN_FIELDS
        if (v := getattr(batch, n)) is not None and v.dtype.is_floating_point
    }
    return replace(batch, token_mask=mask, **floats)


def step_report(
    loss: ClippedPGLoss, ranks: list[list[Microbatch]], rng: random.Random
) -> dict[str, MetricResult]:
    """Each rank's fragments folded on its own, then the ranks merged in a random order."""
    spec = loss.metric_spec()
    partials = []
    for microbatches in ranks:
        acc = StepAccumulator(spec)
        for microbatch in microbatches:
            acc.add(fragments_to_host(loss(microbatch)[1]))
        partials.append(acc)
    rng.shuffle(partials)
    total = StepAccumulator(spec)
    for acc in partials:
        total.merge(acc)
    return total.report()


def bits(result: MetricResult) -> tuple[bytes | None, str | None]:
    return (None if result.value is None else struct.pack("<d", result.value)), result.reason


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_layout_gives_the_whole_batch_bits(name: str, seed: int, dtype: torch.dtype) -> None:
    loss = ClippedPGLoss(CONFIGS[name])
    batch = step_batch(seed, dtype)
    rng = random.Random(f"{name}/{seed}")
    whole = step_report(loss, [[batch]], rng)
    assert whole[D.PROBS_RATIO].value is not None and whole[D.LOSS].value is not None
    expected = {metric: bits(result) for metric, result in whole.items()}
    for _ in range(4):
        got = step_report(loss, random_layout(batch, rng), rng)
        assert {metric: bits(result) for metric, result in got.items()} == expected


def test_rounded_fragments_would_not_be_layout_invariant() -> None:
    """The failure the exact fragments remove is real on this data: one rounding per
    microbatch (the first term alone) moves some step value off the whole batch's."""
    loss = ClippedPGLoss(CONFIGS["ppo+kl+vapo-nll"])
    spec = loss.metric_spec()
    moved = 0
    for seed in range(3):
        batch = step_batch(seed, torch.float64)
        rows = list(range(batch.sample_mask.shape[0]))
        whole = StepAccumulator(spec)
        whole.add(fragments_to_host(loss(batch)[1], rounded=True))
        ones = StepAccumulator(spec)
        for row in rows:
            ones.add(
                fragments_to_host(loss(rows_of(batch, [row], random.Random(row)))[1], rounded=True)
            )
        a, b = whole.report(), ones.report()
        moved += sum(bits(a[m]) != bits(b[m]) for m in a)
    assert moved > 0
