"""The loss value: loss-scale numerators over the global normalisers of the full mask.

Token level: actor = Σ w·ℓ·A / N_tok. Sequence level: each sequence's mean of w·ℓ over
its *original* token mask (a filtered token adds 0 rather than reweighting the rest),
weighted by the sample mask, / N_seq. The KL is reduced the same way over the full mask;
the NLL term is Σ -curr over retained correct tokens / N_correct. Every numerator is an
:func:`~steptally.client.loss.exact_sum.exact_sum` in float64 and is emitted as a
fragment too, so the step's loss is reproducible from the fragments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.exact_sum import exact_sum
from steptally.client.loss.inputs import LossInputs, Scalar
from steptally.client.loss.ratio import safe_divisor
from steptally.client.loss.terms import Terms


def _reduce(config: ClippedPGConfig, values: Tensor, weight: Tensor, token_mask: Tensor) -> Tensor:
    weighted = values * weight
    if config.token_level_loss:
        return exact_sum(weighted.flatten())
    per_row = exact_sum(token_mask.to(torch.float64))
    return exact_sum(exact_sum(weighted) / safe_divisor(per_row))


def loss_numerators(config: ClippedPGConfig, batch: LossInputs, terms: Terms) -> dict[str, Tensor]:
    """``actor_loss_num`` and, when enabled, ``kl_penalty_num`` and ``nll_num`` (with grad)."""
    masks = terms.masks
    out = {"actor_loss_num": _reduce(config, terms.surrogate, masks.actor_weight, batch.token_mask)}
    if terms.kl is not None:
        out["kl_penalty_num"] = _reduce(config, terms.kl, masks.full_weight, batch.token_mask)
    if config.nll_enabled:
        assert terms.correct is not None
        correct = torch.where(terms.correct[:, None], masks.actor_weight, 0.0)
        out["nll_num"] = exact_sum((-terms.curr * correct).flatten())
    return out


def _divisor(value: Scalar) -> Tensor | float:
    if isinstance(value, Tensor):
        return safe_divisor(value.to(torch.float64))
    return value if value > 0 else 1.0


def loss_value(config: ClippedPGConfig, batch: LossInputs, numerators: dict[str, Tensor]) -> Tensor:
    """The microbatch's share of the step loss, in the current logprobs' dtype."""
    scale = batch.global_valid_tokens if config.token_level_loss else batch.global_valid_seqs
    total = numerators["actor_loss_num"]
    if "kl_penalty_num" in numerators:
        total = total + config.reference_policy_kl_penalty * numerators["kl_penalty_num"]
    total = total / _divisor(scale)
    if "nll_num" in numerators:
        assert batch.global_correct_tokens is not None
        nll = numerators["nll_num"] / _divisor(batch.global_correct_tokens)
        total = total + config.positive_example_nll_weight * nll
    return total.to(batch.curr_logprobs.dtype)
