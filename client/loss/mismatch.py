"""Diagnostics of the mismatch between the previous (trainer) and generation policies.

They read only the previous and the generation logprobs, so they reduce over the full
mask narrowed by the previous-policy keep mask alone, never by the current one:

- ``token_mult_prob_error``: exp(|gen - prev|);
- ``gen_kl_error``: k(prev - gen), the KL estimate of KL(gen ‖ prev);
- ``policy_kl_error``: k(gen - prev), of KL(prev ‖ gen);
- ``js_divergence_error``: ½·(h(prev) + h(gen)) with h(p) = e^(p-m) - (p-m) - 1,
  that is k3(p - m), over the mixture m = log(½e^prev + ½e^gen), computed stably from
  max(prev, gen).

k is the configured estimator, without clamps. All values are detached; outside the
mask they are finite but not 0, for callers that multiply by a weight that is 0 there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from steptally.client.loss.kl import kl_estimate
from steptally.client.loss.names import Diagnostic


def _log_mixture(prev: Tensor, gen: Tensor) -> Tensor:
    top = torch.maximum(prev, gen)
    return top + torch.log(torch.exp(prev - top) + torch.exp(gen - top)) - math.log(2.0)


def mismatch_values(prev: Tensor, gen: Tensor, mask: Tensor, kind: str) -> dict[Diagnostic, Tensor]:
    """Per-token values of the four diagnostics; outside ``mask`` both logprobs read as 0,
    so every value there is finite (a weight of 0 makes it an exact 0)."""
    prev = torch.where(mask, prev.detach(), 0.0)
    gen = torch.where(mask, gen, 0.0)
    diff = gen - prev
    mixture = _log_mixture(prev, gen)
    js = 0.5 * (kl_estimate(prev - mixture, "k3") + kl_estimate(gen - mixture, "k3"))
    return {
        Diagnostic.TOKEN_MULT_PROB_ERROR: torch.exp(diff.abs()),
        Diagnostic.GEN_KL_ERROR: kl_estimate(-diff, kind),
        Diagnostic.POLICY_KL_ERROR: kl_estimate(diff, kind),
        Diagnostic.JS_DIVERGENCE_ERROR: js,
    }
