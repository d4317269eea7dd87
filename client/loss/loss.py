"""The clipped policy-gradient loss: a thin shell over the terms, the loss reduction and
the fragments. Settings are in :class:`~steptally.client.loss.config.ClippedPGConfig`;
the masks each quantity reads are described in :mod:`steptally.client.loss.masks`.

A call returns the microbatch's share of the step loss (scaled by the global normalisers
of the full mask, so microbatch losses add up to the step loss) and its fragments, 0-d
float64 tensors on the same device. Nothing in a call syncs with the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from steptally.client.algebra import MetricSpec
from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.fragments import collect_fragments
from steptally.client.loss.inputs import LossInputs, PackedLossInputs, check_inputs
from steptally.client.loss.packing import unpack
from steptally.client.loss.reduction import loss_numerators, loss_value
from steptally.client.loss.spec import metric_spec
from steptally.client.loss.terms import compute_terms


class ClippedPGLoss:
    """``loss(inputs) -> (loss_tensor, fragments)`` for regular or packed inputs."""

    def __init__(self, config: ClippedPGConfig | None = None) -> None:
        self.config = config if config is not None else ClippedPGConfig()

    def metric_spec(self, alerts: Sequence[Mapping[str, Any]] | None = None) -> MetricSpec:
        """The metric spec that turns this loss's fragments into exact step values, with
        ``alerts`` (None: :func:`~steptally.client.loss.spec.default_alerts`; ``[]``: none)."""
        return metric_spec(self.config, alerts)

    def _regular(self, inputs: LossInputs | PackedLossInputs) -> LossInputs:
        batch = unpack(inputs) if isinstance(inputs, PackedLossInputs) else inputs
        check_inputs(batch, self.config)
        return batch

    def __call__(self, inputs: LossInputs | PackedLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        batch = self._regular(inputs)
        terms = compute_terms(self.config, batch)
        numerators, fragments = collect_fragments(self.config, batch, terms)
        return loss_value(self.config, batch, numerators), fragments

    def loss_only(self, inputs: LossInputs | PackedLossInputs) -> Tensor:
        """The same loss value without building fragments (the benchmark's baseline)."""
        batch = self._regular(inputs)
        terms = compute_terms(self.config, batch)
        return loss_value(self.config, batch, loss_numerators(self.config, batch, terms))
