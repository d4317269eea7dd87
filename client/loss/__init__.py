"""The clipped policy-gradient loss and the fragments of its diagnostics (needs torch).

``ClippedPGLoss(config)(inputs) -> (loss, fragments)``; ``metric_spec()`` declares how
the service combines the fragments; :func:`fragments_to_host` resolves them on the
reporter's side; :class:`Fragment` and :class:`Diagnostic` name them. See
:mod:`steptally.client.loss.masks` for the mask semantics and
:mod:`steptally.client.loss.fragments` for how an empty min/max is handled.
"""

from steptally.client.loss.config import ClippedPGConfig
from steptally.client.loss.errors import ConfigError, InputError, LossError
from steptally.client.loss.exact_sum import exact_sum
from steptally.client.loss.fragments import fragments_to_host
from steptally.client.loss.inputs import (
    LossInputs,
    Normalisers,
    PackedLossInputs,
    local_normalisers,
)
from steptally.client.loss.loss import ClippedPGLoss
from steptally.client.loss.masks import mask_out_neg_inf_logprobs
from steptally.client.loss.names import Diagnostic, Fragment
from steptally.client.loss.packing import pack, unpack
from steptally.client.loss.spec import EXTREME_COMPANIONS, metric_spec

__all__ = [
    "EXTREME_COMPANIONS",
    "ClippedPGConfig",
    "ClippedPGLoss",
    "ConfigError",
    "Diagnostic",
    "Fragment",
    "InputError",
    "LossError",
    "LossInputs",
    "Normalisers",
    "PackedLossInputs",
    "exact_sum",
    "fragments_to_host",
    "local_normalisers",
    "mask_out_neg_inf_logprobs",
    "metric_spec",
    "pack",
    "unpack",
]
