"""Packed and regular inputs give bit-identical fragments, losses and gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    pack,
    unpack,
)
from steptally.client.loss.inputs import TOKEN_FIELDS  # noqa: E402
from steptally.client.loss.packing import sequence_lengths  # noqa: E402
from steptally.client.loss.spec import fragment_kinds  # noqa: E402
from steptally.client.loss.synthetic import synthetic_microbatch  # noqa: E402

pytestmark = pytest.mark.torch

CONFIGS = [
    ClippedPGConfig(positive_example_nll_weight=0.1),
    ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
    ClippedPGConfig(
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.02,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    ClippedPGConfig(force_on_policy_ratio=True, use_on_policy_kl_approximation=True),
]


def widened(batch: LossInputs, extra: int) -> LossInputs:
    """The same tokens with ``extra`` more padding columns (garbage logprobs in them)."""

    def pad(name, value):
        fill = float("nan") if value.dtype.is_floating_point else 0
        tail = torch.full((value.shape[0], extra), fill, dtype=value.dtype)
        return torch.cat([value.detach(), tail], 1).requires_grad_(value.requires_grad)

    return replace(
        batch, **{n: pad(n, v) for n in TOKEN_FIELDS if (v := getattr(batch, n)) is not None}
    )


def leaves(packed):
    """The packed form with its current logprobs as fresh leaves (``pack`` concatenates)."""
    t = packed.tokens
    return replace(
        packed,
        tokens=replace(
            t,
            curr_logprobs=t.curr_logprobs.detach().requires_grad_(True),
            curr_logprobs_unfiltered=t.curr_logprobs_unfiltered.detach().requires_grad_(True),
        ),
    )


def fragments(config, inputs):
    loss, frags = ClippedPGLoss(config)(inputs)
    return loss, frags


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(CONFIGS.index(c)))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("extra", [0, 13])
def test_packed_equals_regular_bitwise(config, seed, extra):
    regular = synthetic_microbatch(seed, sequences=6, max_len=37)
    packed = leaves(pack(regular))
    if extra:
        regular = widened(regular, extra)
    loss_r, frags_r = fragments(config, regular)
    loss_p, frags_p = fragments(config, packed)
    assert list(frags_r) == list(frags_p)
    kinds = fragment_kinds(config)
    for name in frags_r:
        a, b = frags_r[name], frags_p[name]
        assert a.dtype == torch.float64 and a.dim() == (1 if kinds[name] == "sum" else 0)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    assert torch.equal(loss_r, loss_p)
    loss_r.backward()
    loss_p.backward()
    grad_r = regular.curr_logprobs.grad
    grad_p = unpack(
        replace(
            packed, tokens=replace(packed.tokens, curr_logprobs=packed.tokens.curr_logprobs.grad)
        )
    ).curr_logprobs
    width = grad_p.shape[1]
    assert torch.equal(grad_r[:, :width], grad_p)
    assert not grad_r[:, width:].any()


def test_pack_unpack_round_trip():
    regular = synthetic_microbatch(5, sequences=3, max_len=20, requires_grad=False)
    lengths = sequence_lengths(regular)
    packed = pack(regular, lengths)
    assert packed.cu_seqlens.tolist()[-1] == sum(lengths) == packed.tokens.curr_logprobs.numel()
    back = unpack(packed)
    width = max(lengths)
    for name in TOKEN_FIELDS:
        a, b = getattr(regular, name), getattr(back, name)
        if a is None:
            continue
        keep = torch.arange(a.shape[1])[None, :width] < torch.tensor(lengths)[:, None]
        assert torch.equal(torch.where(keep, a[:, :width], 0), torch.where(keep, b, 0)), name


def test_packed_with_trailing_padding():
    regular = synthetic_microbatch(7, sequences=3, max_len=16)
    packed = pack(regular)
    pad = {
        n: torch.cat([v.detach(), torch.zeros(5, dtype=v.dtype)]).requires_grad_(v.requires_grad)
        for n in TOKEN_FIELDS
        if (v := getattr(packed.tokens, n)) is not None
    }
    padded = replace(packed, tokens=replace(packed.tokens, **pad))
    a = fragments(CONFIGS[0], packed)[1]
    b = fragments(CONFIGS[0], padded)[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
