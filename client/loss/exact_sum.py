"""Reproducible sums: the same bits whatever the layout, padding, order or device.

A plain ``tensor.sum`` rounds along a reduction tree that depends on the shape, the
kernel and the device, so the same tokens laid out as a padded ``[B, T]`` batch or as a
packed sequence give sums that differ in the last bits. :func:`exact_sum` instead
pre-rounds every value onto a grid fixed by the largest magnitude (the "binned" scheme of
Demmel and Nguyen's ReproBLAS): on each fold, ``(x + σ) - σ`` rounds ``x`` to a multiple
of ``ulp(σ)``, and because every such multiple and every partial sum of them is exact in
float64, the fold's sum is exact in any order. The remainder ``x - hi`` (also exact) goes
to the next fold. Three folds keep about 63 bits below the largest magnitude; the folds are
then added smallest first, so the result is within about one ulp of the exact sum and
identical for any arrangement of the same multiset of values. Zeros (padding, masked
positions) change nothing.

The sum is differentiable: its gradient is 1 for every element, as for ``tensor.sum``.
Non-finite values are data: when the plain sum is not finite (an inf or a NaN among the
values), it is the result, as IEEE arithmetic gives it in any order. Sums of up to 2**33
values per row are exact per fold; magnitudes above 2**989 fall outside the guarantee,
and so does the one-ulp accuracy of a row whose largest magnitude is below 2**-950 (its
grid is coarser than its values; the result is still the same bits in any order).
The folds run without autograd on two float64 buffers, in place; the gradient rides on
``plain - plain.detach()``, which is exactly 0. No host sync anywhere. Rows are summed
independently, so :func:`exact_sums` stacks many same-shaped rows into one call (one
set of kernels instead of one per row) without changing a bit of any of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

_HEADROOM = 32  # log2 of the terms one fold can sum exactly, minus one
_FOLDS = 3
_STEP = 53 - _HEADROOM  # the grid of the next fold starts where the remainder ends
_NEXT_GRID = 2.0**-_STEP  # exact: every grid stays a normal float64 (see _folded)


def _folded(values: Tensor, *, owned: bool = False) -> Tensor:
    """The binned sum of finite float64 ``values`` (no autograd; two float64 buffers, in
    place). With ``owned`` the caller hands ``values`` over and it is used as the first
    buffer (its contents are destroyed); otherwise it is copied.

    The grid exponents are clamped to [-1000, 989] + ``_HEADROOM``, so the three grids
    ``σ_f = 1.5·2**(e + 32 - 21 f)`` lie in [2**-1010, 2**1022): each is the previous one
    times ``2**-21``, exactly, without rebuilding it from its exponent.
    """
    top = torch.maximum(-values.amin(-1, keepdim=True), values.amax(-1, keepdim=True))
    exponent = torch.frexp(top).exponent.to(torch.int64).clamp(-1000, 989)
    # 2**(exponent + _HEADROOM) from its bits (exact on every device; always normal)
    sigma = 1.5 * ((exponent + (_HEADROOM + 1023)) << 52).view(torch.float64)
    body = values if owned else values.clone()
    grid = torch.empty_like(body)
    parts: list[Tensor] = []
    for fold in range(_FOLDS):
        if fold:
            sigma = sigma * _NEXT_GRID
        torch.add(body, sigma, out=grid)
        grid.sub_(sigma)
        parts.append(grid.sum(-1))
        if fold + 1 < _FOLDS:
            body.sub_(grid)
    total = parts[-1]
    for part in reversed(parts[:-1]):
        total = total + part
    return total


def _exact_sum(values: Tensor, *, owned: bool) -> Tensor:
    converted = values.to(torch.float64)
    plain = converted.sum(-1)  # non-finite data (inf, NaN) decides the result by IEEE rules
    with torch.no_grad():
        folded = _folded(converted.detach(), owned=owned or converted is not values)
    if plain.requires_grad:
        # plain - plain.detach() is exactly +0 where finite and carries the gradient (1 per
        # value); the folded sum is never -0, so without a gradient it is left out
        folded = folded + (plain - plain.detach())
    return torch.where(torch.isfinite(plain), folded, plain)


def exact_sum(values: Tensor) -> Tensor:
    """The reproducible float64 sum of ``values`` along its last dimension."""
    return _exact_sum(values, owned=False)


def exact_sums(rows: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The exact sums of several same-shaped named tensors along their last dimension,
    in one stacked :func:`exact_sum` (rows are summed independently, so each result has
    the bits it would have alone)."""
    if not rows:
        return {}
    stacked = torch.stack([row.to(torch.float64) for row in rows.values()])
    return dict(zip(rows, _exact_sum(stacked, owned=True).unbind(0), strict=True))
