"""Conversion between packed (concatenated, ``cu_seqlens``) and regular ``[B, T]`` inputs.

The loss reads packed inputs through :func:`unpack`, which scatters the tokens into a
``[B, max_seqlen]`` grid with one ``index_copy`` per tensor and no host sync (the
destination of every token comes from ``cu_seqlens`` on the device). From there both
layouts run the same code, and every reduction is an
:func:`~steptally.client.loss.exact_sum.exact_sum`, whose result does not depend on the
padding, so the fragments of the same tokens are bit-identical in either layout.

:func:`pack` is the inverse, a host-side helper for tests and data preparation: it needs
the sequence lengths as Python ints (or reads them from the token masks, with a sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from steptally.client.loss.errors import InputError
from steptally.client.loss.inputs import TOKEN_FIELDS, LossInputs, PackedLossInputs


def _destinations(cu_seqlens: Tensor, length: int, width: int) -> Tensor:
    """Flat grid index of each packed position; padding goes to a spill slot past the end."""
    bounds = cu_seqlens.to(torch.int64)
    count = bounds.shape[0] - 1
    position = torch.arange(length, device=bounds.device)
    sequence = torch.searchsorted(bounds, position, right=True) - 1
    offset = position - bounds[sequence.clamp(0, count)]
    inside = (sequence >= 0) & (sequence < count) & (offset < width)
    return torch.where(inside, sequence * width + offset, count * width)


def _scatter(values: Tensor, where: Tensor, count: int, width: int) -> Tensor:
    grid = values.new_zeros((count * width + 1,))
    return grid.index_copy(0, where, values)[:-1].view(count, width)


def unpack(packed: PackedLossInputs) -> LossInputs:
    """The regular ``[B, max_seqlen]`` inputs holding the same tokens (sync-free)."""
    flat = packed.tokens
    if flat.curr_logprobs.dim() != 1:
        raise InputError(
            f"packed per-token tensors must be flat [N], not {list(flat.curr_logprobs.shape)}"
        )
    count, width = packed.cu_seqlens.shape[0] - 1, packed.max_seqlen
    where = _destinations(packed.cu_seqlens, flat.curr_logprobs.shape[0], width)
    grids = {
        name: _scatter(value, where, count, width)
        for name in TOKEN_FIELDS
        if (value := getattr(flat, name)) is not None
    }
    return replace(flat, **grids)


def sequence_lengths(inputs: LossInputs) -> list[int]:
    """Each row's length as the position after its last masked-in token (host sync)."""
    mask = inputs.token_mask.to(torch.bool)
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return [int(v) for v in torch.where(mask, positions, 0).amax(1).tolist()]


def pack(inputs: LossInputs, lengths: Sequence[int] | None = None) -> PackedLossInputs:
    """The packed form of regular ``inputs``; row ``i`` keeps its first ``lengths[i]``
    positions (default: :func:`sequence_lengths`). A host-side helper."""
    lengths = list(lengths) if lengths is not None else sequence_lengths(inputs)
    if len(lengths) != inputs.curr_logprobs.shape[0]:
        raise InputError(f"{len(lengths)} lengths for {inputs.curr_logprobs.shape[0]} rows")
    device = inputs.curr_logprobs.device
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    flat = {
        name: torch.cat([row[:n] for row, n in zip(value, lengths, strict=True)])
        for name in TOKEN_FIELDS
        if (value := getattr(inputs, name)) is not None
    }
    return PackedLossInputs(replace(inputs, **flat), cu, max(lengths, default=0))
