"""Realistic synthetic microbatches, deterministic from a seed (for the demo and benchmarks).

Each sequence has a prompt (outside the token mask) and a response of uneven length;
generation logprobs lie around -1..-3, the previous and current policies drift from them
by a little noise, and a few response tokens are -inf on the current side (top-k/top-p
filtering) and on the previous side. Advantages are per sequence (GRPO-style) plus noise,
rewards follow their sign, and sample masks include fractional and zero weights. The
global normalisers of a step are filled in from all of its microbatches.
:func:`random_layout` cuts one batch's sequences into a random layout of ranks and
microbatches (trimmed, padded or packed), for tests of layout invariance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from steptally.client.loss.inputs import (
    SEQUENCE_FIELDS,
    TOKEN_FIELDS,
    LossInputs,
    PackedLossInputs,
    local_normalisers,
)
from steptally.client.loss.packing import pack

SAMPLE_WEIGHTS = (1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.0)
Microbatch = LossInputs | PackedLossInputs


def _layout(g: torch.Generator, sequences: int, max_len: int) -> tuple[Tensor, Tensor]:
    """(in_sequence, token_mask) for uneven prompts and responses."""
    lengths = torch.randint(max(2, max_len // 4), max_len + 1, (sequences,), generator=g)
    prompts = (torch.rand(sequences, generator=g) * (lengths - 1) / 2).long()
    positions = torch.arange(max_len)
    in_sequence = positions < lengths[:, None]
    return in_sequence, in_sequence & (positions >= prompts[:, None])


def _logprobs(g: torch.Generator, shape: tuple[int, int]) -> dict[str, Tensor]:
    gen = -(1.0 + 2.0 * torch.rand(shape, generator=g))
    prev = gen + 0.05 * torch.randn(shape, generator=g)
    curr = prev + 0.05 * torch.randn(shape, generator=g)
    ref = prev + 0.1 * torch.randn(shape, generator=g)
    return {
        name: t.clamp(max=-1e-3)
        for name, t in (("gen", gen), ("prev", prev), ("curr", curr), ("ref", ref))
    }


def _filter(g: torch.Generator, values: Tensor, mask: Tensor, fraction: float) -> Tensor:
    hit = (torch.rand(values.shape, generator=g) < fraction) & mask
    return torch.where(hit, float("-inf"), values)


def synthetic_microbatch(
    seed: int,
    sequences: int = 4,
    max_len: int = 64,
    *,
    curr_filtered: float = 0.03,
    prev_filtered: float = 0.02,
    device: str | torch.device = "cpu",
    requires_grad: bool = True,
) -> LossInputs:
    """One microbatch ``[sequences, max_len]`` whose normalisers are its own (see
    :func:`synthetic_step` for a step's global ones). Same seed, same tensors."""
    g = torch.Generator().manual_seed(seed)
    in_seq, mask = _layout(g, sequences, max_len)
    lp = _logprobs(g, (sequences, max_len))
    curr = _filter(g, lp["curr"], mask, curr_filtered)
    prev = _filter(g, lp["prev"], mask, prev_filtered)
    score = torch.randn(sequences, generator=g)
    advantages = score[:, None] + 0.1 * torch.randn((sequences, max_len), generator=g)
    pick = torch.randint(len(SAMPLE_WEIGHTS), (sequences,), generator=g)
    tensors = {
        "curr_logprobs": curr,
        "prev_logprobs": prev,
        "generation_logprobs": lp["gen"],
        "reference_logprobs": lp["ref"],
        "curr_logprobs_unfiltered": lp["curr"],
        "advantages": advantages,
    }
    moved = {k: torch.where(in_seq, v, 0.0).to(device) for k, v in tensors.items()}
    moved["curr_logprobs"].requires_grad_(requires_grad)
    moved["curr_logprobs_unfiltered"].requires_grad_(requires_grad)
    batch = LossInputs(
        **moved,
        token_mask=mask.to(device),
        sample_mask=torch.tensor(SAMPLE_WEIGHTS)[pick].to(device),
        rewards=(score > 0).to(torch.float32).to(device),
        global_valid_tokens=1.0,
        global_valid_seqs=1.0,
        global_correct_tokens=1.0,
    )
    return with_global_normalisers([batch])[0]


def with_global_normalisers(batches: Sequence[LossInputs]) -> list[LossInputs]:
    """``batches`` with the normalisers set to their totals over all of them (host-side)."""
    shares = [local_normalisers(b) for b in batches]
    tokens = sum(float(s.valid_tokens) for s in shares)
    seqs = sum(float(s.valid_seqs) for s in shares)
    correct = sum(float(s.correct_tokens) for s in shares)
    return [
        replace(
            b, global_valid_tokens=tokens, global_valid_seqs=seqs, global_correct_tokens=correct
        )
        for b in batches
    ]


def synthetic_step(
    seed: int,
    microbatches_per_rank: Sequence[int] = (3, 2),
    sequences: int = 4,
    max_len: int = 64,
    *,
    device: str | torch.device = "cpu",
    requires_grad: bool = True,
) -> list[list[LossInputs]]:
    """One step over several ranks: ``result[rank][i]``, uneven counts and lengths, with
    the step's global normalisers in every microbatch."""
    flat: list[LossInputs] = []
    for index in range(sum(microbatches_per_rank)):
        rows = max(1, sequences - index % 3)
        width = max(8, max_len - 7 * (index % 4))
        flat.append(
            synthetic_microbatch(
                seed * 1000 + index, rows, width, device=device, requires_grad=requires_grad
            )
        )
    flat = with_global_normalisers(flat)
    out: list[list[LossInputs]] = []
    for count in microbatches_per_rank:
        out.append(flat[:count])
        flat = flat[count:]
    return out


def rows_of(batch: LossInputs, rows: list[int], rng: random.Random) -> Microbatch:
    """Rows ``rows`` of ``batch`` as a microbatch: trimmed to its last masked column,
    widened with garbage padding, or packed."""
    index = torch.tensor(rows)
    picked = {
        n: v[index]
        for n in (*TOKEN_FIELDS, *SEQUENCE_FIELDS)
        if (v := getattr(batch, n)) is not None
    }
    part = replace(batch, **picked)
    layout = rng.choice(("trimmed", "widened", "packed"))
    if layout == "packed":
        return pack(part)
    if layout == "trimmed":
        width = int(part.token_mask.any(0).nonzero().max()) + 1 if part.token_mask.any() else 1
        return replace(
            part, **{n: v[:, :width] for n in TOKEN_FIELDS if (v := getattr(part, n)) is not None}
        )
    extra = rng.randint(1, 9)

    def widen(v: torch.Tensor) -> torch.Tensor:
        fill = rng.choice((-7.0, float("nan"))) if v.dtype.is_floating_point else 0
        return torch.cat([v, torch.full((len(rows), extra), fill, dtype=v.dtype)], 1)

    return replace(
        part, **{n: widen(v) for n in TOKEN_FIELDS if (v := getattr(part, n)) is not None}
    )


def random_layout(batch: LossInputs, rng: random.Random) -> list[list[Microbatch]]:
    """The batch's sequences shuffled over 1–4 ranks, in microbatches of 1–4 sequences."""
    order = list(range(batch.sample_mask.shape[0]))
    rng.shuffle(order)
    ranks: list[list[Microbatch]] = [[] for _ in range(rng.randint(1, 4))]
    while order:
        size = rng.choice((1, 1, 2, 3, 4))
        rows, order = order[:size], order[size:]
        rng.choice(ranks).append(rows_of(batch, rows, rng))
    return ranks
