"""Exact sums: the same bits whatever the layout, padding, order or device.

A plain ``tensor.sum`` rounds along a reduction tree that depends on the shape, the
kernel and the device, so the same tokens laid out as a padded ``[B, T]`` batch or as a
packed sequence give sums that differ in the last bits. :func:`exact_sum` instead adds
every value *exactly*, into integer limbs (a superaccumulator, as in Neal's "small
superaccumulator"): a finite float64 is ``m · 2**(p - 1074)`` with an integer ``m`` of at
most 53 bits and ``0 <= p <= 2045``; its bits land in three 32-bit digits of the limbs
``p // 32 … p // 32 + 2``, where limb ``j`` is worth ``2**(32 j - 1074)``. Integer
addition is exact and associative, so the limbs — and everything computed from them —
are the same for any arrangement of the same multiset of values, however far apart
their magnitudes and however much they cancel (``[1.0, 1e200, -1e200]`` sums to 1.0).

The limbs are read out as a float64 within one ulp of the exact sum: two carry passes
bring every limb below the top into ``[-1, 2**32]``, each limb is scaled to an exact
float64, and the limbs are added from the top down, where every addition is exact until
the partial sum needs more than 53 bits, after which what remains is below one ulp.
Zeros (padding, masked positions) add nothing; a sum of only ``-0.0`` is ``+0.0``.
:func:`exact_parts` stops one step earlier: the limbs scaled to float64 parts, each
exact, which a sum fragment carries to the host so that nothing is rounded before the
service adds the fragments of a whole step.

The sum is differentiable: its gradient is 1 for every element, as for ``tensor.sum``.
Non-finite values are data: a row holding an inf or a NaN gives the plain IEEE sum (as
IEEE arithmetic gives it in any order); an exact sum beyond the float64 range is
±inf. Rows of up to 2**29 values are exact (no int64 limb can overflow). Everything runs
on the values' device without autograd and without a host sync; the gradient rides on
``plain - plain.detach()``, which is exactly 0. Rows are summed independently, so
:func:`exact_sums` stacks many same-shaped rows into one call (one set of kernels
instead of one per row) without changing a bit of any of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

_DIGIT = 32
_MASK = (1 << _DIGIT) - 1
# the largest finite float64 has p = 2045: digits up to limb 2045 // 32 + 2 = 65
LIMBS = 66
_CARRY_PASSES = 2  # |limb| < 2**53 → carries below 2**21 → carries in {-1, 0, 1}


def _digits(values: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For float64 ``values``: the lowest limb each value touches and its three signed
    digits, ``x = (d0 + d1·2**32 + d2·2**64) · 2**(32·limb - 1074)`` exactly (0 for an
    inf or a NaN, whose rows the caller answers otherwise)."""
    bits = values.view(torch.int64)
    biased = (bits >> 52) & 0x7FF
    mantissa = (bits & ((1 << 52) - 1)) | (biased.clamp(max=1) << 52)  # implicit bit
    mantissa = mantissa.masked_fill_(biased == 0x7FF, 0)
    sign = bits >> 63  # 0, or -1 for a negative value
    mantissa = (mantissa ^ sign) - sign
    shift = (biased - 1).clamp(min=0)  # x = mantissa · 2**(shift - 1074), subnormals too
    limb, offset = shift >> 5, shift & (_DIGIT - 1)
    low = (mantissa & _MASK) << offset  # below 2**63
    high = (mantissa >> _DIGIT) << offset  # |high| below 2**52
    return limb, low & _MASK, (low >> _DIGIT) + (high & _MASK), high >> _DIGIT


def limbs(values: Tensor) -> Tensor:
    """The exact sum of the finite float64 ``values`` along the last dimension, as
    ``[..., LIMBS]`` int64 limbs (limb ``j`` worth ``2**(32 j - 1074)``), carried so that
    every limb below the top lies in ``[-1, 2**32]``."""
    lead = values.shape[:-1]
    flat = values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1)
    rows = flat.shape[0]
    limb, d0, d1, d2 = _digits(flat)
    index = (limb + LIMBS * torch.arange(rows, device=flat.device).unsqueeze(1)).reshape(-1)
    acc = torch.zeros(rows * LIMBS, dtype=torch.int64, device=flat.device)
    acc.index_add_(0, index, d0.reshape(-1))
    acc[1:].index_add_(0, index, d1.reshape(-1))  # limb + 2 <= 65: never crosses a row
    acc[2:].index_add_(0, index, d2.reshape(-1))
    acc = acc.view(rows, LIMBS)
    for _ in range(_CARRY_PASSES):
        carry = acc[:, :-1] >> _DIGIT
        acc = torch.cat([acc[:, :-1] & _MASK, acc[:, -1:]], dim=1)
        acc[:, 1:] += carry
    return acc.view(*lead, LIMBS)


def _scales(device: torch.device) -> Tensor:
    """``2**(32 j - 1074)`` for every limb, from its bits (exact on every device): the
    biased exponent for a normal power, the lone mantissa bit ``32 j`` for a subnormal."""
    position = torch.arange(LIMBS, dtype=torch.int64, device=device) * _DIGIT
    biased = position - 1074 + 1023
    return torch.where(biased >= 1, biased << 52, 1 << position.clamp(max=52)).view(torch.float64)


def to_parts(acc: Tensor) -> Tensor:
    """Carried ``limbs`` as float64 parts ``[..., LIMBS]``, each exact (a limb below the
    top has at most 33 bits), whose real sum is the limbs' value: a sum fragment's exact
    value, which the reporter turns into an expansion on its own thread."""
    return acc.to(torch.float64) * _scales(acc.device)


def read_out(acc: Tensor) -> Tensor:
    """The float64 within one ulp of the exact value of carried ``limbs``."""
    return _add_down(to_parts(acc))


def _add_down(parts: Tensor) -> Tensor:
    total = parts[..., -1]
    for j in range(LIMBS - 2, -1, -1):  # top down: exact until a partial needs 54+ bits
        total = total + parts[..., j]
    return total


def exact_parts(values: Tensor) -> Tensor:
    """The exact sum of ``values`` along the last dimension as float64 parts ``[...,
    LIMBS]`` (see :func:`to_parts`), detached. A row holding an inf or a NaN has the plain
    IEEE sum as its top part and zeros below, so its parts still add up to its sum."""
    with torch.no_grad():
        converted = values.detach().to(torch.float64)
        finite = torch.isfinite(converted).all(-1, keepdim=True)
        parts = to_parts(limbs(converted))
        plain = torch.cat([torch.zeros_like(parts[..., :-1]), converted.sum(-1, keepdim=True)], -1)
        return torch.where(finite, parts, plain)


def sum_of_parts(parts: Tensor, values: Tensor) -> Tensor:
    """The float64 within one ulp of the exact sum whose :func:`exact_parts` are
    ``parts``, with the gradient of ``values.sum(-1)`` (1 for every element)."""
    converted = values.to(torch.float64)
    plain = converted.sum(-1)  # non-finite data (inf, NaN) decides the result by IEEE rules
    exact = _add_down(parts)
    if plain.requires_grad:
        # plain - plain.detach() is exactly +0 where finite and carries the gradient (1 per
        # value); the exact sum is never -0, so without a gradient it is left out
        exact = exact + (plain - plain.detach())
    finite = torch.isfinite(converted.detach()).all(-1)
    return torch.where(finite, exact, plain)


def exact_sum(values: Tensor) -> Tensor:
    """The float64 within one ulp of the exact sum of ``values`` along its last
    dimension: the same bits for any arrangement of the same values."""
    return sum_of_parts(exact_parts(values), values)


def _stack(rows: Mapping[str, Tensor]) -> Tensor:
    return torch.stack([row.to(torch.float64) for row in rows.values()])


def exact_sums(rows: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The exact sums of several same-shaped named tensors along their last dimension,
    in one stacked :func:`exact_sum` (rows are summed independently, so each result has
    the bits it would have alone)."""
    if not rows:
        return {}
    return dict(zip(rows, exact_sum(_stack(rows)).unbind(0), strict=True))


def exact_sums_and_parts(
    summed: Mapping[str, Tensor], others: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """For same-shaped named rows, in one stacked pass: the exact sums (with gradient) of
    the ``summed`` rows, and the :func:`exact_parts` of every row of both."""
    rows = {**summed, **others}
    if not rows:
        return {}, {}
    stacked = _stack(rows)
    parts = exact_parts(stacked)
    k = len(summed)
    sums = sum_of_parts(parts[:k], stacked[:k]).unbind(0) if k else ()
    return dict(zip(summed, sums, strict=True)), dict(zip(rows, parts.unbind(0), strict=True))
