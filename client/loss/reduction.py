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
from steptally.client.loss.exact_sum import exact_sums
from steptally.client.loss.inputs import LossInputs, Scalar
from steptally.client.loss.names import Fragment as F
from steptally.client.loss.ratio import safe_divisor
from steptally.client.loss.terms import Terms

Rows = dict[str, Tensor]


def loss_rows(config: ClippedPGConfig, batch: LossInputs, terms: Terms) -> tuple[Rows, Rows]:
    """The rows whose exact sums are the loss numerators (with grad): flat per-token rows
    ``[B·T]`` and per-sequence rows ``[B]``. Token level: actor and KL are Σ w·ℓ and Σ kl
    over their masks. Sequence level: each sequence's exact sum over its token-mask count
    (one stacked exact sum for the numerators and the counts), then summed over
    sequences. The NLL is always a flat token sum. Returned unsummed, so the fragments can
    add their own rows to the same stacked sums."""
    masks = terms.masks
    weighted: Rows = {F.ACTOR_LOSS_NUM: terms.surrogate * masks.actor_weight}
    if terms.kl is not None:
        weighted[F.KL_PENALTY_NUM] = terms.kl * masks.full_weight
    tokens: Rows = {}
    seqs: Rows = {}
    if config.token_level_loss:
        tokens.update({name: value.reshape(-1) for name, value in weighted.items()})
    else:
        rows = exact_sums({**weighted, "": batch.token_mask.to(torch.float64)})
        per_row = safe_divisor(rows.pop(""))
        seqs.update({name: value / per_row for name, value in rows.items()})
    if config.nll_enabled:
        assert terms.correct is not None
        correct = torch.where(terms.correct[:, None], masks.actor_weight, 0.0)
        tokens[F.NLL_NUM] = (-terms.curr * correct).reshape(-1)
    return tokens, seqs


def loss_numerators(config: ClippedPGConfig, batch: LossInputs, terms: Terms) -> dict[str, Tensor]:
    """``actor_loss_num`` and, when enabled, ``kl_penalty_num`` and ``nll_num`` (with grad)."""
    tokens, seqs = loss_rows(config, batch, terms)
    return {**exact_sums(tokens), **exact_sums(seqs)}


def _divisor(value: Scalar) -> Tensor | float:
    if isinstance(value, Tensor):
        return safe_divisor(value.to(torch.float64))
    return value if value > 0 else 1.0


def loss_value(config: ClippedPGConfig, batch: LossInputs, numerators: dict[str, Tensor]) -> Tensor:
    """The microbatch's share of the step loss, in the current logprobs' dtype."""
    scale = batch.global_valid_tokens if config.token_level_loss else batch.global_valid_seqs
    total = numerators[F.ACTOR_LOSS_NUM]
    if F.KL_PENALTY_NUM in numerators:
        total = total + config.reference_policy_kl_penalty * numerators[F.KL_PENALTY_NUM]
    total = total / _divisor(scale)
    if F.NLL_NUM in numerators:
        assert batch.global_correct_tokens is not None
        nll = numerators[F.NLL_NUM] / _divisor(batch.global_correct_tokens)
        total = total + config.positive_example_nll_weight * nll
    return total.to(batch.curr_logprobs.dtype)
