"""The typed inputs of one loss call, regular ``[B, T]`` or packed.

Per-token tensors are already aligned to next-token positions (the caller's ``[:, 1:]``
cut is done). ``sample_mask`` may be fractional. The global normalisers are the step's
totals over all microbatches and ranks, taken from the original (unnarrowed) masks:
``global_valid_tokens`` = Σ token_mask·sample_mask, ``global_valid_seqs`` = Σ
sample_mask, and, with an NLL term, ``global_correct_tokens`` = Σ token_mask·sample_mask
over sequences whose reward is > 0. They may be Python floats or 0-d tensors (for
instance the result of an all-reduce); :func:`local_normalisers` computes one
microbatch's share of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.errors import InputError
from steptally.client.loss.exact_sum import exact_sum

Scalar = Tensor | float

TOKEN_FIELDS: tuple[str, ...] = (
    "curr_logprobs",
    "prev_logprobs",
    "generation_logprobs",
    "advantages",
    "token_mask",
    "reference_logprobs",
    "curr_logprobs_unfiltered",
    "prev_keep_mask",
)
SEQUENCE_FIELDS: tuple[str, ...] = ("sample_mask", "rewards")


@dataclass(frozen=True)
class LossInputs:
    """One microbatch as a padded ``[B, T]`` batch.

    ``curr_logprobs`` carries the gradient and may hold -inf where top-k/top-p filtering
    removed the sampled token; ``curr_logprobs_unfiltered`` (needed when the KL penalty
    is on) is the same forward without filtering. ``prev_logprobs`` may hold -inf too,
    and ``prev_keep_mask``, when given, narrows the previous side further.
    ``rewards`` [B] (needed for the NLL term) marks correct sequences by reward > 0.
    """

    curr_logprobs: Tensor
    prev_logprobs: Tensor
    generation_logprobs: Tensor
    advantages: Tensor
    token_mask: Tensor
    sample_mask: Tensor
    global_valid_tokens: Scalar
    global_valid_seqs: Scalar
    reference_logprobs: Tensor | None = None
    curr_logprobs_unfiltered: Tensor | None = None
    prev_keep_mask: Tensor | None = None
    rewards: Tensor | None = None
    global_correct_tokens: Scalar | None = None


@dataclass(frozen=True)
class PackedLossInputs:
    """One microbatch as concatenated sequences.

    ``tokens`` is a :class:`LossInputs` whose per-token tensors are flat ``[N]`` (the
    sequences back to back, then any padding) and whose per-sequence tensors are ``[B]``.
    ``cu_seqlens`` [B+1] (a device tensor) holds the boundaries; ``max_seqlen`` (a host
    int, as flash-attention's varlen API takes it) bounds every sequence's length, so
    the loss lays the tokens out without a device sync.
    """

    tokens: LossInputs
    cu_seqlens: Tensor
    max_seqlen: int


def check_inputs(inputs: LossInputs, config: ClippedPGConfig) -> None:
    """Raise :class:`InputError` when shapes or optional inputs do not fit ``config``."""
    shape = tuple(inputs.curr_logprobs.shape)
    if len(shape) != 2:
        raise InputError(f"curr_logprobs must be [B, T], not {list(shape)}")
    for name in TOKEN_FIELDS:
        value = getattr(inputs, name)
        if value is not None and tuple(value.shape) != shape:
            raise InputError(
                f"{name} has shape {list(value.shape)}; curr_logprobs has "
                f"{list(shape)}, and every per-token input must match it"
            )
    for name in SEQUENCE_FIELDS:
        value = getattr(inputs, name)
        if value is not None and tuple(value.shape) != shape[:1]:
            raise InputError(
                f"{name} has shape {list(value.shape)}; it must be [B] = {list(shape[:1])}"
            )
    _check_present(inputs, config)


def _check_present(inputs: LossInputs, config: ClippedPGConfig) -> None:
    needed: list[tuple[str, str]] = []
    if config.kl_enabled:
        needed += [
            ("reference_logprobs", "reference_policy_kl_penalty is nonzero"),
            (
                "curr_logprobs_unfiltered",
                "reference_policy_kl_penalty is nonzero "
                "(pass curr_logprobs itself when nothing was filtered)",
            ),
        ]
    if config.nll_enabled:
        needed += [
            ("rewards", "positive_example_nll_weight is nonzero"),
            ("global_correct_tokens", "positive_example_nll_weight is nonzero"),
        ]
    for name, why in needed:
        if getattr(inputs, name) is None:
            raise InputError(f"the inputs need {name}, because {why}")


@dataclass(frozen=True)
class Normalisers:
    """One microbatch's share of the global normalisers (0-d float64 tensors)."""

    valid_tokens: Tensor
    valid_seqs: Tensor
    correct_tokens: Tensor


def local_normalisers(inputs: LossInputs) -> Normalisers:
    """Σ token_mask·sample_mask, Σ sample_mask and the correct-token share of ``inputs``
    (regular layout; no rewards means no correct tokens). Sum them over microbatches
    and ranks to get the global normalisers."""
    weight = inputs.token_mask.to(torch.float64) * inputs.sample_mask.to(torch.float64)[:, None]
    rows = exact_sum(weight)
    rewards = inputs.rewards
    correct = torch.zeros_like(rows) if rewards is None else torch.where(rewards > 0, rows, 0.0)
    return Normalisers(
        valid_tokens=exact_sum(rows),
        valid_seqs=exact_sum(inputs.sample_mask.to(torch.float64)),
        correct_tokens=exact_sum(correct),
    )
