"""Exact diagnostics from any trainer's own per-token tensors (needs torch).

For trainers that keep their own loss: ``PolicyDiagnostics(config)(logprobs=...,
mask=..., advantages=..., ...)`` returns one microbatch's fragments (exact numerators,
counts and guarded extrema, with the ``-inf`` keep-mask semantics) without touching the
loss, its gradient or the host; ``metric_spec()`` declares how the service divides them
once per step. Hand both to a :class:`~steptally.client.Reporter`::

    diagnostics = PolicyDiagnostics(DiagnosticsConfig(epsilon_low=0.2, reference=True))
    reporter = Reporter(url, run="grpo", spec=diagnostics.metric_spec())
    reporter.log(step, diagnostics(logprobs=lp, mask=mask, advantages=adv, ...))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from steptally.client.algebra import MetricSpec
from steptally.client.diagnostics.config import DiagnosticsConfig
from steptally.client.diagnostics.fragments import PolicyTensors, policy_fragments
from steptally.client.diagnostics.names import Metric, Signal
from steptally.client.diagnostics.spec import metric_spec

__all__ = ["DiagnosticsConfig", "Metric", "PolicyDiagnostics", "PolicyTensors", "Signal"]


class PolicyDiagnostics:
    """The fragments of one microbatch and the spec that combines them; a shell over
    :func:`~.fragments.policy_fragments` and :func:`~.spec.metric_spec`."""

    def __init__(
        self, config: DiagnosticsConfig | None = None, aliases: Mapping[str, str] | None = None
    ) -> None:
        self.config = config or DiagnosticsConfig()
        self.aliases = dict(aliases or {})

    def __call__(
        self,
        *,
        logprobs: Tensor,
        mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        sampling_logprobs: Tensor | None = None,
        entropies: Tensor | None = None,
        importance_ratio: Tensor | None = None,
        unfiltered_logprobs: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The microbatch's fragments (see :class:`PolicyTensors` for the tensors)."""
        tensors = PolicyTensors(
            logprobs,
            mask,
            advantages,
            old_logprobs,
            ref_logprobs,
            sampling_logprobs,
            entropies,
            importance_ratio,
            unfiltered_logprobs,
        )
        fragments: dict[str, Tensor] = policy_fragments(self.config, tensors)
        return fragments

    def metric_spec(self, alerts: Sequence[Mapping[str, Any]] | None = None) -> MetricSpec:
        """The run's metric spec, the aliases included, with ``alerts`` (None: the
        :func:`~steptally.client.diagnostics.spec.default_alerts`; ``[]``: none)."""
        return metric_spec(self.config, self.aliases, alerts)
